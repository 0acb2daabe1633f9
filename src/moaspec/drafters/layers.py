"""Building blocks shared by the trained drafters (MoA, EAGLE-2, independent): pre-norm decoder
layers with GQA + RoPE and a batch-1 KV cache for drafting, cross-attention, and the target's own
frozen layers run on drafted positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moaspec.models.linear import Linear
from moaspec.models.runtime import Layer, ModelConfig, apply_rope, rms_norm, rope_tables


def rope(theta: float, head_dim: int, length: int, device: torch.device | str | None = None):
    return rope_tables(theta, head_dim, length, torch.device(device or "cpu"))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def drafting_rows(x: torch.Tensor) -> bool:
    """True outside autograd for at most 16 rows: the case the decoding kernels are tuned for."""
    return not torch.is_grad_enabled() and x.numel() // x.shape[-1] <= 16


def apply_rows(fast: Linear, x: torch.Tensor) -> torch.Tensor:
    """`fast` over the rows of x [..., in] -> [..., out]."""
    return fast(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], fast.out_features)


class DraftLinear(nn.Linear):
    """nn.Linear that, outside autograd (drafting, validation), runs through the decoding-tuned
    `models.linear.Linear` kernels in the target's weight mode: drafting multiplies 1-16 rows, where
    plain F.linear is a slow gemv. The kernel view is rebuilt whenever the weights change."""

    mode = "fp32"  # set to the target's weight mode by TargetBoundDrafter.attach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not drafting_rows(x):
            return super().forward(x)
        key = (self.weight._version, self.weight.data_ptr(), self.mode)
        if getattr(self, "_fast_key", None) != key:
            bias = None if self.bias is None else self.bias.detach()
            self._fast = Linear(self.weight.detach(), bias, self.mode)
            self._fast_key = key
        return apply_rows(self._fast, x)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = DraftLinear(dim, hidden, bias=False)
        self.up = DraftLinear(dim, hidden, bias=False)
        self.down = DraftLinear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class KVCache:
    """A static batch-1 K/V buffer [1, heads, size, head_dim]; callers track which slots are live."""

    def __init__(self, heads: int, size: int, head_dim: int, device: torch.device, dtype: torch.dtype):
        self.k = torch.zeros(1, heads, size, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [1, heads, n, d] at slots [start, start + n); return the slots [0, start + n)."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, n, hd], k/v [B, Hkv, m, hd]; mask bool [n, m] or [B, n, m], True = may attend."""
    if mask is not None and mask.dim() == 3:
        mask = mask[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    b, n, _ = x.shape
    return x.view(b, n, heads, head_dim).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class _AttentionBlock(nn.Module):
    """Weights and residual tail shared by `DecoderLayer` and `CrossAttentionLayer`: input RMSNorm, GQA
    projections, output projection, post-attention RMSNorm and a SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, mlp: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_norm = RMSNorm(dim, eps)
        self.q = DraftLinear(dim, heads * head_dim, bias=False)
        self.k = DraftLinear(dim, kv_heads * head_dim, bias=False)
        self.v = DraftLinear(dim, kv_heads * head_dim, bias=False)
        self.o = DraftLinear(heads * head_dim, dim, bias=False)
        self.post_norm = RMSNorm(dim, eps)
        self.mlp = SwiGLU(dim, mlp)

    def _q(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Normed states h [B, n, dim] -> queries [B, heads, n, head_dim] with RoPE."""
        return apply_rope(_split_heads(self.q(h), self.heads, self.head_dim), cos, sin)

    def _kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed states h [B, n, dim] -> k (with RoPE), v [B, kv_heads, n, head_dim]."""
        k = apply_rope(_split_heads(self.k(h), self.kv_heads, self.head_dim), cos, sin)
        return k, _split_heads(self.v(h), self.kv_heads, self.head_dim)

    def _residual(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """x + attention output, then + the MLP of its post-norm."""
        x = x + self.o(_merge_heads(_attention(q, k, v, mask)))
        return x + self.mlp(self.post_norm(x))


class DecoderLayer(_AttentionBlock):
    """Pre-norm self-attention decoder layer with GQA, RoPE and a SwiGLU MLP (SA and LSA)."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """x [B, n, dim]; cos/sin [n, head_dim] at the rows' positions. With a cache (B = 1) the rows'
        K/V are written at slots [start, start + n) and attention covers slots [0, start + n)."""
        h = self.input_norm(x)
        q = self._q(h, cos, sin)
        k, v = self._kv(h, cos, sin)
        if cache is not None:
            k, v = cache.update(start, k, v)
        return self._residual(x, q, k, v, mask)


class CrossAttentionLayer(_AttentionBlock):
    """Queries from the SA stream, keys/values from the context vectors of verified tokens; the same
    input RMSNorm is applied to both streams; RoPE at absolute positions on queries and keys."""

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [B, m, dim] context vectors at positions given by cos/sin -> k, v [B, kv_heads, m, head_dim]."""
        return self._kv(self.input_norm(c), cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._residual(x, self._q(self.input_norm(x), cos, sin), k, v, mask)


def _frozen_linear(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """A target Linear on x [..., in]. F.linear on the fp32 (or accelerator) weight keeps autograd working
    for training through the frozen layers; fbgemm fp16-packed weights (CPU "fp16" mode) have no autograd."""
    if lin.weight is not None:
        return F.linear(x.to(lin.weight.dtype), lin.weight, lin.bias).float()
    return lin(x.reshape(-1, lin.in_features)).view(*x.shape[:-1], lin.out_features)


class FrozenTargetLayer:
    """One of the target's real last layers run on drafter positions (TLI). Shares the target's weights
    (never trained, not in the drafter's state dict); its keys/values are the target's cached K/V of the
    verified tokens followed by the drafted positions' own K/V. Same math as `Transformer.layer_forward`."""

    def __init__(self, layer: Layer, cfg: ModelConfig):
        self.layer, self.cfg = layer, cfg

    @property
    def trainable(self) -> bool:  # gradients can flow through it to the CA output
        return all(lin.weight is not None for lin in (self.layer.q, self.layer.k, self.layer.v, self.layer.o,
                                                      self.layer.gate, self.layer.up, self.layer.down))

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [B, n, D]. Keys/values: with `cache` (B = 1) the rows' K/V are written at [start, start + n)
        and slots [0, start + n) are attended; with `prefix` (K, V [B, Hkv, m, d], the target's) the
        attended keys are prefix then the rows' own."""
        c, lay = self.cfg, self.layer
        h = rms_norm(x, lay.ln1, c.rms_eps)
        q = apply_rope(_split_heads(_frozen_linear(lay.q, h), c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(_split_heads(_frozen_linear(lay.k, h), c.num_kv_heads, c.head_dim), cos, sin)
        v = _split_heads(_frozen_linear(lay.v, h), c.num_kv_heads, c.head_dim)
        if cache is not None:
            k, v = cache.update(start, k, v)
        elif prefix is not None:
            k, v = torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2)
        x = x + _frozen_linear(lay.o, _merge_heads(_attention(q, k, v, mask)))
        h = rms_norm(x, lay.ln2, c.rms_eps)
        return x + _frozen_linear(lay.down, F.silu(_frozen_linear(lay.gate, h)) * _frozen_linear(lay.up, h))
