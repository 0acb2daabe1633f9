"""EAGLE-2 drafter: the feature-level autoregressive baseline MoA is compared with (PAPER.md sections 2, 5, 7).

Target side: `FeatureEncoder` hands the drafter the target's final (post-norm) hidden state f_j of every
newly committed slot j. Drafting side: `EagleDrafter`, one decoder layer of the target's width over

    x_j = fc(concat[embed(x_{j+1}), f_j])          (fc: Linear 2D -> D with bias, as in EAGLE)

whose output predicts f_{j+1}; the frozen (optionally trimmed) target LM head turns it into the
distribution of x_{j+2} directly (f is post-norm, so no final norm). As in EAGLE the layer has no input
RMSNorm (`EagleConfig.input_norm = False`; set it True to keep one).

Alignment (inference and training): row j pairs the feature of slot j with the token of slot j + 1 and
sits at RoPE position j. After the target has committed slots 0..P-1 (features f_0..f_{P-1}) and
emitted the root x_P, the drafter runs the pending rows (f_j, x_{j+1}) and the root row
(f_{P-1}, x_P) at slot P - 1, whose output f^_P gives the root's children. A drafted node at depth d
is the row (prediction of its parent's row, its own token) at position P - 1 + d in a tentative
cache slot: EAGLE feeds its own predicted features back while drafting (off-policy, PAPER.md 2).
Only trainable weights (fc, the layer) and `vocab_ids` are in the state dict.

This file also holds what `drafters/independent.py` shares with it (a base class for drafters bound
to a target with a frozen embedding and trimmed LM head, checkpoint save/load by `kind`); they could
move to a common module together with moa.py's copies.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from moaspec.decoding.tree import Tree, TreeConfig, grow_tree
from moaspec.drafters.layers import DecoderLayer, KVCache, rope
from moaspec.errors import UserError
from moaspec.models.runtime import ModelConfig, Transformer

KIND = "eagle"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_NOISE = 0.1  # EAGLE's training noise on the input features: U(-0.1, 0.1)


# ============================================================================= shared with independent.py
def check_dims(label: str, target_name: str, want: dict[str, int], model_cfg: ModelConfig) -> None:
    """UserError unless `model_cfg` has the dimensions `want` (a drafter's record of its target)."""
    have = {k: getattr(model_cfg, k) for k in want}
    if want != have:
        bad = ", ".join(f"{k} {want[k]} vs {have[k]}" for k in want if want[k] != have[k])
        raise UserError(f"this {label} drafter was built for target {target_name!r}, whose dimensions differ "
                        f"from the loaded target's ({bad})")


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


class TargetBoundDrafter(nn.Module):
    """Base of the trained baselines: trainable weights built from a config with `target_name`,
    `target_fingerprint`, `vocab_size`, `vocab_ids` (K, 0 = full vocabulary), `check_target(model_cfg)`;
    the target's frozen embedding and LM head (rows `vocab_ids`) are shared by `attach`, not copied, and
    are not in the state dict (which holds the trainable weights and the `vocab_ids` buffer)."""

    name: ClassVar[str]
    label: ClassVar[str]  # for messages
    config_cls: ClassVar[type]

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

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @classmethod
    def from_target(cls, target: Transformer, cfg: Any, vocab_ids: torch.Tensor | None = None):
        """A drafter (fresh trainable weights) with the target's frozen parts attached, on its device."""
        drafter = cls(cfg, max_seq_len=target.max_seq_len).to(target.device)
        drafter.attach(target)
        if vocab_ids is not None:
            drafter.set_vocab_ids(vocab_ids)
        return drafter

    def attach(self, target: Transformer) -> None:
        """Share the target's embedding and LM head (no copies)."""
        self.cfg.check_target(target.cfg)
        self.target_cfg = target.cfg
        self.embed = target.embed
        self.full_head = target.lm_head_weight.float()
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

    @staticmethod
    def _after_load(module: TargetBoundDrafter, incompatible_keys: Any) -> None:
        module._trim_head()

    def _trim_head(self) -> None:
        if self.full_head is not None:
            self.head = self.full_head[self.vocab_ids].contiguous() if self.cfg.vocab_ids else self.full_head

    def _require_target(self) -> None:
        if self.embed is None:
            raise UserError(f"the {self.label} drafter has no target attached: build it with from_target or load()")

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint holds: the trainable weights and the `vocab_ids` buffer."""
        return dict(self.state_dict())

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """Drafter vocabulary index -> target token id (None: the full vocabulary, identity)."""
        return self.vocab_ids if self.cfg.vocab_ids else None

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """LM-head logits over the drafter's vocabulary for states [..., D]."""
        self._require_target()
        return F.linear(final, self.head)


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
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"kind": kind})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_checkpoint_config(folder: str | Path, kind: str, cfg_cls: type, label: str) -> Any:
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
    if raw.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise UserError(f"{path} has format version {raw['format_version']}; this moaspec reads {FORMAT_VERSION}")
    names = {f.name for f in fields(cfg_cls)}
    try:
        return cfg_cls(**{k: v for k, v in raw.items() if k in names})
    except TypeError as e:
        raise UserError(f"{path} is incomplete: {e}") from None


