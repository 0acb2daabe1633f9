"""Independent small drafter: the classic small-LM baseline of arXiv 2410.03804, section 7, trained on the same
data and budget as MoA but reading no target state (its `encoder` is None).

A few causal decoder layers of the target's width over the target's frozen token embeddings, its own
final RMSNorm, and the target's frozen (optionally trimmed) LM head. Row i is token x_i at position i;
its output predicts x_{i+1} (the same alignment as MoA's SA stream, and as the target's own rows).
At inference it keeps its own KV cache of the committed tokens, like `drafters/draft_model.py`: one pass
over the tokens committed since the last round plus the root, then EAGLE-2 tree expansion with tree masks
over tentative cache slots. Only its trainable weights and `vocab_ids` are in the state dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moaspec.decoding.tree import Tree, TreeConfig, grow_tree
from moaspec.drafters.layers import DecoderLayer, KVCache, RMSNorm, rope
from moaspec.drafters.trained import (
    TargetBoundConfig,
    TargetBoundDrafter,
    causal_mask,
    check_heads,
    pending_mask,
    place_frontier,
)
from moaspec.errors import UserError
from moaspec.models.runtime import ModelConfig, signed_sin

KIND = "independent"


@dataclass
class IndependentConfig(TargetBoundConfig):
    label = "independent"
    target_dims = ("hidden_size", "vocab_size")
    # the target this drafter belongs to (it shares the target's embedding and LM head)
    target_name: str
    target_fingerprint: str
    hidden_size: int  # target hidden D (= the drafter's hidden)
    vocab_size: int  # target vocabulary
    # the drafter's own decoder layers
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    num_layers: int = 2
    vocab_ids: int = 0  # size K of the trimmed LM head; 0 = the full vocabulary
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_heads("independent drafter", self.heads, self.kv_heads)
        if self.num_layers < 1:
            raise UserError(f"independent drafter: num_layers must be >= 1, got {self.num_layers}")
        self._check_vocab_ids()

    @classmethod
    def for_target(
        cls,
        model_cfg: ModelConfig,
        num_layers: int = 2,
        vocab_ids: int = 0,
        target_name: str = "",
        target_fingerprint: str = "",
        **overrides: Any,
    ) -> IndependentConfig:
        """`num_layers` layers of the target's width, heads, KV heads and head_dim, MLP ~1.5x hidden (a
        multiple of 64, like MoA's SA/CA layers)."""
        c = model_cfg
        sizes: dict[str, Any] = dict(heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                     mlp=max(64, round(1.5 * c.hidden_size / 64) * 64))
        sizes.update(overrides)
        return cls(target_name=target_name, target_fingerprint=target_fingerprint, hidden_size=c.hidden_size,
                   vocab_size=c.vocab_size, num_layers=num_layers, vocab_ids=vocab_ids, rope_theta=c.rope_theta,
                   rms_eps=c.rms_eps, **sizes)


class IndependentDrafter(TargetBoundDrafter):
    """A small LM on the target's frozen embedding and LM head; implements `decoding.drafter.Drafter`.

    Parameters (trainable): `layers` (num_layers DecoderLayers), `norm` (final RMSNorm); buffer `vocab_ids`.
    """

    name = "independent"
    config_cls = IndependentConfig
    encoder = None  # reads no target state

    def __init__(self, cfg: IndependentConfig, max_seq_len: int = 4096):
        super().__init__(cfg, max_seq_len)
        D = cfg.hidden_size
        self.layers = nn.ModuleList(
            DecoderLayer(D, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.rms_eps) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, cfg.rms_eps)
        cos, sin = rope(cfg.rope_theta, cfg.head_dim, max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("sin_signed", signed_sin(sin), persistent=False)  # the inference path's table
        self.apply(self._init_weights)
        self.reset()

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                start: int | None = None) -> torch.Tensor:
        """Token ids [B, n] at `positions` -> final normed states [B, n, D]. With `start` (B = 1: drafting,
        through the layers' inference path) each layer writes the rows' K/V into its cache at slots
        [start, start + n)."""
        x = self.embed[ids]
        if start is not None:
            cos, sin = self.cos[positions], self.sin_signed[positions]
            for layer, cache in zip(self.layers, self.caches, strict=True):
                x = layer.infer(x, cos, sin, mask, cache, start)
            return self.norm(x)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    # ------------------------------------------------------------------ training
    def forward_train(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] (row i = x_i at position i) -> (hidden [B, T, D], logits [B, T, K]). Row i predicts
        x_{i+1}: its targets are the target's distribution at row i (and, for a hidden-state loss, the
        target's final normed state of row i, which `hidden` (after the drafter's own final norm) mirrors)."""
        self._require_target()
        T = tokens.shape[1]
        hidden = self._hidden(tokens, torch.arange(T, device=tokens.device), causal_mask(T, tokens.device))
        return hidden, self.logits(hidden)

    # ------------------------------------------------------------------ inference (Drafter protocol)
    def reset(self) -> None:
        self.tokens: list[int] = []  # committed tokens (prompt + accepted)
        self.cached = 0  # tokens whose K/V are in the caches (the last root included)

    def _allocate(self) -> None:
        S = self.max_seq_len
        p = next(self.parameters())
        if getattr(self, "caches", None) is not None and self.caches[0].size == S:
            return
        c = self.cfg
        self.caches = [KVCache(c.kv_heads, S, c.head_dim, p.device, p.dtype) for _ in self.layers]

    @torch.no_grad()
    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        P = len(self.tokens)  # the root's position
        if P + 1 + cfg.depth * cfg.topk > self.max_seq_len:
            return Tree.chain(root)
        dev = self.cos.device
        # The tokens committed since the last round + the root, in one causal pass; the root stays cached
        # at slot P (verification commits it).
        start = self.cached
        pending = [*self.tokens[start:], root]
        pos = torch.arange(start, P + 1, device=dev)
        h = self._hidden(torch.tensor([pending], device=dev), pos, pending_mask(start, len(pending), dev), start)
        self.cached = P + 1
        slot_of = {0: P}  # drafted nodes get tentative slots P+1, ... (overwritten next round)

        def expand(tree: Tree, frontier: list[int]) -> torch.Tensor:
            first, mask = place_frontier(tree, frontier, slot_of, P + 1, dev)
            ids = torch.tensor([[tree.tokens[node] for node in frontier]], device=dev)
            positions = torch.tensor([P + tree.depths[node] for node in frontier], device=dev)
            out = self._hidden(ids, positions, mask, first)[0]
            return self._logprobs(out)

        return grow_tree(root, self._logprobs(h[0, -1]), expand, cfg, vocab=self.draft_vocab)


# ----------------------------------------------------------------------------- checkpoints
DRAFTER = IndependentDrafter  # what `DrafterSpec` saves and loads (drafters/__init__.py)


def param_count(cfg: IndependentConfig) -> int:
    """Trainable parameters of a drafter with these sizes (no memory used)."""
    return IndependentDrafter.param_count(cfg)


__all__ = ["IndependentConfig", "IndependentDrafter", "param_count"]
