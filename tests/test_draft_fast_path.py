"""The inference path of the MoA drafter (`DecoderLayer.infer`, `CrossAttentionLayer.infer`, fused
`BlockKernels`, `ContextEncoder.encode`) against the reference math (the modules' `forward`, as trained).

In fp32 weights the two agree to float round-off (tests/test_moa.py checks whole drafting rounds against
`forward_train` there). In fp16 weights the inference path multiplies in fp16 (fbgemm) where the
reference multiplies in fp32; here the shipped SmolLM2 checkpoint drafts a few hundred steps in greedy
speculative decoding and every step's log-probs are checked against `forward_train` on the same tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOL, assert_same_or_near_tie, chat_ids
from prompts import PROMPTS

import moaspec.drafters.moa as moa
import moaspec.drafters.trained as trained
from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import TreeConfig
from moaspec.drafters import SPECS, shipped_checkpoint
from moaspec.drafters.layers import CrossAttentionLayer, DecoderLayer, KVCache, rope
from moaspec.models.runtime import Transformer, signed_sin
from moaspec.models.store import weights_fingerprint

FP16_LOGPROB_TOL = 0.05  # |log q| difference per token, fp16 against fp32 weights (seen: < 0.02)
NEAR_TIE = 0.05  # a top-2 log-prob margin below this may flip the argmax under fp16 rounding
# An int8 head (activations quantised per block of 32 too) moves a draft probability by up to ~0.05 (seen on
# 535 steps) and the argmax where the top two lie within ~0.17 in log-prob (4% of the steps).
INT8_PROB_TOL = 0.1
INT8_NEAR_TIE = 0.25


def _random(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        p.data.normal_(0, 0.05 if p.dim() > 1 else 1.0)  # norm weights ~1 +- noise: not all-ones
    return module.eval()


@pytest.mark.parametrize("heads,kv_heads,input_norm", [(8, 2, True), (4, 4, True), (8, 2, False)])
def test_block_infer_matches_forward(heads, kv_heads, input_norm):
    """SA with a cache, a pending mask and a tree mask (also without an input norm, as EAGLE's layer); CA
    and its context K/V; fp32 weights."""
    torch.manual_seed(0)
    D, hd, S = 128, 16, 64
    sa = _random(DecoderLayer(D, heads, kv_heads, hd, 96, 1e-6), 1)
    if not input_norm:
        sa.input_norm = torch.nn.Identity()
    ca = _random(CrossAttentionLayer(D, heads, kv_heads, hd, 96, 1e-6), 2)
    cos, sin = rope(10000.0, hd, S)
    sin_s = signed_sin(sin)
    ref_cache, fast_cache = (KVCache(kv_heads, S, hd, torch.device("cpu"), torch.float32) for _ in range(2))
    with torch.no_grad():
        # 10 pending rows at slots 0..9 (causal), then 3 tree rows at slots 10..12 that see slots 0..7 and a
        # subset of each other, then 1 chain row without a mask
        mask = torch.ones(10, 10, dtype=torch.bool).tril()
        tree = torch.zeros(3, 13, dtype=torch.bool)
        tree[:, :8] = True
        tree[0, 10] = tree[1, 11] = tree[2, 12] = tree[2, 10] = True
        for x, start, m, pos in ((torch.randn(1, 10, D), 0, mask, slice(0, 10)),
                                 (torch.randn(1, 3, D), 10, tree, slice(8, 9)),
                                 (torch.randn(1, 1, D), 13, None, slice(9, 10))):
            p = torch.arange(S)[pos].expand(x.shape[1])
            ref = sa(x, cos[p], sin[p], m, ref_cache, start)
            fast = sa.infer(x, cos[pos], sin_s[pos], m, fast_cache, start)
            assert (ref - fast).abs().max() < 1e-5
            end = start + x.shape[1]
            assert (ref_cache.k[:, :, :end] - fast_cache.k[:, :, :end]).abs().max() < 1e-5
        c = torch.randn(1, 20, D)
        k, v = ca.context_kv(c, cos[:20], sin[:20])
        k2, v2 = ca.context_kv_infer(c, cos[:20], sin_s[:20])
        assert (k - k2).abs().max() < 1e-5 and (v - v2).abs().max() < 1e-5
        x = torch.randn(1, 4, D)
        ref = ca(x, cos[20:21].expand(4, hd), sin[20:21].expand(4, hd), k, v)
        assert (ref - ca.infer(x, cos[20:21], sin_s[20:21], k2, v2)).abs().max() < 1e-5


def test_block_kernels_follow_weight_updates_and_mode():
    layer = _random(DecoderLayer(64, 4, 2, 16, 48, 1e-6), 3)
    cos, sin = rope(10000.0, 16, 4)
    x = torch.randn(2, 4, 64)
    with torch.no_grad():
        before = layer.infer(x, cos, signed_sin(sin))
        layer.mlp.up.weight.add_(0.1)
        after = layer.infer(x, cos, signed_sin(sin))
        assert (after - layer(x, cos, sin)).abs().max() < 1e-5 and (after - before).abs().max() > 1e-3
        for m in layer.modules():
            if hasattr(m, "mode"):
                m.mode = "fp16"
        assert (layer.infer(x, cos, signed_sin(sin)) - after).abs().max() < 1e-2
    assert layer.kernels().qkv.packed is not None  # fbgemm fp16


@pytest.mark.needs_kernels
def test_fused_fp16_blocks_match_the_op_by_op_path():
    """fp16 blocks run norm + projection + RoPE and the residual tail as two compiled calls each; on the
    same fp16 weights they compute what the op-by-op path computes (up to float summation order): SA with
    a cache and a pending mask, the LSA's shape (many tokens, one position table over the layers), CA and
    its context K/V."""
    torch.manual_seed(0)
    D, hd, S, heads, kv_heads = 128, 16, 32, 8, 2
    sa = _random(DecoderLayer(D, heads, kv_heads, hd, 96, 1e-6), 1)
    ca = _random(CrossAttentionLayer(D, heads, kv_heads, hd, 96, 1e-6), 2)
    bare = _random(DecoderLayer(D, heads, kv_heads, hd, 96, 1e-6), 3)  # EAGLE's layer: no input norm
    bare.input_norm = torch.nn.Identity()
    for m in [*sa.modules(), *ca.modules(), *bare.modules()]:
        if hasattr(m, "mode"):
            m.mode = "fp16"
    cos, sin = rope(10000.0, hd, S)
    sin_s = signed_sin(sin)
    caches = [KVCache(kv_heads, S, hd, torch.device("cpu"), torch.float32) for _ in range(2)]

    def both(block, fn):
        kern = block.kernels()
        assert kern.fused is not None  # fp16 with the compiled kernels: the fused path runs
        fused = fn(kern, caches[0])
        kern.fused, saved = None, kern.fused
        try:
            ref = fn(kern, caches[1])
        finally:
            kern.fused = saved
        return fused, ref

    with torch.no_grad():
        mask = torch.ones(5, 8, dtype=torch.bool).tril(3)  # 5 pending rows at slots 3..7 over slots 0..7
        x, tokens = torch.randn(1, 5, D), torch.randn(6, 12, D)
        for got, ref in (both(sa, lambda k, c: sa.infer(x, cos[3:8], sin_s[3:8], mask, c, 3, k)),
                         both(sa, lambda k, c: sa.infer(x[:, :1], cos[8:9], sin_s[8:9], None, c, 8, k)),
                         both(sa, lambda k, c: sa.infer(tokens, cos[:12], sin_s[:12], kern=k)),
                         both(bare, lambda k, c: bare.infer(tokens[:1, :4], cos[:4], sin_s[:4], kern=k)),
                         both(ca, lambda k, c: torch.cat(ca.context_kv_infer(x, cos[:5], sin_s[:5], k), -1)),
                         both(ca, lambda k, c: ca.infer(x[:, :3], cos[9:10], sin_s[9:10], caches[0].k[:, :, :9],
                                                        caches[0].v[:, :, :9], k))):
            assert got.shape == ref.shape and (got - ref).abs().max() < 1e-4 * ref.abs().max()
        assert (caches[0].k[:, :, :9] - caches[1].k[:, :, :9]).abs().max() < 1e-4


@pytest.mark.parametrize("weights", ["fp32", "fp16"])
def test_encoder_encode_matches_forward(smol_folder, weights):
    """The target-side encoder over 1..4 verified tokens and over a prompt longer than its chunk."""
    target = Transformer(smol_folder, weights=weights, max_seq_len=128)
    d = SPECS["moa"].load(shipped_checkpoint("moa", SMOL), target, SMOL, weights_fingerprint(smol_folder))
    enc = d.encoder
    n = enc.CHUNK + 9
    target.prefill(list(range(1000, 1000 + n)))
    K, V = target.kv(slice(0, n))
    with torch.no_grad():
        ref = enc(K.permute(2, 0, 1, 3), V.permute(2, 0, 1, 3))
    tol = 1e-4 if weights == "fp32" else 1e-2
    for first, count in ((0, n), (n - 1, 1), (n - 4, 4), (5, 3)):
        got = enc.encode(target, torch.arange(first, first + count), {}).vectors
        assert got.shape == (count, target.cfg.hidden_size)
        assert (got - ref[first:first + count]).abs().max() < tol * ref.abs().max()
    gathered = enc.encode(target, torch.tensor([3, 7, 1]), {}).vectors  # not a range: gathered slots
    assert (gathered - ref[[3, 7, 1]]).abs().max() < tol * ref.abs().max()


@pytest.mark.parametrize("head", ["fp16", pytest.param("int8", marks=pytest.mark.needs_kernels)])
def test_fp16_drafts_match_reference_math_on_shipped_checkpoint(smol_folder, smol_tokenizer, monkeypatch, head):
    """Greedy speculative decoding with the shipped SmolLM2 MoA checkpoint, fp16 weights, 4-token chains:
    the output is plain greedy's, and at every draft step (root and drafted nodes, a few hundred) the
    drafter's log-probs are those of `forward_train` (fp32 reference math on the same verified context)
    within the rounding of the weights, with the same argmax unless the reference's top two are a
    near-tie. The layers run fp16 kernels; the LM head runs int8 by default (`trained.head_mode`), or
    fp16."""
    if head == "fp16":
        monkeypatch.setattr(trained, "head_mode", lambda weights: weights)
    else:
        assert trained.head_mode("fp16") == "int8"
    near_tie, max_ties = {"fp16": (NEAR_TIE, 0.01), "int8": (INT8_NEAR_TIE, 0.07)}[head]
    target = Transformer(smol_folder, weights="fp16", max_seq_len=512)
    d = SPECS["moa"].load(shipped_checkpoint("moa", SMOL), target, SMOL, weights_fingerprint(smol_folder))
    rounds = []  # (verified tokens P, [root, drafted...], [log-probs of root, node 1, ...])
    real = moa.grow_tree

    def spy(root, root_lp, expand, cfg, vocab=None):
        lps = [root_lp.clone()]

        def recording(tree, frontier):
            lp = expand(tree, frontier)
            lps.append(lp[0].clone())
            return lp

        tree = real(root, root_lp, recording, cfg, vocab)
        rounds.append((len(d.tokens), list(tree.tokens), lps))
        return tree

    monkeypatch.setattr(moa, "grow_tree", spy)
    spec = Engine(LocalTarget(target, d.encoder), d, TreeConfig(depth=4, topk=1, total_tokens=4))
    plain = Engine(LocalTarget(target), None)
    cfg = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    index = {int(t): i for i, t in enumerate(d.vocab_ids.tolist())}
    steps = ties = 0
    worst = worst_p = 0.0
    for text in PROMPTS[:4]:
        ids = chat_ids(smol_tokenizer, text)
        rounds.clear()
        out = [t for c in spec.stream(ids, cfg) for t in c.tokens]
        K, V = target.kv(slice(0, target.length))  # every verified slot, as the drafter saw it
        with torch.no_grad():
            ctx = d.encoder(K.permute(2, 0, 1, 3)[None], V.permute(2, 0, 1, 3)[None])
        assert_same_or_near_tie(target, ids, [t for c in plain.stream(ids, cfg) for t in c.tokens], out, text)
        for P, chain, lps in rounds:
            seq = [*ids, *out][:P] + chain[:len(lps)]  # verified tokens, the root, the drafted nodes
            assert seq[P] == chain[0]
            T = len(seq)
            start = moa.verification_starts(T, prompt_len=P, every=10**6)
            with torch.no_grad():
                c = torch.cat([ctx[:, :P], ctx.new_zeros(1, T - P, ctx.shape[-1])], 1)  # rows >= P unread
                final = d.forward_train(torch.tensor([seq]), c, start, compute_logits=False).final[0, P:]
                ref = torch.log_softmax(F.linear(final, d.head), -1)
            for r, lp in enumerate(lps):
                worst = max(worst, float((lp - ref[r]).abs().max()))
                worst_p = max(worst_p, float((lp.exp() - ref[r].exp()).abs().max()))
                top = ref[r].topk(2)
                if int(lp.argmax()) != int(top.indices[0]):
                    assert float(top.values[0] - top.values[1]) < near_tie, (P, r)
                    ties += 1
                if r + 1 < len(chain):  # the chain follows the drafter's argmax
                    assert index[chain[r + 1]] == int(lp.argmax())
                steps += 1
    assert steps >= 200, steps
    if head == "fp16":
        assert worst < FP16_LOGPROB_TOL, worst
    assert worst_p < INT8_PROB_TOL, worst_p
    assert ties <= max_ties * steps, (ties, steps)


def test_draftcost_bench_runs(tmp_path, capsys):
    """`python -m experiments.draftcost` on a short context: every number is there and positive."""
    import json

    from experiments import draftcost

    out = tmp_path / "cost.json"
    draftcost.main(["--model", SMOL, "--weights", "fp16", "--drafters", "moa,eagle,independent", "--context", "40",
                    "--rounds", "3", "--prefill-rounds", "1", "--out", str(out)])
    table = capsys.readouterr().out
    assert "| moa |" in table and "| independent |" in table and "LM head" in table
    r = json.loads(out.read_text())
    assert r["target"]["step_ms"] > 0 and set(r["drafters"]) == {"moa", "eagle", "independent"}
    moa_r = r["drafters"]["moa"]
    assert moa_r["first_1_ms"] > 0 and moa_r["encode_prefill_ms"] > 0 and 0 < moa_r["weight_mb_per_step"]
    parts = moa_r["breakdown"]["step"]
    assert parts["SA"] > 0 and parts["CA"] > 0 and parts["LM head"] > 0
    assert "encode_1_ms" not in r["drafters"]["independent"]  # it has no target-side encoder