def load_checkpoint(folder: str | Path, kind: str, cls: type[TargetBoundDrafter], target: Transformer,
                    target_name: str, fingerprint: str) -> Any:
    """Load a drafter saved by `save_checkpoint` and attach it to `target`. UserError for a checkpoint
    of another target (name, weights fingerprint or dimensions) and for missing or corrupt files."""
    folder = Path(folder)
    label = cls.label
    cfg = read_checkpoint_config(folder, kind, cls.config_cls, label)
    if cfg.target_fingerprint != fingerprint or cfg.target_name != target_name:
        raise UserError(
            f"the {label} drafter in {folder} was trained for target {cfg.target_name!r} (weights fingerprint "
            f"{cfg.target_fingerprint}), not for {target_name!r} (fingerprint {fingerprint}); "
            "use a drafter trained for this target"
        )
    cfg.check_target(target.cfg)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise UserError(f"the {label} drafter checkpoint {folder} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(path), device=str(target.device))
    except Exception as e:  # safetensors raises SafetensorError, OSError, ValueError... on bad files
        raise UserError(f"cannot read {path} (corrupt or truncated? retrain or copy it again): {e}") from None
    drafter = cls.from_target(target, cfg)
    try:
        drafter.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise UserError(f"{path} does not match its {CONFIG_FILE}: {e}") from None
    if not all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()):
        raise UserError(f"{path} holds non-finite weights")
    if cfg.vocab_ids and (drafter.vocab_ids.min() < 0 or drafter.vocab_ids.max() >= cfg.vocab_size):
        raise UserError(f"{path} holds vocabulary ids outside the target's vocabulary")
    return drafter.eval()


# ============================================================================= EAGLE-2
@dataclass
class EagleConfig:
    # the target this drafter belongs to
    target_name: str
    target_fingerprint: str
    hidden_size: int  # target hidden D (= the drafter's hidden and feature size)
    num_layers: int  # target L: the features are the target's final normed states (hidden index L)
    vocab_size: int  # target vocabulary
    # the drafter's one decoder layer (EAGLE: the target's own layer shape)
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab_ids: int = 0  # size K of the trimmed LM head; 0 = the full vocabulary
    input_norm: bool = False  # EAGLE drops the input RMSNorm of its (first) decoder layer
    fc_bias: bool = True  # EAGLE's fc has a bias
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise UserError(f"EAGLE: {self.heads} heads are not a multiple of {self.kv_heads} KV heads")
        if not 0 <= self.vocab_ids <= self.vocab_size:
            raise UserError(f"vocab_ids must be in 0..{self.vocab_size}, got {self.vocab_ids}")

    @property
    def head_size(self) -> int:
        """Rows of the drafter's LM head (K, or the full vocabulary)."""
        return self.vocab_ids or self.vocab_size

    @classmethod
    def for_target(
        cls,
        model_cfg: ModelConfig,
        vocab_ids: int = 0,
        target_name: str = "",
        target_fingerprint: str = "",
        **overrides: Any,
    ) -> EagleConfig:
        """One decoder layer shaped like the target's (heads, KV heads, head_dim, MLP = intermediate
        size). For Llama-3-8B: fc 33.6M + layer 218M = 252M trainable, MoA's 264M (PAPER.md 3)."""
        c = model_cfg
        sizes: dict[str, Any] = dict(heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                     mlp=c.intermediate_size)
        sizes.update(overrides)
        return cls(target_name=target_name, target_fingerprint=target_fingerprint, hidden_size=c.hidden_size,
                   num_layers=c.num_layers, vocab_size=c.vocab_size, vocab_ids=vocab_ids,
                   rope_theta=c.rope_theta, rms_eps=c.rms_eps, **sizes)

    def check_target(self, model_cfg: ModelConfig) -> None:
        """UserError unless `model_cfg` has the dimensions this drafter was built for."""
        check_dims("EAGLE", self.target_name, dict(hidden_size=self.hidden_size, num_layers=self.num_layers,
                                                   vocab_size=self.vocab_size), model_cfg)


