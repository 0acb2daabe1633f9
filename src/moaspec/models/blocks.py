"""llama.cpp's GGUF block formats multiplied as the file stores them.

A GGUF keeps each tensor in one of llama.cpp's block formats (SmolLM2: Q4_1 and Q8_0; Qwen2.5 0.5B: Q5_0,
Q8_0, Q4_K and Q6_K). De-quantising them to re-quantise in int8/int4 either loses the file's exact
weights or moves more bytes per weight; instead `pack` repacks a tensor's bytes once, keeping its values,
scales and (within 3%) its bytes per weight, into the layout of the compiled kernels (`qgemm.cpp`, "GGUF
block formats"), and `linear` multiplies with it like the int4 kernel: activations quantised per block of
32 to int8, integer dot products over NCH output channels at once, one float FMA per block and row, each
row's result independent of the rows beside it.

    format  bits  block  value                            bytes/weight (file)
    Q4_0    4     32     d (q - 8)                        0.5625
    Q4_1    4     32     d q + m                          0.625
    Q5_0    5     32     d (q - 16)                       0.6875
    Q5_1    5     32     d q + m                          0.75
    Q8_0    8     32     d q                              1.0625
    Q4_K    4     256    d sc[j] q - dmin m[j], j per 32  0.5625 (kernel 0.578)
    Q5_K    5     256    as Q4_K                          0.6875 (kernel 0.703)
    Q6_K    6     256    d sc[i] (q - 32), i per 16       0.8203

The kernels' layout (C = `quant.channels()` output channels a group, B = in / 32 blocks, S = in / 256):
every format's 4-bit part is `qs` [out / C, B, 4, C, 4] uint8, chunk k of a block holding per channel
values 4k..4k+3 in the low nibbles and 16+4k..16+4k+3 in the high ones (Q8_0: [out / C, B, 8, C, 4] int8,
values in order); the 5th bit (Q5_*: `qh` [out / C, B, C, 4]) or the 5th-6th bits (Q6_K: [out / C, B, 2,
C, 4]) of plane i (chunk i // 2, low nibbles for even i) lie in bit i, or in bits 2 (i % 4) and up of
vector i // 4, of the nibble's byte position. Scales are fp16 [out / C, B, C] (d), [out / C, B, 2, C] (d, m),
[out / C, S, 2, C] (K-quants' d, dmin); Q4_K/Q5_K's 6-bit sub-block scales and mins unpacked to uint8
[out / C, S, 2, 8, C], Q6_K's int8 scales [out / C, S, 16, C].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from moaspec.errors import UserError
from moaspec.models import quant

FORMATS: tuple[str, ...] = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# values a block and bytes a block in the file (gguf.constants.GGML_QUANT_SIZES)
SIZES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
CHUNK_BYTES = 4 << 20  # file bytes repacked at a time: bounds the transient copies, keeps them in cache


@dataclass
class BlockWeight:
    """A [out_features, in_features] weight in a GGUF block format, in the kernels' layout."""

    fmt: str  # one of FORMATS
    out_features: int
    in_features: int
    tensors: list[torch.Tensor]  # `pack`'s layout for this format

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def supported(fmt: str, out_features: int, in_features: int) -> bool:
    """Whether a kernel exists for this format and shape (and the compiled kernels build here)."""
    if fmt not in FORMATS or quant.kernels_or_none() is None:
        return False
    return out_features > 0 and out_features % quant.channels() == 0 and in_features > 0 \
        and in_features % SIZES[fmt][0] == 0


