"""GGUF block formats: the kernels against gguf's own de-quantisation, row invariance, and the one-call
`Stack` with layers whose slots mix block formats, int8 and int4."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from moaspec.errors import UserError
from moaspec.models import blocks, quant

pytestmark = pytest.mark.needs_kernels

SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}  # where each format's fp16 fields lie in a block


def random_blocks(fmt, out, inp, rng, scale=0.01):
    """Valid `fmt` bytes [out, bytes a row]: random bytes (every bit pattern of the values, scales and
    mins), the fp16 fields set to small values of either sign."""
    bs, ts = blocks.SIZES[fmt]
    b = rng.integers(0, 256, (out, inp // bs, ts), dtype=np.uint8)
    for at in SCALES[fmt]:
        v = (rng.uniform(0.2, 1.0, b.shape[:2]) * rng.choice([-scale, scale], b.shape[:2])).astype(np.float16)
        b[..., at:at + 2] = v.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(out, -1)


def quantized(fmt, w):
    """gguf's own quantisation of float weights w [out, in] into `fmt` where it has one, else None."""
    try:
        return quants.quantize(w.astype(np.float32), GGMLQuantizationType[fmt])
    except NotImplementedError:
        return None


def dequantized(fmt, raw):
    return quants.dequantize(np.asarray(raw), GGMLQuantizationType[fmt])


# the check run in a subprocess per build, with the helpers above
SYNTH = "\n".join(["import numpy as np", "from gguf import GGMLQuantizationType, quants",
                   "from moaspec.models import blocks", f"SCALES = {SCALES!r}",
                   *(inspect.getsource(f) for f in (random_blocks, quantized, dequantized))])
BLOCK_CHECK = SYNTH + '''
import torch

from moaspec.models import quant

torch.manual_seed(0)
rng = np.random.default_rng(0)
c = quant.channels()
worst = worst_plain = 0.0


def blocks8(x):  # the activations as the kernels see them: int8 per block of 32 values, one scale each
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(x.shape)


for fmt in blocks.FORMATS:
    k_quant = blocks.SIZES[fmt][0] == 256
    for out, inp in ((3 * c, 512), (2 * c, 768)) if k_quant else ((3 * c, 448), (c, 96)):
        raws = [random_blocks(fmt, out, inp, rng)]
        q = quantized(fmt, rng.standard_normal((out, inp)))
        if q is not None:
            raws.append(q)
        for raw in raws:
            raw.setflags(write=False)  # as a read-only memmap of the file: pack must only read it
            w_ref = torch.from_numpy(dequantized(fmt, raw).reshape(out, inp).astype(np.float32))
            w = blocks.pack(fmt, raw, out, inp)
            assert w.fmt == fmt and (w.out_features, w.in_features) == (out, inp)
            assert raw.nbytes <= w.nbytes() <= 1.03 * raw.nbytes, (fmt, w.nbytes(), raw.nbytes)
            # in pieces of one channel group at a time, and from a torch tensor: the same layout
            saved, blocks.CHUNK_BYTES = blocks.CHUNK_BYTES, 1
            again = blocks.pack(fmt, torch.from_numpy(raw.copy()), out, inp)
            blocks.CHUNK_BYTES = saved
            assert all(torch.equal(a, b) for a, b in zip(w.tensors, again.tensors, strict=True)), fmt
            bias = torch.randn(out)
            # every tile size (1..8 rows), tiles after the first, a second block of 64 rows
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 17, 40, 130):
                x = torch.randn(rows, inp)
                x[0, 5] = 60.0  # an outlier coarsens only its own block of 32
                y = blocks.linear(x, w, bias if rows % 2 else None)
                ref = (blocks8(x).double() @ w_ref.double().T).float() + (bias if rows % 2 else 0)
                worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
                if rows > 1:  # float x, on the rows without the outlier
                    plain = x[1:] @ w_ref.T + (bias if rows % 2 else 0)
                    worst_plain = max(worst_plain, ((y[1:] - plain).abs().max() / plain.abs().max()).item())
            # a row's bits never depend on the rows beside it in the call
            x = torch.randn(19, inp)
            single = torch.cat([blocks.linear(x[i:i + 1], w, bias) for i in range(len(x))])
            for rows in range(2, len(x) + 1):
                assert torch.equal(blocks.linear(x[:rows], w, bias), single[:rows]), (fmt, rows)
print(worst, worst_plain)
'''


