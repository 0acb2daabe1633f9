"""Linear layers laid out for the row counts speculative decoding uses.

On this CPU class (AVX2, MKL) the fastest way to multiply depends on how many rows arrive:
1 row (plain decode, drafting) wants `x @ W.T` from a stored transposed copy for wide matrices,
2-16 rows (tree verification) want `(W @ x.T).T` on a row-contiguous `x`, MKL is slow at 9-15 rows
(pad to 16), and large row counts (prefill) want `F.linear`. The `fp16` weight mode uses fbgemm's
prepacked fp16 kernel (fp32 accumulation), about 2x faster at every row count. (Dynamic int8 was tried:
per-tensor activation quantisation breaks on these models' outlier activations, logits off by >10.)
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

WeightMode = Literal["fp32", "fp16"]
WEIGHT_MODES: tuple[str, ...] = ("fp32", "fp16")


class Linear:
    """y = x @ W.T + b for x of shape [n, in]; `W` is [out, in] as stored by transformers."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, mode: WeightMode = "fp32"):
        self.out_features, self.in_features = weight.shape
        self.mode = mode
        self.bias = None if bias is None else bias.float().contiguous()
        self.cpu = weight.device.type == "cpu"
        self.weight = self.weight_t = self.packed = None
        if not self.cpu:
            # Accelerators: one F.linear in the weight dtype; cuBLAS handles every row count well.
            dtype = torch.float32 if mode == "fp32" else torch.bfloat16
            self.weight = weight.to(dtype).contiguous()
            self.bias = None if bias is None else bias.to(dtype)
        elif mode == "fp16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), self.bias)
        else:
            self.weight = weight.float().contiguous()
            if self.out_features >= self.in_features:
                self.weight_t = self.weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if not self.cpu:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()
        if self.packed is not None:
            return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)
        if n == 1:
            y = x @ self.weight_t if self.weight_t is not None else torch.mv(self.weight, x[0])[None]
        elif n <= 16:
            pad = 16 - n if n > 8 else 0
            xc = x.contiguous() if pad == 0 else torch.cat([x, x.new_zeros(pad, x.shape[1])])
            y = (self.weight @ xc.T).T[:n].contiguous()
        else:
            return F.linear(x, self.weight, self.bias)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        if self.packed is not None:
            return self.out_features * self.in_features * 2
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_t) if t is not None)
