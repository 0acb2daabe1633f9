"""int8 / int4 weights: the compiled kernels against their own dequantised weights, the real model's
logits against fp32 within stated bounds, speculative = plain in each mode, and the fallbacks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from prompts import PROMPTS

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.tree import TreeConfig
from moaspec.errors import UserError
from moaspec.models import linear, quant
from moaspec.models.linear import Linear
from moaspec.models.runtime import Transformer
from moaspec.pipeline import SpecDecoder

pytestmark = pytest.mark.needs_kernels

KERNEL_CHECK = """
import torch
from moaspec.models import quant
k = quant.kernels()
torch.manual_seed(0)
worst = 0.0


def blocks(x):  # the activations as the kernels see them: int8 per block of 32 values, one scale each
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(x.shape)


# every tile size (1..8 rows), tiles after the first, a second block of 64 rows; 448 = 14 blocks of 32
for rows in (1, 2, 3, 4, 5, 6, 7, 8, 17, 40, 130):
    w, x, b = torch.randn(80, 448), torch.randn(rows, 448), torch.randn(80)
    x[0, 5] = 60.0  # an outlier coarsens only its own block of 32
    q, s = quant.quantize_int8(w)
    ref = blocks(x) @ quant.dequantize_int8(q, s).T + b
    worst = max(worst, ((k.linear_q8(x, quant.interleave_int8(q), s, b) - ref).abs().max() / ref.abs().max()).item())
    for g in quant.INT4_GROUPS:
        if 448 % g == 0:
            p, sc, off = quant.quantize_int4(w, g)
            ref = blocks(x) @ quant.dequantize_int4(p, sc, off).T
            y = k.linear_q4(x, *quant.interleave_int4(p, sc, off), g)
            worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
    # fp16 weights, fp32 sums: only the summation order differs from the reference
    w16 = torch.randn(73, 456).half()  # 456 = 14 blocks of 32 + 8; 73 channels leave a tile's tail
    xs = torch.randn(rows, 456)
    b16 = torch.randn(73)
    ref = xs @ w16.float().T + b16
    worst = max(worst, ((k.linear_f16(xs, w16, b16) - ref).abs().max() / ref.abs().max()).item())
# attention against SDPA: every head size the kernel has a path for, with and without a mask
for d in (64, 128, 80):
    for n in (1, 3, 8):
        T = 37 + n
        q, kk, vv = torch.randn(6, n, d), torch.randn(2, 50, d), torch.randn(2, 50, d)
        mask = torch.rand(n, T) < 0.7
        mask[:, 0] = True
        causal = torch.ones(n, T, dtype=torch.bool).tril(T - n)
        for m in (None, mask):
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[None], kk[None, :, :T], vv[None, :, :T], attn_mask=causal if m is None else m, scale=d ** -0.5,
                enable_gqa=True)[0]
            worst = max(worst, (k.attention(q, kk, vv, T, m, d ** -0.5) - ref).abs().max().item())
