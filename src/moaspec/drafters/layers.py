"""Building blocks shared by the trained drafters (MoA, EAGLE-2, independent): pre-norm decoder
layers with GQA + RoPE and a batch-1 KV cache for drafting, cross-attention, and the target's own
frozen layers run on drafted positions.

Each attention block has two paths over the same weights. `forward` is the reference math (autograd,
training, validation). `infer` is the inference path for drafting and context encoding (every trained
drafter drafts through it): the block's projections fused into few `models.linear.Linear` kernels in the
target's weight mode (`BlockKernels`: q|k|v or k|v in one matrix, gate|up in one), RoPE with the
rotate-half sign folded into a precomputed sine table (`signed_sin`), attention that reads the K/V once
for a few query rows (`attend_rows`) and in-place elementwise tails; in "fp16" mode with the compiled
kernels, up to `FUSED_ROWS` rows, norm + projection + RoPE and the residual tail are one compiled call
each. It computes what `forward` computes up to the weight mode's rounding (tests/test_moa.py,
tests/test_draft_fast_path.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moaspec.models.linear import Linear
from moaspec.models.runtime import Layer, ModelConfig, apply_rope, rms_norm, rms_norm_rows, rope_rows, rope_tables


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


def _weights_key(params: list[torch.Tensor], mode: str) -> tuple:
    """Changes whenever one of `params` is written (optimiser step, load_state_dict, .to()) or the mode."""
    return (mode, *[(p._version, p.data_ptr()) for p in params])


class DraftLinear(nn.Linear):
    """nn.Linear that, outside autograd (drafting, validation), runs through the decoding-tuned
    `models.linear.Linear` kernels in the target's weight mode: drafting multiplies 1-16 rows, where
    plain F.linear is a slow gemv. The kernel view is rebuilt whenever the weights change."""

    mode = "fp32"  # set to the target's weight mode by TargetBoundDrafter.attach

    def kernel(self) -> Linear:
        """This layer as a `Linear` in `mode` (any row count; inference only), rebuilt when the weights change."""
        key = _weights_key([self.weight] if self.bias is None else [self.weight, self.bias], self.mode)
        if getattr(self, "_fast_key", None) != key:
            bias = None if self.bias is None else self.bias.detach()
            self._fast = Linear(self.weight.detach(), bias, self.mode)
            self._fast_key = key
        return self._fast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not drafting_rows(x):
            return super().forward(x)
        return apply_rows(self.kernel(), x)


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


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float | None = None) -> torch.Tensor:
    """q [B, H, n, hd], k/v [B, Hkv, m, hd]; mask bool [n, m] or [B, n, m], True = may attend; `scale` of q.k
    (None: 1/sqrt(hd))."""
    if mask is not None and mask.dim() == 3:
        mask = mask[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


GROUPED_ROWS = 8  # up to this many query rows, `attend_rows` runs each KV head's query heads as one group


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """GQA attention for rows: q [B, n, H, d] (rows, heads); k, v [B, Hkv, m, d]; mask bool [n, m]
    (True = may attend) or None -> [B, n, H * d], the heads of each row side by side (`_merge_heads`).

    A few query rows over many keys (drafting: 1-8 rows over the cached context) run as r * n rows of
    one attention group per KV head, r = H / Hkv, reading the K/V once (SDPA's enable_gqa repeats them:
    ~35% slower there); more rows (the LSA: L rows over L keys per token) run SDPA's GQA, faster there."""
    B, n, H, d = q.shape
    Hkv = k.shape[1]
    r = H // Hkv
    if n > GROUPED_ROWS:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(B, n, H * d)
    qg = q.view(B, n, Hkv, r, d).permute(0, 2, 3, 1, 4).reshape(B, Hkv, r * n, d)
    if mask is not None and r > 1:
        mask = mask.repeat(r, 1)  # group row j * n + i is query row i
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.view(B, Hkv, r, n, d).permute(0, 3, 1, 2, 4).reshape(B, n, H * d)


