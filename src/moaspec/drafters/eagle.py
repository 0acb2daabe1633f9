"""EAGLE-2 drafter: the feature-level autoregressive baseline MoA is compared with (arXiv 2410.03804, sections 2, 5, 7).

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
cache slot: EAGLE feeds its own predicted features back while drafting (off-policy, arXiv 2410.03804, section 2).
Only trainable weights (fc, the layer) and `vocab_ids` are in the state dict.

What it shares with the other trained drafters (target binding, trimmed head, checkpoints, drafting
masks) is in `drafters/trained.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from moaspec.decoding.context import register
from moaspec.decoding.scheduler import pause
from moaspec.decoding.tree import Tree, TreeConfig, grow_tree
from moaspec.drafters.layers import DecoderLayer, DraftLinear, KVCache, rope
from moaspec.drafters.trained import (
    TargetBoundConfig,
    TargetBoundDrafter,
    causal_mask,
    check_heads,
    pending_mask,
    place_frontier,
    read_checkpoint,
)
from moaspec.errors import UserError
from moaspec.models.runtime import KVCache as TargetCache
from moaspec.models.runtime import ModelConfig, Transformer, signed_sin

KIND = "eagle"
DEFAULT_NOISE = 0.1  # EAGLE's training noise on the input features: U(-0.1, 0.1)
PROMPT_CHUNK = 64  # rows of a prompt per layer call when drafting starts (`pause` between them)


# ============================================================================= EAGLE-2
@dataclass
class EagleConfig(TargetBoundConfig):
    label = "EAGLE"
    target_dims = ("hidden_size", "num_layers", "vocab_size")
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
        check_heads("EAGLE", self.heads, self.kv_heads)
        self._check_vocab_ids()

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
        size). For Llama-3-8B: fc 33.6M + layer 218M = 252M trainable, MoA's 264M (the paper, section 3)."""
        c = model_cfg
        sizes: dict[str, Any] = dict(heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                     mlp=c.intermediate_size)
        sizes.update(overrides)
        return cls(target_name=target_name, target_fingerprint=target_fingerprint, hidden_size=c.hidden_size,
                   num_layers=c.num_layers, vocab_size=c.vocab_size, vocab_ids=vocab_ids,
                   rope_theta=c.rope_theta, rms_eps=c.rms_eps, **sizes)


@register
@dataclass
class Features:
    """What the EAGLE drafter receives per newly verified token: the target's final normed state."""

    kind: ClassVar[str] = "eagle"
    states: torch.Tensor  # [n, D]

    def __len__(self) -> int:
        return self.states.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"states": self.states}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Features:
        if set(t) != {"states"} or t["states"].dim() != 2:
            raise UserError(f"malformed EAGLE features: tensors {sorted(t)}")
        return cls(t["states"])


