"""What the trained drafters (MoA, EAGLE-2, independent) share.

- `TargetBoundConfig`: the config side: a drafter is built for one target (name, weights fingerprint,
  dimensions) and keeps K = `vocab_ids` rows of its LM head (0 = the full vocabulary).
- `TargetBoundDrafter`: the module side: the target's frozen embedding and (trimmed) LM head shared by
  `attach`, the `vocab_ids` buffer, the state dict of trainable weights, and the begin/observe plumbing
  of the `decoding.drafter.Drafter` protocol.
- Checkpoints: `save_checkpoint`/`read_checkpoint_config`/`load_checkpoint` by `kind` (config.json +
  model.safetensors, trainable weights and vocab ids only).
- Drafting masks over the drafter's own KV caches: `causal_mask`, `pending_mask` (the rows committed
  since the last round) and `place_frontier`/`tree_rows_mask` (one level of tree expansion in
  tentative cache slots).
"""

from __future__ import annotations

import hashlib
import json
import math
import types
import typing
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from moaspec.decoding.tree import Tree
from moaspec.drafters.layers import DraftLinear, apply_rows, drafting_rows
from moaspec.errors import UserError
from moaspec.files import atomic_write, atomic_write_text
from moaspec.models import quant
from moaspec.models.linear import Linear
from moaspec.models.parts import TargetParts
from moaspec.models.runtime import ModelConfig

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