def pack(fmt: str, raw, out_features: int, in_features: int) -> BlockWeight:
    """The kernels' layout of a tensor's GGUF bytes `raw` (uint8 [out_features, bytes a row], numpy, which
    may be a read-only memmap, or torch; never written). Repacked a few MB of rows at a time: beside the
    result, transient memory stays within a few chunks."""
    if fmt not in FORMATS:
        raise UserError(f"no kernel for GGUF format {fmt}; kernels exist for {', '.join(FORMATS)}")
    if not supported(fmt, out_features, in_features):
        raise UserError(f"no {fmt} kernel for a {out_features} x {in_features} weight: outputs must be a multiple "
                        f"of {quant.channels()}, inputs of {SIZES[fmt][0]}")
    bs, ts = SIZES[fmt]
    nb, row_bytes = in_features // bs, in_features // bs * ts
    if tuple(raw.shape) != (out_features, row_bytes):
        if (raw.size if isinstance(raw, np.ndarray) else raw.numel()) != out_features * row_bytes:
            raise UserError(f"{fmt} {out_features} x {in_features} takes {out_features * row_bytes} bytes, "
                            f"not {tuple(raw.shape)}")
        raw = raw.reshape(out_features, row_bytes)
    c = quant.channels()
    out = _allocate(fmt, out_features // c, in_features, c)
    views = [_np_view(t) for t in out]
    data = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    step = max(c, CHUNK_BYTES // row_bytes // c * c)
    for r0 in range(0, out_features, step):
        r1 = min(out_features, r0 + step)
        piece = data[r0:r1].view(np.uint8).reshape(r1 - r0, nb, ts)  # a view: only read
        _REPACK[fmt](piece, c, [v[r0 // c:r1 // c] for v in views])
    return BlockWeight(fmt, out_features, in_features, out)


def linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, in] -> x @ W.T + bias [R, out] float32, W the file's de-quantised weight; a row's result does not
    depend on the other rows."""
    kind, tensors = stack_part(w)
    return quant.kernels().linear_part(x.float().contiguous(), kind, tensors, bias, 0)


def stack_part(w: BlockWeight) -> tuple[int, list[torch.Tensor]]:
    """(kind, tensors) of this weight as a part of the compiled `Stack`: kinds 0 and 1 are int8 and int4."""
    return 2 + FORMATS.index(w.fmt), w.tensors


# ---- repacking, in numpy (one thread, no OpenMP waits beside other work): b [n, blocks, bytes] uint8, a
# view of n (a multiple of c) rows of the file, into numpy views of the output slices. Each field is copied
# out of the blocks once, then moved in 4- or 8-byte words.

U64 = np.uint64


def _allocate(fmt: str, groups: int, inp: int, c: int) -> list[torch.Tensor]:
    nb, ns = inp // 32, inp // 256
    u8, i8, f16 = torch.uint8, torch.int8, torch.float16
    qs, q5, q6 = ((nb, 4, c, 4), u8), ((nb, c, 4), u8), ((nb, 2, c, 4), u8)
    d, dm, kdm, scm = ((nb, c), f16), ((nb, 2, c), f16), ((ns, 2, c), f16), ((ns, 2, 8, c), u8)
    shapes = {
        "Q4_0": [qs, d], "Q4_1": [qs, dm], "Q5_0": [qs, q5, d], "Q5_1": [qs, q5, dm], "Q8_0": [((nb, 8, c, 4), i8), d],
        "Q4_K": [qs, kdm, scm], "Q5_K": [qs, q5, kdm, scm], "Q6_K": [qs, q6, ((ns, c), f16), ((ns, 16, c), i8)],
    }[fmt]
    return [torch.empty(groups, *shape, dtype=dtype) for shape, dtype in shapes]


def _np_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of an output tensor: 4-byte words where its last dimension is 4 bytes (chunks and
    high-bit vectors), raw uint16 bits for fp16, else its own dtype."""
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.uint16)
    a = t.numpy()
    return a.view(np.int32)[..., 0] if a.shape[-1] == 4 and a.itemsize == 1 else a


def _field(b: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Bytes lo..hi of every block, contiguous: [n, blocks, hi - lo] uint8."""
    return np.ascontiguousarray(b[..., lo:hi])


def _f16(b: np.ndarray, at: int, count: int = 1) -> np.ndarray:
    """`count` fp16 fields from byte `at` of each block, as raw bits: [n, blocks, count] uint16."""
    return _field(b, at, at + 2 * count).view(np.uint16)


def _by_channel(a: np.ndarray, c: int) -> np.ndarray:
    """[n, ...] -> [n / c, ..., c]: a group's channels side by side."""
    return np.moveaxis(a.reshape(a.shape[0] // c, c, *a.shape[1:]), 1, -1)


def _chunks(v: np.ndarray, c: int) -> np.ndarray:
    """Bytes in chunk order, 4 k + j, of each row and block [n, blocks, 4 m] -> [n / c, blocks, m, c] 4-byte
    words (channel c's 4 bytes of chunk k side by side with the others')."""
    return _by_channel(np.ascontiguousarray(v).view(np.int32), c)


def _nibble_sets(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two blocks kept in the low and the high nibbles of the same bytes, q [..., 2, 16] (values 0..15 of
    both, then 16..31) -> the `_chunks` bytes of the low nibbles' block and of the high ones' [..., 16]."""
    m = U64(0x0F0F0F0F0F0F0F0F)
    first = np.ascontiguousarray(q[..., 0, :]).view(U64)
    second = np.ascontiguousarray(q[..., 1, :]).view(U64)
    low = first & m
    low |= (second & m) << U64(4)
    first >>= U64(4)
    first &= m
    second &= ~m
    first |= second
    return low.view(np.uint8), first.view(np.uint8)


def _transpose8(x: np.ndarray) -> np.ndarray:
    """8 x 8 bit matrices, one a uint64 (bit c of byte r -> bit r of byte c), in place."""
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        t = (x ^ (x >> U64(shift))) & U64(mask)
        x ^= t ^ (t << U64(shift))
    return x


@cache
def _plane_tables(bits: int, upper: int) -> np.ndarray:
    """[4, 256] tables: entry [m, v] sets, for each bit b of v (the bit of a block's value l = 8 m + b), that
    bit in the kernels' high-bit vectors: plane i = 2 k + half (l = 16 half + 4 k + j) at bit i of byte j
    (bits = 1, uint32), or bit 2 (i % 4) + upper of byte j of vector i // 4 (bits = 2, both vectors as one
    uint64: the value's 5th bit for upper = 0, its 6th for 1)."""
    out = np.zeros((4, 256), np.uint32 if bits == 1 else U64)
    v = np.arange(256)
    for m in range(4):
        for b in range(8):
            half, k, j = (8 * m + b) // 16, (8 * m + b) % 16 // 4, (8 * m + b) % 4
            i = 2 * k + half
            at = 8 * j + (i if bits == 1 else 32 * (i // 4) + 2 * (i % 4) + upper)
            out[m, (v >> b) & 1 == 1] |= out.dtype.type(1 << at)
    return out


def _planes(masks: list[np.ndarray], bits: int = 1) -> np.ndarray:
    """High-bit vectors from each block's bit masks: masks[m] (uint8, any shape) = bits 8 m..8 m + 7 of its
    values' 5th bits, one a value; for bits = 2 (Q6_K) also masks[4 + m] of their 6th bits."""
    out = None
    for upper in range(bits):
        tables = _plane_tables(bits, upper)
        for m in range(4):
            v = tables[m][masks[4 * upper + m]]
            out = v if out is None else out | v
    return out


def _k_scales(s: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins [n, S, 12] -> [n, S, 2, 8] (sc, m) uint8, 4 at a time."""
    w = np.ascontiguousarray(s).view(np.uint32)  # [n, S, 3]: low bits of sc 0..3, of m 0..3, high ones of both
    d, m, md = w[..., 0], w[..., 1], w[..., 2]
    six, four, top = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x30303030)
    out = np.empty((*w.shape[:2], 4), np.uint32)
    out[..., 0] = d & six
    out[..., 1] = (md & four) | ((d >> np.uint32(2)) & top)
    out[..., 2] = m & six
    out[..., 3] = ((md >> np.uint32(4)) & four) | ((m >> np.uint32(2)) & top)
    return out.view(np.uint8).reshape(*w.shape[:2], 2, 8)


def _q4_0(b, c, out):
    out[0][...] = _chunks(b[..., 2:18], c)  # file byte j: values j and 16 + j, as chunk j // 4 wants them
    out[1][...] = _by_channel(_f16(b, 0)[..., 0], c)


def _q4_1(b, c, out):
    out[0][...] = _chunks(b[..., 4:20], c)
    out[1][...] = _by_channel(_f16(b, 0, 2), c)


def _q5(b, c, out, at):
    """Q5_0 (the 4 bytes of 5th bits at byte 2: d, qh, qs) and Q5_1 (at byte 4: d, m, qh, qs)."""
    out[0][...] = _chunks(b[..., at + 4:at + 20], c)
    qh = _field(b, at, at + 4)  # bit l of the little-endian word: value l's 5th bit
    out[1][...] = _by_channel(_planes([qh[..., m] for m in range(4)]), c)
    out[2][...] = _by_channel(_f16(b, 0, 2) if at == 4 else _f16(b, 0)[..., 0], c)  # d, m or d


def _q8_0(b, c, out):
    out[0][...] = _chunks(b[..., 2:34], c)
    out[1][...] = _by_channel(_f16(b, 0)[..., 0], c)


def _k_nibbles(b: np.ndarray, at: int, c: int, qs: np.ndarray) -> None:
    """Q4_K/Q5_K's 128 bytes a super-block from byte `at` (4 x 32 bytes: low nibbles block 2 i, high ones block
    2 i + 1, value l at byte l) into qs [n / c, 8 S, 4, c]."""
    n, ns = b.shape[:2]
    even, odd = _nibble_sets(b[..., at:at + 128].reshape(n, ns, 4, 2, 16))
    dst = qs.reshape(n // c, ns, 4, 2, 4, c)
    dst[:, :, :, 0] = _chunks(even, c)
    dst[:, :, :, 1] = _chunks(odd, c)


def _q4_k(b, c, out):
    _k_nibbles(b, 16, c, out[0])
    out[1][...] = _by_channel(_f16(b, 0, 2), c)
    out[2][...] = _by_channel(_k_scales(b[..., 4:16]), c)


def _q5_k(b, c, out):
    n, ns = b.shape[:2]
    _k_nibbles(b, 48, c, out[0])
    # bit i of byte l of qh: the 5th bit of block i's value l; transposed, byte i of word m holds block i's
    # 5th bits of values 8 m..8 m + 7
    masks = _transpose8(_field(b, 16, 48).view(U64)).view(np.uint8).reshape(n, ns, 4, 8)
    out[1][...] = _by_channel(_planes([masks[:, :, m] for m in range(4)]).reshape(n, ns * 8), c)
    out[2][...] = _by_channel(_f16(b, 0, 2), c)
    out[3][...] = _by_channel(_k_scales(b[..., 4:16]), c)


def _q6_k(b, c, out):
    n, ns = b.shape[:2]
    # value 128 h + 32 t + l (t = 0..3, l = 0..31): its low 4 bits in nibble t // 2 of ql[64 h + 32 (t % 2) + l],
    # its high 2 bits at bits 2 t, 2 t + 1 of qh[32 h + l]; the block of 32 is 4 h + t
    low, high = _nibble_sets(b[..., 0:128].reshape(n, ns, 2, 2, 2, 16))  # [n, S, h, t % 2, 16]
    dst = out[0].reshape(n // c, ns, 2, 2, 2, 4, c)  # h, t // 2, t % 2
    dst[:, :, :, 0] = _chunks(low, c)
    dst[:, :, :, 1] = _chunks(high, c)
    # transposed, byte 2 t (+ 1) of word m holds block (h, t)'s 5th (6th) bits of values 8 m..8 m + 7
    masks = _transpose8(_field(b, 128, 192).view(U64)).view(np.uint8).reshape(n, ns, 2, 4, 4, 2)  # h, m, t, bit
    vectors = _planes([masks[:, :, :, m, :, 0] for m in range(4)] + [masks[:, :, :, m, :, 1] for m in range(4)], 2)
    out[1][...] = _by_channel(vectors.view(np.int32).reshape(n, ns * 8, 2), c)
    out[2][...] = _by_channel(_f16(b, 208)[..., 0], c)
    out[3][...] = _by_channel(_field(b, 192, 208).view(np.int8), c)


_REPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": lambda b, c, out: _q5(b, c, out, 2),
           "Q5_1": lambda b, c, out: _q5(b, c, out, 4), "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