print(worst)
"""


@pytest.mark.parametrize("arch", ["native", "avx2"])
def test_kernels_match_their_dequantised_weights(arch):
    """Each kernel (this CPU's best, and the plain-AVX2 build that CPUs without VNNI run) equals x @ W.T
    of its own dequantised weights and of the activations' 8-bit blocks up to float rounding (relative
    error < 1e-4, where quantising the activations alone costs ~2%)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if arch == "avx2":
        env["MOASPEC_QGEMM_ARCH"] = "avx2"
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 1e-4


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Verification scores k rows in one call where plain decoding scores one: each kernel must give a
    row the same bits whatever the row count (every tile size, and tiles after the first), or greedy
    speculative decoding could differ from plain. The causal attention of row i reads the same slots
    (0 .. 21 + i) whatever the row count."""
    k = quant.kernels()
    torch.manual_seed(2)
    w, x, b = torch.randn(48, 256), torch.randn(19, 256), torch.randn(48)
    q, s = quant.quantize_int8(w)
    q = quant.interleave_int8(q)
    p4 = quant.interleave_int4(*quant.quantize_int4(w, 32))
    w16 = w.half()
    for name, f in (("int8", lambda x: k.linear_q8(x, q, s, b)), ("int4", lambda x: k.linear_q4(x, *p4, 32)),
                    ("fp16", lambda x: k.linear_f16(x, w16, b)),
                    ("fp16, 3 channels", lambda x: k.linear_f16(x, w16[:3]))):
        single = torch.cat([f(x[i:i + 1].contiguous()) for i in range(len(x))])
        for rows in range(2, len(x) + 1):
            assert torch.equal(f(x[:rows].contiguous()), single[:rows]), (name, rows)
    keys, values = w[None, :, :64].contiguous(), w[None, :, 64:128].contiguous()  # 40 slots

    def attend(rows: torch.Tensor, seen: int) -> torch.Tensor:  # rows after `seen` slots, causal
        return k.attention(rows[None, :, :64].contiguous(), keys, values, seen + rows.shape[0], None, 0.125)[0]

    for rows in range(1, 9):
        alone = torch.cat([attend(x[i:i + 1], 21 + i) for i in range(rows)])
        assert torch.equal(attend(x[:rows], 21), alone), ("attention", rows)
    # a tree row sees its ancestors at scattered slots; committed, they sit side by side: same bits
    q1 = x[:1, None, :64].transpose(0, 1).contiguous()
    gathered = [*range(21), 23, 26, 31]
    tree = torch.zeros(1, 40, dtype=torch.bool)
    tree[0, gathered] = True
    side_by_side = k.attention(q1, keys[:, gathered].contiguous(), values[:, gathered].contiguous(), 24, None, 0.125)
    assert torch.equal(k.attention(q1, keys, values, 40, tree, 0.125), side_by_side)


def test_fp16_layers_take_the_kernel_this_machine_measured(monkeypatch, tmp_path, smol_folder):
    """The few-row kernel or fbgemm for a model's fp16 layers of 1-8 rows: measured once, saved with its
    numbers, overridable; whichever is taken, a 4-row pass scores each row exactly as 1-row steps do.
    A context of 128 tokens leaves the measurement less room than its usual 128 cached + 4 rows."""
    monkeypatch.setenv("MOASPEC_HOME", str(tmp_path))
    monkeypatch.delenv("MOASPEC_F16_KERNEL", raising=False)
    model = Transformer(smol_folder, weights="fp16", max_seq_len=128)
    (entry,) = json.loads((tmp_path / "kernel_choice.json").read_text()).values()
    lins = model.linears()
    assert {lin.few_rows for lin in lins} == {entry["few_rows"]}
    if entry["fbgemm_rows_independent"]:
        assert entry["few_rows"] == (sum(entry["few_row_ms"].values()) <= sum(entry["fbgemm_ms"].values()))
        assert entry["few_rows"] or all(lin.w16 is None for lin in lins)  # fbgemm alone: one weight copy
    else:
        assert entry["few_rows"]
    tokens = torch.tensor([9, 521, 33, 1004, 77, 2048])
    model.forward(tokens[:2])
    model.advance(2)
    chain = model.forward(tokens[2:]).logits
    steps = []
    for t in tokens[2:]:
        steps.append(model.forward(t[None]).logits[0])
        model.advance(1)
    assert torch.equal(chain, torch.stack(steps))
    for forced, few in (("few", True), ("fbgemm", False)):
        monkeypatch.setenv("MOASPEC_F16_KERNEL", forced)
        model.few_row_kernels()
        assert {lin.few_rows for lin in lins} == {few}
    monkeypatch.setenv("MOASPEC_F16_KERNEL", "fast")
    with pytest.raises(UserError, match="MOASPEC_F16_KERNEL"):
        model.few_row_kernels()


def test_quantisers_round_trip():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    q, s = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert (quant.dequantize_int8(q, s) - w).abs().max() <= s.max() / 2 + 1e-6
    p, sc, off = quant.quantize_int4(w, 32)
    assert p.shape == (64, 128) and sc.shape == off.shape == (64, 8)
    err = (quant.dequantize_int4(p, sc, off) - w).pow(2).mean() / w.pow(2).mean()
    assert err < 0.01  # 16 levels over a group of 32 Gaussian values
    # weights already on a 4-bit grid per group of 32 (what a Q4_1 GGUF de-quantises to) come back exactly
    grid = quant.dequantize_int4(p, sc, off)
    assert torch.allclose(quant.dequantize_int4(*quant.quantize_int4(grid, 32)), grid, atol=1e-3)


def test_bad_shapes_are_refused_or_widened():
    with pytest.raises(quant.UserError, match="group"):
        quant.quantize_int4(torch.randn(8, 96), 64)
    c = quant.channels()
    assert Linear(torch.randn(c, 96), None, "int4-g64").mode == "int4"  # 64 does not divide 96; 32 does
    assert Linear(torch.randn(c, 40), None, "int8").mode == "fp16"  # not a multiple of 32
    assert Linear(torch.randn(c + 4, 64), None, "int8").mode == "fp16"  # not whole groups of channels
    k = quant.kernels()
    q, s = quant.quantize_int8(torch.randn(c, 64))
    with pytest.raises(RuntimeError, match="columns"):
        k.linear_q8(torch.randn(2, 32), quant.interleave_int8(q), s)
    with pytest.raises(RuntimeError, match="float32"):
        k.linear_q8(torch.randn(2, 64).double(), quant.interleave_int8(q), s)
    with pytest.raises(RuntimeError, match="interleave_int8"):
        k.linear_q8(torch.randn(2, 64), q, s)


def test_fallback_to_fp16_when_the_kernels_cannot_be_built(monkeypatch, caplog):
    def broken():
        raise quant.UserError("no compiler here")

    monkeypatch.setattr(quant, "kernels", broken)
    monkeypatch.setattr(linear, "_warned", set())
    with caplog.at_level(logging.WARNING):
        lin = Linear(torch.randn(16, 64), None, "int4")
    assert lin.mode == "fp16" and lin.packed is not None
    assert "no compiler here" in caplog.text


@pytest.mark.slow  # builds the kernels again from source: ~70 s
def test_a_damaged_build_is_rebuilt(tmp_path):
    """A corrupt compiled kernel in the cache is thrown away and built again, not loaded or fatal."""
    env = {**os.environ, "MOASPEC_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    code = "from moaspec.models import quant; quant.kernels(); print('ok')"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=600).returncode == 0
    (so,) = list((tmp_path / "ext").glob("*/*.so"))
    so.write_bytes(b"not a shared object")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert "rebuilding" in out.stderr
    assert [f.read_bytes()[:4] for f in (tmp_path / "ext").glob("*/*.so")] == [b"\x7fELF"]


# Stated bounds (KL to fp32, top-1 agreement) on SmolLM2 over 300 tokens of text. Measured on 600 tokens of
# docs/results.md: int8 KL 0.010, top-1 0.92; int4 0.006, 0.93 (the Q4_1 GGUF tensors come back exactly on
# int4's grid of 32); int4-g64 0.098, 0.78.
BOUNDS = {"int8": (0.03, 0.85), "int4": (0.03, 0.85), "int4-g64": (0.3, 0.6), "gguf": (0.03, 0.85)}


@pytest.fixture(scope="module")
def fp32_logits(smol_folder):
    from moaspec.models.store import load_tokenizer

    ids = load_tokenizer(smol_folder).encode("\n\n".join(PROMPTS))[:300]
    ref = Transformer(smol_folder, "fp32")
    return ids, ref.forward(torch.tensor(ids)).logits


@pytest.mark.parametrize("mode", list(BOUNDS))
def test_logits_stay_within_the_stated_bound(smol_folder, fp32_logits, mode):
    ids, ref = fp32_logits
    m = Transformer(smol_folder, mode)
    got = m.forward(torch.tensor(ids)).logits
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    max_kl, min_top1 = BOUNDS[mode]
    assert kl < max_kl and top1 > min_top1, (mode, kl, top1)


@pytest.mark.parametrize("mode", ["int8", "int4", "gguf"])
def test_greedy_speculative_equals_greedy_plain_in_each_mode(mode):
    """Lossless with respect to the quantised target: the same tokens as plain decoding in that mode."""
    cfg = GenerationConfig(max_new_tokens=40)
    dec = SpecDecoder("smollm2-135m", drafter="none", weights=mode, warmup=False)
    for prompt in PROMPTS[:3]:
        dec.set_drafter("none")
        plain = dec.generate(prompt, cfg).token_ids
        for drafter in ("lookup", "moa", "eagle"):
            dec.set_drafter(drafter, tree=TreeConfig(4, 2, 6))
            assert dec.generate(prompt, cfg).token_ids == plain, (mode, drafter, prompt)


@pytest.mark.parametrize("mode", ["int8", "int4", "gguf"])
def test_the_one_call_stack_equals_the_layer_by_layer_path(smol_folder, mode):
    """The compiled `Stack` (every decoder layer of a one-sequence pass in one call) gives the bits of the
    layer-by-layer path: logits, returned hidden states and the K/V written, for a prefill chunk, a decode
    step and a tree pass with scattered positions."""
    m = Transformer(smol_folder, mode, max_seq_len=256)
    assert m.stack is not None
    toks = torch.randint(100, 5000, (40,), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    runs = {}
    stack = m.stack
    for name, s in (("stack", stack), ("layers", None)):
        m.stack = s
        m.reset()
        a = m.forward(toks[:30], hidden_layers=(0, 3, m.cfg.num_layers))
        m.advance(30)
        b = m.forward(toks[30:31])
        m.advance(1)
        c = m.forward(toks[31:35], tree_mask=mask, positions=torch.tensor([31, 32, 32, 33]))
        runs[name] = [a.logits, *a.hidden.values(), b.logits, c.logits, m.cache.k[:, :, :35].clone(),
                      m.cache.v[:, :, :35].clone()]
    m.stack = stack
    for x, y in zip(runs["stack"], runs["layers"], strict=True):
        assert torch.equal(x, y)


def test_auto_weights_take_the_fastest_mode_at_the_models_own_quality(smol_folder, tmp_path):
    """A GGUF model runs in its file's own formats (`gguf`); a folder of float weights runs int4 where they lie
    on int4's grid, else int8; `gguf` on float weights and a bad mode are refused with the choices."""
    from safetensors.torch import save_file

    from moaspec.models.runtime import resolve_weights

    assert resolve_weights("auto", smol_folder) == "gguf"
    on_grid = quant.dequantize_int4(*quant.quantize_int4(torch.randn(64, 128)))
    save_file({"model.layers.0.mlp.gate_proj.weight": on_grid}, str(tmp_path / "model.safetensors"))
    assert resolve_weights("auto", tmp_path) == "int4"
    with pytest.raises(UserError, match="gguf"):
        resolve_weights("gguf", tmp_path)
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.randn(64, 128)}, str(tmp_path / "model.safetensors"))
    assert resolve_weights("auto", tmp_path) == "int8"
    assert resolve_weights("fp32", tmp_path) == "fp32"
    assert resolve_weights("auto", tmp_path, "meta") == "fp16"  # no CPU kernels on an accelerator
    with pytest.raises(UserError, match="auto, fp32"):
        resolve_weights("int3", tmp_path)