# ============================================================================= configs
def check_heads(label: str, heads: int, kv_heads: int) -> None:
    """UserError unless an attention layer's `heads` are a (positive) multiple of its `kv_heads`."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise UserError(f"{label}: {heads} heads are not a multiple of {kv_heads} KV heads")


def check_dims(label: str, target_name: str, want: dict[str, int], model_cfg: ModelConfig) -> None:
    """UserError unless `model_cfg` has the dimensions `want` (a drafter's record of its target)."""
    have = {k: getattr(model_cfg, k) for k in want}
    if want != have:
        bad = ", ".join(f"{k} {want[k]} vs {have[k]}" for k in want if want[k] != have[k])
        raise UserError(f"this {label} drafter was built for target {target_name!r}, whose dimensions differ "
                        f"from the loaded target's ({bad})")


class TargetBoundConfig:
    """Mixin of the drafter config dataclasses. They have the fields `target_name`, `target_fingerprint`,
    `vocab_size`, `vocab_ids` and the target dimensions named by `target_dims` (class attributes, not
    fields: `label` (the drafter's name in messages), `target_dims` for `check_target`)."""

    label: ClassVar[str]
    target_dims: ClassVar[tuple[str, ...]]
    target_name: str
    vocab_size: int
    vocab_ids: int

    def _check_vocab_ids(self) -> None:
        if not 0 <= self.vocab_ids <= self.vocab_size:
            raise UserError(f"vocab_ids must be in 0..{self.vocab_size}, got {self.vocab_ids}")

    @property
    def head_size(self) -> int:
        """Rows of the drafter's LM head (K, or the full vocabulary)."""
        return self.vocab_ids or self.vocab_size

    def check_target(self, model_cfg: ModelConfig) -> None:
        """UserError unless `model_cfg` has the dimensions this drafter was built for."""
        check_dims(self.label, self.target_name, {k: getattr(self, k) for k in self.target_dims}, model_cfg)


# ============================================================================= drafting masks
def head_mode(weights: str) -> str:
    """The weight mode of a drafter's LM head for drafting under the target's `weights`: int8 where the
    target runs fp16. The head is over half the bytes a draft step streams (Qwen 0.5B: 29 of 51 MB) and
    a draft step is memory-bound, so int8 makes a step about a quarter cheaper; the drafts' argmax moves
    only where two logits lie within int8 rounding, and verification keeps the output exact anyway."""
    if weights != "fp16" or quant.kernels_or_none() is None:
        return weights  # no compiler here: the head stays fp16, without a warning about a mode nobody asked for
    return "int8"  # Linear itself falls back to 16-bit weights on an accelerator


def causal_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def pending_mask(start: int, n: int, device: torch.device | str | None = None) -> torch.Tensor | None:
    """Rows written at cache slots [start, start + n): all earlier slots, causal among themselves."""
    if n == 1:
        return None
    return torch.cat([torch.ones(n, start, dtype=torch.bool, device=device), causal_mask(n, device)], 1)


def tree_rows_mask(tree: Tree, frontier: list[int], slot_of: dict[int, int], committed: int, first: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """bool [f, first + f] for frontier rows written at slots first.. : every committed slot
    [0, committed), the tentative slots of the node's ancestors (from `slot_of`), and the row itself."""
    f = len(frontier)
    mask = torch.zeros(f, first + f, dtype=torch.bool, device=device)
    mask[:, :committed] = True
    for r, node in enumerate(frontier):
        mask[r, first + r] = True
        p = tree.parents[node]
        while p > 0:
            mask[r, slot_of[p]] = True
            p = tree.parents[p]
    return mask


def place_frontier(tree: Tree, frontier: list[int], slot_of: dict[int, int], committed: int,
                   device: torch.device | str | None = None) -> tuple[int, torch.Tensor]:
    """One level of tree expansion: give the frontier rows the next tentative cache slots, in order after
    the last slot in `slot_of` (tree node -> slot; it starts as {0: the root's slot}), record them there,
    and return (the first of them, their `tree_rows_mask`)."""
    first = max(slot_of.values()) + 1
    for r, node in enumerate(frontier):
        slot_of[node] = first + r
    return first, tree_rows_mask(tree, frontier, slot_of, committed, first, device)


# ============================================================================= drafters
class TargetBoundDrafter(nn.Module):
    """Base of the trained drafters: trainable weights built from a `TargetBoundConfig`; the target's
    frozen embedding and LM head (rows `vocab_ids`) are shared by `attach`, not copied, and are not in
    the state dict (which holds the trainable weights and the `vocab_ids` buffer).

    Subclasses implement `reset` (drafting state; it sets `tokens`, the committed tokens), `_allocate`
    (their caches) and, if the target sends context, `_add_context`; `begin`/`observe` are here."""

    name: ClassVar[str]
    config_cls: ClassVar[type[TargetBoundConfig]]
    branching: ClassVar[bool] = True

    def __init__(self, cfg: Any, max_seq_len: int = 4096):
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.register_buffer("vocab_ids", torch.arange(cfg.vocab_ids))  # placeholder ids; see set_vocab_ids
        self.register_load_state_dict_post_hook(TargetBoundDrafter._after_load)  # new ids -> new trimmed head
        self.target_cfg: ModelConfig | None = None
        self.embed: torch.Tensor | None = None
        self.full_head: torch.Tensor | None = None
        self.head: torch.Tensor | None = None  # [K, D]: full_head rows of vocab_ids (or full_head itself)
        self.weight_mode = "fp32"
        self.tokens: list[int] = []

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------ frozen target parts
    @classmethod
    def from_target(cls, target: TargetParts, cfg: Any, vocab_ids: torch.Tensor | None = None):
        """A drafter (fresh trainable weights) with the target's frozen parts attached, on its device."""
        drafter = cls(cfg, max_seq_len=target.max_seq_len).to(target.device)
        drafter.attach(target)
        if vocab_ids is not None:
            drafter.set_vocab_ids(vocab_ids)
        return drafter

    def attach(self, target: TargetParts) -> None:
        """Share the target's embedding and LM head (no copies)."""
        self.cfg.check_target(target.cfg)
        self.target_cfg = target.cfg
        self.embed = target.embed
        self.full_head = target.lm_head_weight.float()
        self.weight_mode = target.weights
        for m in self.modules():
            if isinstance(m, DraftLinear):
                m.mode = target.weights
        self._trim_head()

    def set_vocab_ids(self, ids: torch.Tensor) -> None:
        """Choose the target token ids the trimmed head keeps (K = cfg.vocab_ids of them, distinct)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.vocab_ids.device)
        if ids.shape != (self.cfg.vocab_ids,) or ids.unique().numel() != ids.numel():
            raise UserError(f"vocab_ids must be {self.cfg.vocab_ids} distinct token ids, got shape {tuple(ids.shape)}")
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.cfg.vocab_size):
            raise UserError(f"vocab_ids must lie in 0..{self.cfg.vocab_size - 1}")
        self.vocab_ids.copy_(ids)
        self._trim_head()

    def untrim(self) -> None:
        """Draft over the target's full vocabulary with the same trained weights: the ablation that
        measures what vocabulary trimming buys."""
        self.cfg = replace(self.cfg, vocab_ids=0)
        self._trim_head()

    @staticmethod
    def _after_load(module: TargetBoundDrafter, incompatible_keys: Any) -> None:
        module._trim_head()

    def _trim_head(self) -> None:
        if self.full_head is not None:
            self.head = self.full_head[self.vocab_ids].contiguous() if self.cfg.vocab_ids else self.full_head
            self._fast_head = Linear(self.head, mode=head_mode(self.weight_mode))  # drafting rows: decoding kernels

    def _require_target(self) -> None:
        if self.embed is None:
            raise UserError(f"the {self.cfg.label} drafter has no target attached: build it with "
                            f"{type(self).__name__}.from_target or load()")

    # ------------------------------------------------------------------ bookkeeping
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint holds: the trainable weights and the `vocab_ids` buffer."""
        return dict(self.state_dict())

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @classmethod
    def param_count(cls, cfg: Any) -> int:
        """Trainable parameters of a drafter with these sizes (built on the meta device: no memory)."""
        with torch.device("meta"):
            return cls(cfg, max_seq_len=1).num_trainable_parameters()

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """Drafter vocabulary index -> target token id (None: the full vocabulary, identity)."""
        return self.vocab_ids if self.cfg.vocab_ids else None

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """LM-head logits over the drafter's vocabulary for states [..., D]."""
        self._require_target()
        return apply_rows(self._fast_head, final) if drafting_rows(final) else F.linear(final, self.head)

    def _logprobs(self, final: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits(final), -1)

    # ------------------------------------------------------------------ Drafter protocol: begin / observe
    def reset(self) -> None:
        raise NotImplementedError

    def _allocate(self) -> None:
        raise NotImplementedError

    def _add_context(self, context: Any) -> None:
        """Take in what the target sends for newly committed tokens (nothing, unless overridden)."""

    @torch.no_grad()
    def begin(self, prompt: list[int], context: Any = None) -> None:
        self._require_target()
        self._allocate()
        self.reset()
        self.tokens = list(prompt)
        self._add_context(context)

    @torch.no_grad()
    def observe(self, tokens: list[int], context: Any = None) -> None:
        """`context` None: tokens written while the target was away (no target state for them)."""
        self.tokens.extend(tokens)
        if context is not None:
            self._add_context(context)


# ============================================================================= checkpoints
def save_checkpoint(drafter: TargetBoundDrafter, folder: str | Path, kind: str, fp16: bool = False) -> Path:
    """config.json (kind, format version, dtype, every config field) + model.safetensors (trainable
    weights and vocab ids only; fp16 halves the float tensors)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, t in drafter.trainable_state_dict().items():
        t = t.detach().to("cpu")
        tensors[k] = (t.half() if fp16 and t.is_floating_point() else t).contiguous()
    config = {"kind": kind, "format_version": FORMAT_VERSION, "dtype": "fp16" if fp16 else "fp32",
              **asdict(drafter.cfg)}
    atomic_write(folder / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"kind": kind}))
    atomic_write_text(folder / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return folder


def read_checkpoint_config(folder: str | Path, kind: str, cfg_cls: type[TargetBoundConfig]) -> Any:
    """The config (a `cfg_cls`) of the `kind` checkpoint in `folder` (UserError: missing, corrupt, other
    kind, newer format, missing fields)."""
    label = cfg_cls.label
    path = Path(folder) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no {label} drafter checkpoint at {folder}: {CONFIG_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} (corrupt?): {e}") from None
    if not isinstance(raw, dict) or raw.get("kind") != kind:
        got = raw.get("kind") if isinstance(raw, dict) else None
        raise UserError(f"{path} is not an {label} drafter checkpoint (kind {got!r}, expected {kind!r})")
    version = raw.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise UserError(f"{path} has format version {version!r}; this moaspec reads {FORMAT_VERSION}")
    hints = typing.get_type_hints(cfg_cls)
    values = {f.name: raw[f.name] for f in fields(cfg_cls) if f.name in raw}
    for name, value in values.items():
        if not _fits(value, hints[name]):
            raise UserError(f"{path}: {name} is {value!r}, not a {hints[name]}; retrain or copy the checkpoint again")
    try:
        return cfg_cls(**values)
    except TypeError as e:
        raise UserError(f"{path} is incomplete: {e}") from None


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a config field's type (ints as sizes: not negative, not bools)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for t in options:
        if t is type(None) and value is None:
            return True
        if t is bool and isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return True
        if t is str and isinstance(value, str):
            return True
        if t not in (type(None), bool, int, float, str):  # a type this check does not know: the config decides
            return True
    return False


def read_checkpoint(folder: str | Path, kind: str, cfg_cls: type[TargetBoundConfig], target_cfg: ModelConfig,
                    target_name: str, fingerprint: str, device: torch.device | str = "cpu") -> tuple[Any, dict]:
    """(config, tensors) of a `kind` checkpoint made for this target. UserError for a checkpoint of
    another target (name, weights fingerprint or dimensions), missing, corrupt or non-finite files."""
    folder = Path(folder)
    label = cfg_cls.label
    cfg = read_checkpoint_config(folder, kind, cfg_cls)
    if cfg.target_fingerprint != fingerprint or cfg.target_name != target_name:
        raise UserError(
            f"the {label} drafter in {folder} was trained for target {cfg.target_name!r} (weights fingerprint "
            f"{cfg.target_fingerprint}), not for {target_name!r} (fingerprint {fingerprint}); "
            "use a drafter trained for this target"
        )
    cfg.check_target(target_cfg)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise UserError(f"the {label} drafter checkpoint {folder} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(path), device=str(device))
    except Exception as e:  # safetensors raises SafetensorError, OSError, ValueError... on bad files
        raise UserError(f"cannot read {path} (corrupt or truncated? retrain or copy it again): {e}") from None
    if not all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()):
        raise UserError(f"{path} holds non-finite weights")
    return cfg, tensors


def load_checkpoint(folder: str | Path, kind: str, cls: type[TargetBoundDrafter], target: TargetParts,
                    target_name: str, fingerprint: str) -> Any:
    """Load a drafter saved by `save_checkpoint` and attach it to `target` (`read_checkpoint`'s checks)."""
    cfg, tensors = read_checkpoint(folder, kind, cls.config_cls, target.cfg, target_name, fingerprint, target.device)
    path = Path(folder) / WEIGHTS_FILE
    try:
        drafter = cls.from_target(target, cfg)
    except (ValueError, RuntimeError, ZeroDivisionError, TypeError) as e:  # sizes no drafter can have
        raise UserError(f"{Path(folder) / CONFIG_FILE} does not describe a drafter this moaspec can build: {e}") \
            from None
    try:
        drafter.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise UserError(f"{path} does not match its {CONFIG_FILE}: {e}") from None
    if cfg.vocab_ids and (drafter.vocab_ids.min() < 0 or drafter.vocab_ids.max() >= cfg.vocab_size):
        raise UserError(f"{path} holds vocabulary ids outside the target's vocabulary")
    return drafter.eval()


def encoder_id(encoder: Any) -> str:
    """A name for a drafter's target-side encoder that both ends of a client-server link compute: its
    class and a hash of its weights, so that a server never encodes for a drafter trained otherwise."""
    kind = type(encoder).__name__
    h = hashlib.sha256(kind.encode())
    if isinstance(encoder, nn.Module):
        for name, t in sorted(encoder.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().to("cpu", torch.float16).contiguous().numpy().tobytes())
    else:
        h.update(repr(getattr(encoder, "hidden_layers", ())).encode())
    return f"{kind}-{h.hexdigest()[:16]}"


__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "WEIGHTS_FILE",
    "TargetBoundConfig",
    "TargetBoundDrafter",
    "causal_mask",
    "check_dims",
    "check_heads",
    "encoder_id",
    "load_checkpoint",
    "pending_mask",
    "place_frontier",
    "read_checkpoint",
    "read_checkpoint_config",
    "save_checkpoint",
    "tree_rows_mask",
]
