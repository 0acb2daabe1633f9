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
from safetensors import safe_open

from moaspec.errors import UserError
from moaspec.models.linear import WeightMode, runnable_mode
from moaspec.models.runtime import Layer, ModelConfig, resolve_weights, rope_tables


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
    """The embedding, LM head, final norm and last `tail` layers of a model folder, read alone."""

    def __init__(self, folder: str | Path, tail: int = 0, weights: WeightMode = "fp32",
                 device: str | torch.device = "cpu", max_seq_len: int = 4096):
        self.folder = Path(folder)
        self.cfg = cfg = ModelConfig.from_folder(self.folder)
        self.device = torch.device(device)
        self.weights = runnable_mode(resolve_weights(weights, self.folder, self.device), self.device)
        self.files = sorted(self.folder.glob("*.safetensors"))
        if not self.files:
            raise UserError(f"no *.safetensors in {self.folder}")
        w = self._read(("model.embed_tokens.", "model.norm.", "lm_head."))
        self.embed = w["model.embed_tokens.weight"].float()
        head = self.embed if cfg.tie_embeddings else w.get("lm_head.weight", self.embed).float()
        self.lm_head_weight = head
        self.norm = w["model.norm.weight"].float()
        self._tail: list[Layer] = []
        self.tail_layers(tail)
        self.max_seq_len = min(max_seq_len, cfg.max_position)
        self.cos, self.sin = rope_tables(cfg.rope_theta, cfg.head_dim, self.max_seq_len, self.device)

    def _read(self, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
        w: dict[str, torch.Tensor] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt", device=str(self.device)) as st:
                for key in st.keys():
                    if key.startswith(prefixes):
                        w[key] = st.get_tensor(key)
        return w

    @property
    def tail(self) -> int:
        """How many of the last layers are loaded."""
        return len(self._tail)

    def tail_layers(self, n: int) -> list[Layer]:
        """The last n layers, read from the folder the first time they are asked for."""
        L = self.cfg.num_layers
        if not 0 <= n <= L:
            raise UserError(f"the target has {L} layers; cannot take the last {n}")
        if n > self.tail:
            more = range(L - n, L - self.tail)
            w = self._read(tuple(f"model.layers.{i}." for i in more))
            self._tail = [Layer(w, f"model.layers.{i}", self.weights) for i in more] + self._tail
        return self._tail[self.tail - n:]

    def num_parameters(self) -> int:
        own = self.embed.numel() + self.norm.numel()
        if self.lm_head_weight is not self.embed:
            own += self.lm_head_weight.numel()
        return own + sum(lin.in_features * lin.out_features for layer in self._tail for lin in layer.linears())