def _split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    b, n, _ = x.shape
    return x.view(b, n, heads, head_dim).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class BlockKernels:
    """The inference kernels of one attention block (`_AttentionBlock.kernels`): its projections as
    `Linear`s in the target's weight mode, fused where they share an input (q|k|v for self-attention,
    k|v of the context for cross-attention, gate|up), and its norm weights (an input norm other than
    `RMSNorm` counts as none). Fusing changes how many kernel calls (and weight streams) a drafting step makes,
    not the math (each output element is the same dot product, up to the kernel's summation order)."""

    def __init__(self, block: _AttentionBlock, mode: str):
        def w(lin: nn.Linear) -> torch.Tensor:
            return lin.weight.detach()

        def fused(*lins: nn.Linear) -> Linear:
            return Linear(torch.cat([w(lin) for lin in lins]) if len(lins) > 1 else w(lins[0]), None, mode)

        if isinstance(block, CrossAttentionLayer):
            self.q, self.kv = fused(block.q), fused(block.k, block.v)  # queries per step, k|v per context token
        else:
            self.qkv = fused(block.q, block.k, block.v)
        self.o = fused(block.o)
        self.gate_up = fused(block.mlp.gate, block.mlp.up)
        self.down = fused(block.mlp.down)
        self.mlp = block.mlp.gate.out_features
        # no input norm (EAGLE's first layer drops it): ln1 is None
        self.ln1 = block.input_norm.weight.detach() if isinstance(block.input_norm, RMSNorm) else None
        self.ln2, self.eps = block.post_norm.weight.detach(), block.post_norm.eps
        # fp16 on a CPU with the compiled kernels: norm + projection + RoPE in one call, and the residual
        # tail in another (`qgemm.cpp`), where a few rows spent most of their time between ~20 small ops
        lins = [lin for lin in vars(self).values() if isinstance(lin, Linear)]
        few = all(lin.w16 is not None and lin.few_rows for lin in lins)
        self.fused = lins[0].kernels if few else None


def _rows(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """`lin` over x [..., in] (inference, any row count) -> [..., out]."""
    return lin(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], lin.out_features)


FUSED_ROWS = 128  # up to this many rows a call (drafting; the LSA of a few tokens) the fused fp16 kernels run


def _fusable(kern: BlockKernels, x: torch.Tensor) -> bool:
    """Whether x [..., dim] goes through `kern.fused`'s compiled calls (else the op-by-op path)."""
    return kern.fused is not None and x.numel() <= FUSED_ROWS * x.shape[-1]


