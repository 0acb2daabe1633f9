"""Linear layers laid out for the row counts speculative decoding uses.

On this CPU class (AVX2, MKL) the fastest way to multiply depends on how many rows arrive. Up to 16
rows (decode, drafting, tree verification) `(W @ x.T).T` on a row-contiguous `x` streams the weights
fastest, with the row count padded where MKL is slow: 1 row runs as 2 (Qwen 0.5B decode step 100 ms
-> 80 ms, the 2-row kernel reaches ~28 GB/s where gemv does not), 9-15 rows as 16. Prefill-sized
inputs use `F.linear`. The `fp16` weight mode uses fbgemm's prepacked fp16 kernel (fp32 accumulation),
about 2x faster at every row count, and up to `FEW_ROWS` rows the compiled kernel of `quant.py` where it
builds and, for a model's layers, measures faster (`Transformer.few_row_choice`): it converts each
weight once for all rows, so on a Zen 2 VM a 2-6 row verification costs little more than a decode step,
while on a Zen 4 VM with AVX-512 fbgemm streams Qwen 0.5B's 2-4 rows faster. Either way a row's bits
must not depend on the rows beside it; the choice checks that of fbgemm before taking it. (Dynamic int8
was tried: per-tensor activation quantisation breaks on these models' outlier activations, logits off by >10.)
The `int8` and `int4` modes store quantised weights and multiply them with the compiled kernels of
`quant.py` (activations quantised per block of 32 values); `int4` groups 32 inputs per scale and
offset unless the mode names another group (`int4-g64`, `int4-g128`).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F

from moaspec.models import blocks, quant

WeightMode = Literal["fp32", "fp16", "int8", "int4", "int4-g64", "int4-g128", "gguf"]
GGUF = "gguf"  # a GGUF file's own block formats, tensor by tensor (`blocks.py`); int8 for a float tensor
WEIGHT_MODES: tuple[str, ...] = ("fp32", "fp16", "int8", "int4", "int4-g64", "int4-g128", GGUF)
QUANTISED = ("int8", "int4", "int4-g64", "int4-g128", GGUF)
AUTO = "auto"  # the default: the fastest mode at the model's own quality (`runtime.resolve_weights`)
WEIGHT_CHOICES: tuple[str, ...] = (AUTO, *WEIGHT_MODES)
log = logging.getLogger(__name__)
# At 5-8 rows, very tall matrices (an LM head) are multiplied 4 rows at a time: MKL's 5-8 row kernel is
# slow there (Qwen 0.5B head, 8 rows: 52 ms in one call, 41 ms in two calls of 4).
TALL = 32768
FEW_ROWS = 8  # up to this many rows, fp16 layers may run `linear_f16` (beyond, fbgemm's blocked kernel is faster)


class Linear:
    """y = x @ W.T + b for x of shape [n, in]; `W` is [out, in] as stored by transformers."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, mode: WeightMode = "fp32"):
        self.out_features, self.in_features = weight.shape
        if mode == GGUF:  # a float tensor has no block format of its own (`from_blocks` builds those)
            mode = "int8"
        self.mode = mode
        self.bias = None if bias is None else bias.float().contiguous()
        self.cpu = weight.device.type == "cpu"
        self.weight = self.packed = self.q = self.w16 = self.blocks = None
        self.few_rows = False  # fp16: 1-8 rows through `linear_f16` rather than fbgemm (`set_few_rows`)
        # fp16: whether fbgemm computes a row the same whatever rows share its call (`Transformer.batch_invariant`
        # checks it before a batched pass stacks several sequences' rows into one fbgemm call)
        self.fbgemm_rows_independent = False
        if mode in QUANTISED:
            mode = self.mode = runnable_mode(mode, weight.device, self.in_features, self.out_features)
        if mode in QUANTISED:
            self.kernels = quant.kernels()
            if mode == "int8":
                q, self.scale = quant.quantize_int8(weight)
                self.q = quant.interleave_int8(q)
            else:
                self.group = int4_group(mode)
                self.q, self.scale, self.offset = quant.interleave_int4(*quant.quantize_int4(weight, self.group))
        elif not self.cpu:
            # Accelerators: one F.linear in the weight dtype; cuBLAS handles every row count well.
            dtype = torch.float32 if mode == "fp32" else torch.bfloat16
            self.weight = weight.to(dtype).contiguous()
            self.bias = None if bias is None else bias.to(dtype)
        elif mode == "fp16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), self.bias)
            self.kernels = quant.kernels_or_none()
            forced = quant.f16_override()  # a `Transformer` measures its own choice
            self.set_few_rows(True if forced is None else forced, weight=weight)
        else:
            self.weight = weight.float().contiguous()

    @classmethod
    def from_blocks(cls, weight: blocks.BlockWeight, bias: torch.Tensor | None = None) -> Linear:
        """A layer kept in a GGUF block format (`mode` "gguf", its format in `weight.fmt`)."""
        lin = cls.__new__(cls)
        lin.out_features, lin.in_features = weight.out_features, weight.in_features
        lin.mode, lin.cpu, lin.few_rows, lin.fbgemm_rows_independent = GGUF, True, False, False
        lin.weight = lin.packed = lin.q = lin.w16 = None
        lin.blocks = weight
        lin.bias = None if bias is None else bias.float().contiguous()
        return lin

    def __call__(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """x @ W.T + b. `counts`: x stacks the rows of several sequences, this many each (a batched pass);
        each sequence's rows are computed by the kernel that a call with its rows alone would use, in one
        call wherever the kernels agree, so that its result is the same bits as alone (`batch_invariant`)."""
        if self.blocks is not None:
            return blocks.linear(x.float().contiguous(), self.blocks, self.bias)
        if counts is not None and len(counts) > 1 and self.packed is not None:
            return self._stacked(x, counts)
        n = x.shape[0]
        if not self.cpu:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()
        if self.packed is not None:
            if n <= FEW_ROWS and self.few_rows:
                return self.kernels.linear_f16(x.float().contiguous(), self.w16, self.bias)
            return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)
        if self.q is not None:
            x = x.float().contiguous()
            if self.mode == "int8":
                return self.kernels.linear_q8(x, self.q, self.scale, self.bias)
            return self.kernels.linear_q4(x, self.q, self.scale, self.offset, self.group, self.bias)
        if n > 16:
            return F.linear(x, self.weight, self.bias)
        if 4 < n <= 8 and self.out_features >= TALL:
            y = torch.cat([self._small(x[i:i + 4]) for i in range(0, n, 4)])
        else:
            y = self._small(x)
        return y if self.bias is None else y + self.bias

    def _f16_kind(self, n: int) -> str:
        """Which fp16 kernel a call with n rows runs: "few" or "fbgemm"."""
        return "few" if n <= FEW_ROWS and self.few_rows else "fbgemm"

    def fbgemm_splits_agree(self, x: torch.Tensor, cuts: tuple[int, ...]) -> bool:
        """Whether fbgemm's fp16 kernel gives the rows of x the same bits in one call as in pieces cut at
        `cuts` (row indices): whether a row's result is independent of the rows beside it."""
        bounds = (0, *cuts, x.shape[0])
        pieces = [torch.ops.quantized.linear_dynamic_fp16(x[a:b].contiguous(), self.packed)
                  for a, b in zip(bounds, bounds[1:], strict=False)]
        return torch.equal(torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed), torch.cat(pieces))

    def _stacked(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """fp16 rows of several sequences: runs of neighbours whose lone calls take the same kernel go
        through it together (the few-row kernel at any row count, 8 rows a tile; fbgemm only where its rows
        proved independent, else one call per sequence)."""
        runs: list[tuple[str, int, int]] = []  # (kernel, first row, end row)
        start = 0
        for n in counts:
            kind = self._f16_kind(n)
            if runs and runs[-1][0] == kind and (kind == "few" or self.fbgemm_rows_independent):
                runs[-1] = (kind, runs[-1][1], start + n)
            else:
                runs.append((kind, start, start + n))
            start += n
        parts = []
        for kind, a, b in runs:
            rows = x[a:b].contiguous()
            if kind == "few":
                parts.append(self.kernels.linear_f16(rows.float(), self.w16, self.bias))
            else:
                parts.append(torch.ops.quantized.linear_dynamic_fp16(rows, self.packed))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def set_few_rows(self, on: bool, keep_copy: bool = True, weight: torch.Tensor | None = None) -> None:
        """fp16 on a CPU with the compiled kernels: run 1-8 rows through `linear_f16` (True) or fbgemm
        (False). `linear_f16` needs its own fp16 copy of the weights (fbgemm's packing is opaque), made
        when switched on (from `weight` where the caller has it, else unpacked from fbgemm's); switched
        off without `keep_copy`, the layer drops it and holds one copy."""
        if self.packed is None or self.kernels is None or self.in_features % 8:
            return
        if on and self.w16 is None:
            if weight is None:
                weight = torch.ops.quantized.linear_unpack_fp16(self.packed)[0]
            self.w16 = weight.half().contiguous()
        if not on and not keep_copy:
            self.w16 = None
        self.few_rows = on

    def _small(self, x: torch.Tensor) -> torch.Tensor:
        """(W @ x.T).T for 1-16 rows, padded to MKL's fast row counts (1 -> 2, 9-15 -> 16)."""
        n = x.shape[0]
        pad = 1 if n == 1 else (16 - n if n > 8 else 0)
        xc = x.contiguous() if pad == 0 else torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return (self.weight @ xc.T).T[:n].contiguous()

    def nbytes(self) -> int:
        if self.blocks is not None:
            return self.blocks.nbytes()
        if self.q is not None:
            extra = [self.scale] + ([self.offset] if self.mode != "int8" else [])
            return sum(t.numel() * t.element_size() for t in [self.q, *extra])
        if self.packed is not None:
            return self.out_features * self.in_features * 2
        return self.weight.numel() * self.weight.element_size()


class Parts:
    """Layers that share an input and whose outputs are stacked (q|k|v stored in different block formats):
    one call, each part's kernel, the outputs side by side."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.mode = GGUF

    def __call__(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        x = x.float().contiguous()
        return torch.cat([p(x, counts) for p in self.parts], -1)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


# Like llama.cpp's Q4_K_M, the int4 modes keep the tensors that quantisation hurts most at 8 bits: the
# attention values, the MLP's down projection and the LM head (Qwen 0.5B: KL to fp32 0.066 -> see docs/results.md).
# The values are fused with q and k into one kernel there, so all three go to 8 bits (4% of a layer).
INT8_IN_INT4 = ("self_attn.qkv", "mlp.down_proj", "lm_head")


def int4_group(mode: str) -> int:
    """The group size an int4 mode names (`int4` = 32, `int4-g64` = 64)."""
    return int(mode.partition("-g")[2] or quant.BLOCK)


def tensor_mode(mode: str, name: str, weight: torch.Tensor | None = None) -> str:
    """The weight mode of the tensor `name` (a module path) under the model-wide `mode`: int8 for the
    sensitive ones in the int4 modes, unless the weights already lie on int4's grid of 32 (a Q4_1 GGUF's
    tensors: there int4 is exact and int8 would not be)."""
    if not (mode.startswith("int4") and name.endswith(INT8_IN_INT4)):
        return mode
    return "int4" if weight is not None and quant.on_int4_grid(weight) else "int8"


def runnable_mode(mode: str, device: torch.device, in_features: int | None = None,
                  out_features: int | None = None) -> str:
    """The weight mode this device (and a layer of `in_features` inputs, `out_features` outputs) can run:
    the quantised modes need the compiled CPU kernels and fall back to fp16 weights (with one warning)
    where those cannot be built or on an accelerator; a layer whose inputs the kernel's blocks or the group
    do not divide runs in the next finer mode that fits (int4-gN -> int4 -> fp16), and one whose outputs
    are not whole groups of the kernels' 8 channels in fp16."""
    if mode not in QUANTISED:
        return mode
    if in_features is not None and mode == GGUF:
        mode = "int8"  # a float layer under the file's formats (a GGUF tensor itself never comes here)
    if in_features is not None:
        if mode != "int8" and in_features % int4_group(mode):
            mode = "int4"  # groups of 32 divide every width the next check lets through
        if in_features % quant.BLOCK:
            return "fp16"
    if device.type != "cpu":
        _warn_once(f"--weights {mode} runs on the CPU kernels only; {device.type} uses 16-bit weights")
        return "fp16"
    try:
        quant.kernels()
    except quant.UserError as e:
        _warn_once(f"--weights {mode} is unavailable here, using fp16: {e}")
        return "fp16"
    if out_features is not None and out_features % quant.channels():
        return "fp16"
    return mode


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)
