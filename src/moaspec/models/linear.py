"""Linear layers laid out for the row counts speculative decoding uses.

On this CPU class (AVX2, MKL) the fastest way to multiply depends on how many rows arrive. Up to 16
rows (decode, drafting, tree verification) `(W @ x.T).T` on a row-contiguous `x` streams the weights
fastest, with the row count padded where MKL is slow: 1 row runs as 2 (Qwen 0.5B decode step 100 ms
-> 80 ms, the 2-row kernel reaches ~28 GB/s where gemv does not), 9-15 rows as 16. Prefill-sized
inputs use `F.linear`. The `fp16` weight mode uses fbgemm's prepacked fp16 kernel (fp32 accumulation),
about 2x faster at every row count. (Dynamic int8 was tried:
per-tensor activation quantisation breaks on these models' outlier activations, logits off by >10.)
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

WeightMode = Literal["fp32", "fp16"]
WEIGHT_MODES: tuple[str, ...] = ("fp32", "fp16")
# At 5-8 rows, very tall matrices (an LM head) are multiplied 4 rows at a time: MKL's 5-8 row kernel is
# slow there (Qwen 0.5B head, 8 rows: 52 ms in one call, 41 ms in two calls of 4).
TALL = 32768


class Linear:
    """y = x @ W.T + b for x of shape [n, in]; `W` is [out, in] as stored by transformers."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, mode: WeightMode = "fp32"):
        self.out_features, self.in_features = weight.shape
        self.mode = mode
        self.bias = None if bias is None else bias.float().contiguous()
        self.cpu = weight.device.type == "cpu"
        self.weight = self.packed = None
        if not self.cpu:
            # Accelerators: one F.linear in the weight dtype; cuBLAS handles every row count well.
            dtype = torch.float32 if mode == "fp32" else torch.bfloat16
            self.weight = weight.to(dtype).contiguous()
            self.bias = None if bias is None else bias.to(dtype)
        elif mode == "fp16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), self.bias)
        else:
            self.weight = weight.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if not self.cpu:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()
        if self.packed is not None:
            return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)
        if n > 16:
            return F.linear(x, self.weight, self.bias)
        if 4 < n <= 8 and self.out_features >= TALL:
            y = torch.cat([self._small(x[i:i + 4]) for i in range(0, n, 4)])
        else:
            y = self._small(x)
        return y if self.bias is None else y + self.bias

    def _small(self, x: torch.Tensor) -> torch.Tensor:
        """(W @ x.T).T for 1-16 rows, padded to MKL's fast row counts (1 -> 2, 9-15 -> 16)."""
        n = x.shape[0]
        pad = 1 if n == 1 else (16 - n if n > 8 else 0)
        xc = x.contiguous() if pad == 0 else torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return (self.weight @ xc.T).T[:n].contiguous()

    def nbytes(self) -> int:
        if self.packed is not None:
            return self.out_features * self.in_features * 2
        return self.weight.numel() * self.weight.element_size()