def _input_norm(kern: BlockKernels, x: torch.Tensor) -> torch.Tensor:
    return x if kern.ln1 is None else rms_norm_rows(x, kern.ln1, kern.eps)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as contiguous rows [-1, n] (the compiled kernels' input)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _norm_proj_rope(kern: BlockKernels, lin: Linear, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                    heads: int, rope_heads: int, head_dim: int) -> torch.Tensor:
    """The fused kernel's RoPE(rms_norm(x) @ W.T) (no norm without `kern.ln1`) on the first `rope_heads`
    heads: x [B, n, dim]; cos, sin_signed [n or 1, head_dim] -> [B, n, heads, head_dim]."""
    y = kern.fused.norm_linear_rope_f16(_flat(x), kern.ln1, kern.eps, lin.w16, cos.contiguous(),
                                        sin_signed.contiguous(), rope_heads * head_dim)
    return y.view(*x.shape[:-1], heads, head_dim)


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

    def kernels(self) -> BlockKernels:
        """The block's `BlockKernels` in its layers' weight mode, rebuilt whenever a weight changes.
        Fetch once per drafting round (it checks every weight's version) and pass to `infer`."""
        params = getattr(self, "_kernel_params", None)
        if params is None:
            params = self._kernel_params = list(self.parameters())
        key = _weights_key(params, self.q.mode)
        if getattr(self, "_kernels_key", None) != key:
            self._kernels = BlockKernels(self, self.q.mode)
            self._kernels_key = key
        return self._kernels

    def _infer_tail(self, x: torch.Tensor, att: torch.Tensor, kern: BlockKernels) -> torch.Tensor:
        """`_residual` on the inference path: x [B, n, dim] + o(att), then + the MLP of its post-norm."""
        if _fusable(kern, x):
            return kern.fused.block_tail_f16(_flat(x), _flat(att), kern.o.w16, kern.ln2, kern.eps, kern.gate_up.w16,
                                             kern.down.w16).view(x.shape)
        x = x + _rows(kern.o, att)
        gu = _rows(kern.gate_up, rms_norm_rows(x, kern.ln2, kern.eps))
        return x.add_(_rows(kern.down, F.silu(gu[..., :kern.mlp]).mul_(gu[..., kern.mlp:])))


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

    def infer(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        kern: BlockKernels | None = None,
    ) -> torch.Tensor:
        """`forward` on the inference path (no autograd): x [B, n, dim]; cos and `signed_sin` tables
        [n, head_dim] (or [1, head_dim] for rows at one position); mask bool [n, m] or None (no mask:
        every slot, as `forward`). Never writes into x."""
        kern = kern or self.kernels()
        B, n, _ = x.shape
        H, Hkv, d = self.heads, self.kv_heads, self.head_dim
        if _fusable(kern, x):
            qk = qkv = _norm_proj_rope(kern, kern.qkv, x, cos, sin_signed, H + 2 * Hkv, H + Hkv, d)
        else:
            qkv = _rows(kern.qkv, _input_norm(kern, x)).view(B, n, H + 2 * Hkv, d)
            qk = rope_rows(qkv[:, :, :H + Hkv], cos[:, None], sin_signed[:, None])
        k, v = qk[:, :, H:H + Hkv].transpose(1, 2), qkv[:, :, H + Hkv:].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(start, k, v)
        return self._infer_tail(x, attend_rows(qk[:, :, :H], k, v, mask), kern)


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

    def context_kv_infer(self, c: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                         kern: BlockKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`context_kv` on the inference path: c [B, m, dim] -> k, v [B, kv_heads, m, head_dim] (views)."""
        kern = kern or self.kernels()
        B, m, _ = c.shape
        if _fusable(kern, c):
            kv = k = _norm_proj_rope(kern, kern.kv, c, cos, sin_signed, 2 * self.kv_heads, self.kv_heads, self.head_dim)
            return k[:, :, :self.kv_heads].transpose(1, 2), kv[:, :, self.kv_heads:].transpose(1, 2)
        kv = _rows(kern.kv, _input_norm(kern, c)).view(B, m, 2 * self.kv_heads, self.head_dim)
        k = rope_rows(kv[:, :, :self.kv_heads], cos[:, None], sin_signed[:, None])
        return k.transpose(1, 2), kv[:, :, self.kv_heads:].transpose(1, 2)

    def infer(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kern: BlockKernels | None = None) -> torch.Tensor:
        """`forward` on the inference path without a mask (every context slot in k, v): x [B, n, dim]."""
        kern = kern or self.kernels()
        B, n, _ = x.shape
        if _fusable(kern, x):
            q = _norm_proj_rope(kern, kern.q, x, cos, sin_signed, self.heads, self.heads, self.head_dim)
        else:
            q = rope_rows(_rows(kern.q, _input_norm(kern, x)).view(B, n, self.heads, self.head_dim),
                          cos[:, None], sin_signed[:, None])
        return self._infer_tail(x, attend_rows(q, k, v, None), kern)


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
        return all(lin.weight is not None for lin in self.layer.linears())

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
        if lay.qkv is not None:  # quantised target: the layer's own steps (inference only)
            flat = x.reshape(-1, x.shape[-1])
            q, k, v = (t.reshape(*x.shape[:-1], -1) for t in lay.qkv_in(flat).split(lay.qkv_sizes, -1))
        else:
            h = rms_norm(x, lay.ln1, c.rms_eps)
            q, k, v = (_frozen_linear(lin, h) for lin in (lay.q, lay.k, lay.v))
            if lay.q_norm is not None:
                q = rms_norm(q.unflatten(-1, (c.num_heads, c.head_dim)), lay.q_norm, c.rms_eps).flatten(-2)
                k = rms_norm(k.unflatten(-1, (c.num_kv_heads, c.head_dim)), lay.k_norm, c.rms_eps).flatten(-2)
        q = apply_rope(_split_heads(q, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(_split_heads(k, c.num_kv_heads, c.head_dim), cos, sin)
        v = _split_heads(v, c.num_kv_heads, c.head_dim)
        if cache is not None:
            k, v = cache.update(start, k, v)
        elif prefix is not None:
            k, v = torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2)
        att = _merge_heads(_attention(q, k, v, mask, c.attn_scale if c.query_scalar else None))
        if lay.gate_up is not None:
            flat = x.reshape(-1, x.shape[-1])
            return lay.ffn(lay.attn_out(flat, att.reshape(flat.shape[0], -1))).view(x.shape)
        o = _frozen_linear(lay.o, att)
        x = x + (o if lay.post_attn is None else rms_norm(o, lay.post_attn, c.rms_eps))
        h = rms_norm(x, lay.ln2, c.rms_eps)
        g = _frozen_linear(lay.gate, h)
        act = F.gelu(g, approximate="tanh") if lay.gelu else F.silu(g)
        y = _frozen_linear(lay.down, act * _frozen_linear(lay.up, h))
        return x + (y if lay.post_ffn is None else rms_norm(y, lay.post_ffn, c.rms_eps))