@pytest.mark.parametrize("arch", ["native", "avx2"])
def test_block_kernels_match_ggufs_dequantisation(arch):
    """Every format, in this CPU's best build and the plain-AVX2 one: x @ W.T with W gguf's own
    de-quantisation of the bytes, from random block bytes (every bit pattern) and from gguf's quantiser
    where it has one, equals the kernel up to float rounding with the activations in 8-bit blocks
    (relative error < 1e-4), and within a few percent of float x; a row's bits do not depend on the rows
    beside it (2..19 rows against 1 at a time); the layout's bytes stay within 3% of the file's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if arch == "avx2":
        env["MOASPEC_QGEMM_ARCH"] = "avx2"
    out = subprocess.run([sys.executable, "-c", BLOCK_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    worst, worst_plain = map(float, out.stdout.split()[-2:])
    assert worst < 1e-4 and worst_plain < 0.03, (worst, worst_plain)


def test_bad_shapes_and_tensors_are_refused():
    c = quant.channels()
    assert blocks.supported("Q4_K", 2 * c, 512) and blocks.supported("Q8_0", c, 96)
    assert not blocks.supported("Q4_K", 2 * c, 480)  # not whole super-blocks of 256
    assert not blocks.supported("Q8_0", c + 4, 96)  # not whole groups of channels
    assert not blocks.supported("IQ2_XS", c, 256)
    with pytest.raises(UserError, match="inputs of 256"):
        blocks.pack("Q4_K", np.zeros((c, 144), np.uint8), c, 320)
    with pytest.raises(UserError, match="IQ2_XS"):
        blocks.pack("IQ2_XS", np.zeros((c, 66), np.uint8), c, 256)
    with pytest.raises(UserError, match="bytes"):
        blocks.pack("Q8_0", np.zeros((c, 33), np.uint8), c, 32)
    w = blocks.pack("Q5_0", random_blocks("Q5_0", c, 64, np.random.default_rng(1)), c, 64)
    kern = quant.kernels()
    with pytest.raises(RuntimeError, match="columns"):
        blocks.linear(torch.randn(2, 32), w)
    with pytest.raises(RuntimeError, match="blocks.pack"):
        kern.linear_part(torch.randn(2, 64), 2 + blocks.FORMATS.index("Q5_0"), w.tensors[:2])
    with pytest.raises(RuntimeError, match="blocks.pack"):  # Q5_0's tensors called Q5_1
        kern.linear_part(torch.randn(2, 64), 2 + blocks.FORMATS.index("Q5_1"), w.tensors)


# a tiny model: hidden 256 (8 heads of 32, 2 KV heads), MLP 512; every slot kind and format once
H, HKV, HD, D, M, EPS = 8, 2, 32, 256, 512, 1e-6


def _block_part(fmt, out, inp, rng, bias=False):
    raw = quantized(fmt, rng.standard_normal((out, inp)) * 0.06) if fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") \
        else random_blocks(fmt, out, inp, rng, 0.004 if fmt == "Q6_K" else 0.01)
    w = blocks.pack(fmt, raw, out, inp)
    kind, tensors = blocks.stack_part(w)
    return kind, tensors, torch.randn(out) * 0.1 if bias else None, 0


def _int_part(kind, out, inp, bias=False):
    w = torch.randn(out, inp) * 0.06
    b = torch.randn(out) * 0.1 if bias else torch.empty(0)
    if kind == 0:
        q, s = quant.quantize_int8(w)
        return 0, [quant.interleave_int8(q), s], b, 0
    return 1, list(quant.interleave_int4(*quant.quantize_int4(w, 64))), b, 64


def _layers(rng):
    qd, kvd = H * HD, HKV * HD
    first = [  # Qwen-like: q, k, v in three formats with biases; K-quants elsewhere
        [_block_part("Q4_K", qd, D, rng, True), _block_part("Q5_0", kvd, D, rng, True),
         _block_part("Q8_0", kvd, D, rng, True)],
        [_block_part("Q6_K", D, qd, rng)],
        [_block_part("Q4_K", M, D, rng), _block_part("Q5_K", M, D, rng)],
        [_block_part("Q6_K", D, M, rng)],
    ]
    second = [
        [_block_part("Q4_0", qd, D, rng), _int_part(0, kvd, D, True), _block_part("Q5_1", kvd, D, rng)],
        [_int_part(0, D, qd)],
        [_int_part(1, 2 * M, D)],
        [_block_part("Q4_1", D, M, rng)],
    ]
    return [(torch.rand(D) + 0.5, torch.rand(D) + 0.5, slots) for slots in (first, second)]


def _reference(kern, layers, x, kc, vc, start, cos, sin_signed, mask, hidden):
    """`Transformer.layer_forward`'s compiled steps, in its order, a part at a time."""
    def run(parts, h):
        return torch.cat([kern.linear_part(h, kind, t, b if b is not None and b.numel() else None, g)
                          for kind, t, b, g in parts], 1)

    qd, kvd, n = H * HD, HKV * HD, x.shape[0]
    out = [None]
    for i, (ln1, ln2, slots) in enumerate(layers):
        if i in hidden:
            out.append(x)
        qkv = run(slots[0], kern.rms_norm(x, ln1, EPS)).contiguous()
        kern.rope_(qkv, cos, sin_signed, qd + kvd)
        q, k, v = qkv.split([qd, kvd, kvd], 1)
        kc[i, :, start:start + n] = k.reshape(n, HKV, HD).transpose(0, 1)
        vc[i, :, start:start + n] = v.reshape(n, HKV, HD).transpose(0, 1)
        att = kern.attention(q.reshape(n, H, HD).transpose(0, 1), kc[i], vc[i], start + n, mask, HD ** -0.5)
        x = x + run(slots[1], att.transpose(0, 1).reshape(n, -1).contiguous())
        x = x + run(slots[3], kern.silu_mul(run(slots[2], kern.rms_norm(x, ln2, EPS))))
    out[0] = x
    return out