class FeatureEncoder:
    """Target side of EAGLE (`decoding.target.ContextEncoder`): the target's final normed hidden state of
    each newly committed slot, [n, D]. No weights."""

    def __init__(self, num_layers: int):
        self.hidden_layers: tuple[int, ...] = (num_layers,)

    def encode(self, target: Transformer, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        f = hidden[self.hidden_layers[0]]
        if f.shape[0] != slots.shape[0]:
            raise RuntimeError(f"EAGLE features: {f.shape[0]} hidden rows for {slots.shape[0]} committed slots")
        return f.clone()


class EagleDrafter(TargetBoundDrafter):
    """The drafting side of EAGLE-2; implements `drafters.base.Drafter`.

    Parameters (trainable): `fc` (2D -> D, bias), `layer` (one DecoderLayer); buffer `vocab_ids`.
    The target's embedding and LM head are shared by `attach`/`from_target`.
    """

    name = "eagle"
    label = "EAGLE"
    config_cls = EagleConfig

    def __init__(self, cfg: EagleConfig, max_seq_len: int = 4096):
        super().__init__(cfg, max_seq_len)
        D = cfg.hidden_size
        self.fc = nn.Linear(2 * D, D, bias=cfg.fc_bias)
        self.layer = DecoderLayer(D, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.rms_eps)
        if not cfg.input_norm:
            self.layer.input_norm = nn.Identity()
        cos, sin = rope(cfg.rope_theta, cfg.head_dim, max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init_weights)
        self.encoder = FeatureEncoder(cfg.num_layers)
        self.reset()

    # ------------------------------------------------------------------ shared math
    def _rows(self, feats: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
              cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        """Rows (feature f_j [B, n, D], token ids [B, n] of x_{j+1}) at `positions` -> predicted f_{j+1}."""
        x = self.fc(torch.cat([self.embed[ids], feats], -1))
        return self.layer(x, self.cos[positions], self.sin[positions], mask, cache, start)

    # ------------------------------------------------------------------ training
    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor,
                      noise_std: float = DEFAULT_NOISE) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal pass over whole sequences (teacher forcing on the target's features).

        tokens [B, T]: target token ids x_0..x_{T-1}; features [B, T, D]: the target's final normed hidden
        states f_0..f_{T-1} of the same slots (f_i is what the target's LM head reads to predict x_{i+1}).
        Row i (position i) consumes (f_i + U(-a, a) noise, x_{i+1}) and returns pred[:, i], which regresses
        f_{i+1}, and logits[:, i] = head(pred[:, i]) over the drafter's vocabulary (`vocab_ids`), which
        predict x_{i+2}: the loss targets of row i are the target's state and next-token distribution
        at row i + 1. The last row has no x_T (token 0 is fed): keep it, and every row whose x_{i+2} is not
        a training token, out of the loss. `noise_std` = a, the half-width of EAGLE's uniform noise on
        the input features; it is added only in training mode (`.train()`), so validation runs without.
        Returns (pred [B, T, D], logits [B, T, K]).
        """
        self._require_target()
        B, T = tokens.shape
        nxt = torch.cat([tokens[:, 1:], tokens.new_zeros(B, 1)], 1)
        if self.training and noise_std > 0:
            features = features + (torch.rand_like(features) * 2 - 1) * noise_std
        positions = torch.arange(T, device=tokens.device)
        pred = self._rows(features, nxt, positions, causal_mask(T, tokens.device))
        return pred, self.logits(pred)

    # ------------------------------------------------------------------ inference (Drafter protocol)
    def reset(self) -> None:
        self.tokens: list[int] = []  # committed tokens, all in the target's cache
        self.n_features = 0  # committed slots whose target feature is stored
        self.rows = 0  # rows (f_j, x_{j+1}) whose K/V are in the cache; row P-1 holds the last root

    def _allocate(self) -> None:
        S = self.max_seq_len
        p = next(self.parameters())
        if getattr(self, "cache", None) is not None and self.cache.size == S:
            return
        c = self.cfg
        self.cache = KVCache(c.kv_heads, S, c.head_dim, p.device, p.dtype)
        self.features = torch.zeros(S, c.hidden_size, device=p.device, dtype=p.dtype)

    def _add_features(self, context: Any) -> None:
        if not isinstance(context, torch.Tensor) or context.dim() != 2 or context.shape[1] != self.cfg.hidden_size:
            raise UserError("the EAGLE drafter needs target features: pass drafter.encoder to the target")
        start, n = self.n_features, context.shape[0]
        if start + n > self.max_seq_len:
            raise UserError(f"EAGLE drafter context full ({start} + {n} > {self.max_seq_len} tokens)")
        self.features[start:start + n] = context.to(self.features)
        self.n_features += n

    @torch.no_grad()
    def begin(self, prompt: list[int], context: Any) -> None:
        self._require_target()
        self._allocate()
        self.reset()
        self.tokens = list(prompt)
        self._add_features(context)

    @torch.no_grad()
    def observe(self, tokens: list[int], context: Any) -> None:
        self.tokens.extend(tokens)
        self._add_features(context)

    def _logprobs(self, pred: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits(pred), -1)

    @torch.no_grad()
    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        P = len(self.tokens)  # the root's position; the target has committed slots 0..P-1
        if self.n_features != P:
            raise RuntimeError(f"EAGLE drafter out of step: {P} committed tokens but {self.n_features} features")
        if P + cfg.depth * cfg.topk > self.max_seq_len:
            return Tree.chain(root)
        dev = self.cos.device
        # Pending rows j = rows..P-1: (f_j, x_{j+1}), the last one (f_{P-1}, root) at slot P-1. They stay
        # cached: the root is committed by the verification that follows.
        start = self.rows
        n = P - start
        ids = torch.tensor([*self.tokens[start + 1:P], root], device=dev)
        pos = torch.arange(start, P, device=dev)
        out = self._rows(self.features[start:P][None], ids[None], pos, pending_mask(start, n, dev), self.cache, start)
        self.rows = P
        pred_of = {0: out[0, -1]}  # tree node -> its row's predicted feature (input of its children's rows)
        slot_of = {0: P - 1}
        next_slot = P  # drafted rows get tentative slots P, P+1, ... (overwritten next round)

        def expand(tree: Tree, frontier: list[int]) -> torch.Tensor:
            nonlocal next_slot
            first = next_slot
            for r, node in enumerate(frontier):
                slot_of[node] = first + r
            mask = tree_rows_mask(tree, frontier, slot_of, P, first, dev)
            feats = torch.stack([pred_of[tree.parents[node]] for node in frontier])
            ids = torch.tensor([tree.tokens[node] for node in frontier], device=dev)
            positions = torch.tensor([P - 1 + tree.depths[node] for node in frontier], device=dev)
            out = self._rows(feats[None], ids[None], positions, mask, self.cache, first)[0]
            next_slot = first + len(frontier)
            for r, node in enumerate(frontier):
                pred_of[node] = out[r]
            return self._logprobs(out)

        return grow_tree(root, self._logprobs(out[0, -1]), expand, cfg, vocab=self.draft_vocab)


# ----------------------------------------------------------------------------- checkpoints
def save(drafter: EagleDrafter, folder: str | Path, fp16: bool = False) -> Path:
    """config.json (kind "eagle", sizes, target name + fingerprint) + model.safetensors (fc, layer, vocab ids)."""
    return save_checkpoint(drafter, folder, KIND, fp16)


def read_config(folder: str | Path) -> EagleConfig:
    return read_checkpoint_config(folder, KIND, EagleConfig, EagleDrafter.label)


def load(folder: str | Path, target: Transformer, target_name: str, fingerprint: str) -> EagleDrafter:
    """Load a drafter saved by `save` and attach it to `target` (UserError: other target, bad files)."""
    return load_checkpoint(folder, KIND, EagleDrafter, target, target_name, fingerprint)


def param_count(cfg: EagleConfig) -> int:
    """Trainable parameters of a drafter with these sizes (built on the meta device: no memory)."""
    with torch.device("meta"):
        return EagleDrafter(cfg, max_seq_len=1).num_trainable_parameters()


__all__ = [
    "DEFAULT_NOISE",
    "EagleConfig",
    "EagleDrafter",
    "FeatureEncoder",
    "TargetBoundDrafter",
    "load",
    "load_checkpoint",
    "param_count",
    "read_checkpoint_config",
    "read_config",
    "save",
    "save_checkpoint",
]
