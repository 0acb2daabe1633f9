"""What a drafter uses of its target, without the target.

A drafter on a user's device (client-server mode) shares the target's frozen embedding, LM head and
final norm, and for MoA with Target Layer Inference the target's last N layers, but must not hold the
whole model. `TargetParts` is that interface; a full `Transformer` satisfies it, and `PartialTarget`
loads just those tensors from the model folder (for Qwen2.5-Coder-0.5B with N = 0: the 136M tied
embedding of 494M parameters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from moaspec.errors import UserError
from moaspec.models.linear import WeightMode, runnable_mode
from moaspec.models.runtime import Layer, ModelConfig, fused_pieces, read_norm, resolve_weights
from moaspec.models.weights import open_weights


class TargetParts(Protocol):
    cfg: ModelConfig
    embed: torch.Tensor  # [V, D] fp32
    lm_head_weight: torch.Tensor  # [V, D] fp32 (the embedding when tied)
    norm: torch.Tensor  # final RMSNorm weight
    weights: WeightMode  # the weight mode the drafter's own kernels follow
    device: torch.device
    max_seq_len: int
    cos: torch.Tensor  # RoPE tables of the target, [max_seq_len, head_dim]
    sin: torch.Tensor

    def tail_layers(self, n: int) -> list[Layer]: ...


class PartialTarget:
    """The embedding, LM head, final norm and last `tail` layers of a model, read alone (tensor by tensor
    from its GGUF file or safetensors)."""

    def __init__(self, folder: str | Path, tail: int = 0, weights: WeightMode = "fp32",
                 device: str | torch.device = "cpu", max_seq_len: int = 4096):
        self.folder = Path(folder)
        self.cfg = cfg = ModelConfig.from_folder(self.folder)
        self.device = torch.device(device)
        self.weights = runnable_mode(resolve_weights(weights, self.folder, self.device), self.device)
        self.source = open_weights(self.folder, cfg.num_heads, cfg.num_kv_heads, self.device, fused_pieces(cfg))
        embed = "model.embed_tokens.weight"
        self.embed = self.source.tensor(embed).float()
        head = "lm_head.weight"
        tied = cfg.tie_embeddings or not self.source.has(head)
        self.lm_head_weight = self.embed if tied else self.source.tensor(head).float()
        self.norm = read_norm(self.source, "model.norm.weight", cfg)
        for name in (embed, head, "model.norm.weight"):
            self.source.release(name)
        self._tail: list[Layer] = []
        self.tail_layers(tail)
        self.max_seq_len = min(max_seq_len, cfg.max_position)
        self.cos, self.sin = cfg.rope_tables(self.max_seq_len, self.device)

    @property
    def tail(self) -> int:
        """How many of the last layers are loaded."""
        return len(self._tail)

    def tail_layers(self, n: int) -> list[Layer]:
        """The last n layers, read the first time they are asked for."""
        L = self.cfg.num_layers
        if not 0 <= n <= L:
            raise UserError(f"the target has {L} layers; cannot take the last {n}")
        if n > self.tail:
            more = range(L - n, L - self.tail)
            self._tail = [Layer(self.source, f"model.layers.{i}", self.weights, self.cfg) for i in more] + self._tail
        return self._tail[self.tail - n:]

    def num_parameters(self) -> int:
        own = self.embed.numel() + self.norm.numel()
        if self.lm_head_weight is not self.embed:
            own += self.lm_head_weight.numel()
        return own + sum(lin.in_features * lin.out_features for layer in self._tail for lin in layer.linears())