def test_the_stack_with_block_parts_equals_the_parts_layer_by_layer():
    """A layer's slots as lists of parts (q, k, v in three formats; gate and up in two; int8 and int4 beside
    block formats): the one-call `Stack` gives the bits of the steps run one by one, for a prefill, a
    decode step and a tree pass, with the K/V it writes."""
    kern = quant.kernels()
    torch.manual_seed(0)
    layers = _layers(np.random.default_rng(0))
    stack = kern.Stack([(*layer, [None] * 4, 0, 0) for layer in layers], H, HKV, HD, EPS, HD ** -0.5)
    caches = {name: (torch.zeros(2, HKV, 16, HD), torch.zeros(2, HKV, 16, HD)) for name in ("stack", "steps")}
    tree = torch.tensor([[1] * 6 + [1, 0, 0], [1] * 6 + [1, 1, 0], [1] * 6 + [1, 0, 1]], dtype=torch.bool)
    start = 0
    for n, mask in ((5, None), (1, None), (3, tree)):
        x = torch.randn(n, D)
        cos, sin = torch.randn(n, HD), torch.randn(n, HD)
        got = stack.forward(x, *caches["stack"], start, [cos], [sin], [mask], [0, 1])
        want = _reference(kern, layers, x, *caches["steps"], start, cos, sin, mask, (0, 1))
        assert len(got) == len(want) == 3
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b) and torch.isfinite(a).all()
        for a, b in zip(caches["stack"], caches["steps"], strict=True):
            assert torch.equal(a, b)
        start += n if mask is None else 0


def test_the_stack_refuses_slots_that_do_not_chain():
    kern = quant.kernels()
    layers = _layers(np.random.default_rng(1))
    ln1, ln2, slots = layers[0]
    with pytest.raises(RuntimeError, match="chain"):
        kern.Stack([(ln1, ln2, [slots[0][:2], *slots[1:]], [None] * 4, 0, 0)], H, HKV, HD, EPS, 1.0)  # qkv without v
    with pytest.raises(RuntimeError, match="4 slots"):
        kern.Stack([(ln1, ln2, slots[:3], [None] * 4, 0, 0)], H, HKV, HD, EPS, 1.0)
    with pytest.raises(RuntimeError, match="norm 2 must be"):
        kern.Stack([(ln1, ln2, slots, [None, None, torch.ones(3), None], 0, 0)], H, HKV, HD, EPS, 1.0)