class FeatureEncoder:
    """Target side of EAGLE (`decoding.target.ContextEncoder`): the target's final normed hidden state of
    each newly committed slot. No weights."""

    def __init__(self, num_layers: int):
        self.hidden_layers: tuple[int, ...] = (num_layers,)

    def encode(self, cache: TargetCache, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> Features:
        f = hidden[self.hidden_layers[0]]
        if f.shape[0] != slots.shape[0]:
            raise RuntimeError(f"EAGLE features: {f.shape[0]} hidden rows for {slots.shape[0]} committed slots")
        return Features(f.clone())


class EagleDrafter(TargetBoundDrafter):
    """The drafting side of EAGLE-2; implements `decoding.drafter.Drafter`.

    Parameters (trainable): `fc` (2D -> D, bias), `layer` (one DecoderLayer); buffer `vocab_ids`.
    The target's embedding and LM head are shared by `attach`/`from_target`.
    """

    name = "eagle"
    config_cls = EagleConfig

    def __init__(self, cfg: EagleConfig, max_seq_len: int = 4096):
        super().__init__(cfg, max_seq_len)
        D = cfg.hidden_size
        self.fc = DraftLinear(2 * D, D, bias=cfg.fc_bias)
        self.layer = DecoderLayer(D, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.rms_eps)
        if not cfg.input_norm:
            self.layer.input_norm = nn.Identity()
        cos, sin = rope(cfg.rope_theta, cfg.head_dim, max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("sin_signed", signed_sin(sin), persistent=False)  # the inference path's table
        self.apply(self._init_weights)
        self.encoder = FeatureEncoder(cfg.num_layers)
        self.reset()

    # ------------------------------------------------------------------ shared math
    def _rows(self, feats: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
              cache: KVCache | None = None, start: int = 0, drafting: bool = False) -> torch.Tensor:
        """Rows (feature f_j [B, n, D], token ids [B, n] of x_{j+1}) at `positions` -> predicted f_{j+1};
        `drafting`: the layer's inference path (`DecoderLayer.infer`, no autograd)."""
        x = self.fc(torch.cat([self.embed[ids], feats], -1))
        if drafting:
            return self.layer.infer(x, self.cos[positions], self.sin_signed[positions], mask, cache, start)
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

    def _add_context(self, context: Any) -> None:
        """Store the target's features of the newly committed slots."""
        if not isinstance(context, Features) or context.states.shape[1] != self.cfg.hidden_size:
            raise UserError("the EAGLE drafter needs target features: pass drafter.encoder to the target")
        context = context.states
        start, n = self.n_features, context.shape[0]
        if start + n > self.max_seq_len:
            raise UserError(f"EAGLE drafter context full ({start} + {n} > {self.max_seq_len} tokens)")
        self.features[start:start + n] = context.to(self.features)
        self.n_features += n

    @torch.no_grad()
    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        P = len(self.tokens)  # the root's position; the target has committed slots 0..P-1
        if self.n_features > P:
            raise RuntimeError(f"EAGLE drafter out of step: {P} committed tokens but {self.n_features} features")
        if P + cfg.depth * cfg.topk > self.max_seq_len:
            return Tree.chain(root)
        dev = self.cos.device
        # Pending rows j = rows..P-1: (f_j, x_{j+1}), the last one (f_{P-1}, root) at slot P-1. They stay
        # cached: the root is committed by the verification that follows. While the target is away the
        # newest slots have no target feature: EAGLE's own prediction stands in for each, as inside a
        # tree, which takes one row at a time.
        start, ext = min(self.rows, P - 1), [*self.tokens, root]  # P - 1: the same root again
        while True:
            if self.n_features <= start:
                self.features[start] = self._pred
                self.n_features = start + 1
            end = min(P, self.n_features, start + PROMPT_CHUNK)
            ids = torch.tensor(ext[start + 1:end + 1], device=dev)
            pos = torch.arange(start, end, device=dev)
            out = self._rows(self.features[start:end][None], ids[None], pos, pending_mask(start, end - start, dev),
                             self.cache, start, drafting=True)
            self._pred, start = out[0, -1], end
            if end == P:
                break
            pause()  # a prompt's rows, a chunk at a time: a server's other sessions have their passes between
        self.rows = P
        pred_of = {0: out[0, -1]}  # tree node -> its row's predicted feature (input of its children's rows)
        slot_of = {0: P - 1}  # drafted rows get tentative slots P, P+1, ... (overwritten next round)

        def expand(tree: Tree, frontier: list[int]) -> torch.Tensor:
            first, mask = place_frontier(tree, frontier, slot_of, P, dev)
            feats = torch.stack([pred_of[tree.parents[node]] for node in frontier])
            ids = torch.tensor([tree.tokens[node] for node in frontier], device=dev)
            positions = torch.tensor([P - 1 + tree.depths[node] for node in frontier], device=dev)
            out = self._rows(feats[None], ids[None], positions, mask, self.cache, first, drafting=True)[0]
            for r, node in enumerate(frontier):
                pred_of[node] = out[r]
            return self._logprobs(out)

        return grow_tree(root, self._logprobs(out[0, -1]), expand, cfg, vocab=self.draft_vocab)


# ----------------------------------------------------------------------------- checkpoints
DRAFTER = EagleDrafter  # what `DrafterSpec` saves and loads (drafters/__init__.py)


def load_encoder(folder: str | Path, target: Transformer, target_name: str, fingerprint: str) -> FeatureEncoder:
    """The target-side half of an EAGLE checkpoint (no weights: which hidden state it reads), for a server."""
    cfg, _ = read_checkpoint(folder, KIND, EagleConfig, target.cfg, target_name, fingerprint)
    return FeatureEncoder(cfg.num_layers)


def param_count(cfg: EagleConfig) -> int:
    """Trainable parameters of a drafter with these sizes (no memory used)."""
    return EagleDrafter.param_count(cfg)


__all__ = [
    "DEFAULT_NOISE",
    "EagleConfig",
    "EagleDrafter",
    "FeatureEncoder",
    "param_count",
]
