"""Our runtime (moaspec.models.runtime.Transformer) against transformers' own implementation.

transformers is the oracle: same weights, same config, fp32. Tree scoring and cache commits are
checked against the plain sequential computation of the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_or_near_tie, chat_ids
from prompts import PROMPTS

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.tree import Tree
from moaspec.errors import ContextLengthError
from moaspec.models.runtime import Transformer

TOL = 1e-4
PROMPT = "Explain what a hash table is to a beginner programmer."
DECODE_STEPS = 8


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def _hf_reference(hf, ids: list[int], steps: int):
    """transformers: logits for every prompt row, then `steps` greedy 1-token decode steps with its cache.
    Returns (prompt logits [n, V], decode tokens, decode logits [steps, V], cache after the prompt)."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        prompt_logits = out.logits[0].clone()
        prompt_keys = [layer.keys[0].clone() for layer in out.cache.layers]
        prompt_values = [layer.values[0].clone() for layer in out.cache.layers]
        cache, tok = out.cache, int(prompt_logits[-1].argmax())
        toks, rows = [], []
        for _ in range(steps):
            o = hf(torch.tensor([[tok]]), cache=cache, use_cache=True)
            cache = o.cache
            toks.append(tok)
            rows.append(o.logits[0, -1].clone())
            tok = int(rows[-1].argmax())
    return prompt_logits, toks, torch.stack(rows), (prompt_keys, prompt_values)


def _check_against_hf(model: Transformer, hf, ids: list[int], steps: int = DECODE_STEPS):
    ref_prompt, toks, ref_steps, ref_kv = _hf_reference(hf, ids, steps)
    model.reset()
    ours = model.forward(torch.tensor(ids), logits_rows=None).logits
    model.advance(len(ids))
    d = _max_diff(ours, ref_prompt)
    assert d < TOL, f"prefill logits differ from transformers by {d:.3e}"
    for i, tok in enumerate(toks):
        row = model.forward(torch.tensor([tok])).logits
        model.advance(1)
        d = _max_diff(row[0], ref_steps[i])
        assert d < TOL, f"decode step {i} logits differ from transformers by {d:.3e}"
    return ref_kv


# --------------------------------------------------------------------------- (a) + (b) + (e)
def test_prefill_and_decode_match_transformers(smol_model, hf_smol, smol_tokenizer):
    ids = chat_ids(smol_tokenizer, PROMPT)
    ref_keys, ref_values = _check_against_hf(smol_model, hf_smol, ids)
    # (e) the cache holds exactly transformers' K (after RoPE) and V for the prompt slots
    cfg = smol_model.cfg
    k, v = smol_model.kv(slice(0, len(ids)))
    assert k.shape == v.shape == (cfg.num_layers, cfg.num_kv_heads, len(ids), cfg.head_dim)
    for layer in (0, cfg.num_layers // 2, cfg.num_layers - 1):
        assert _max_diff(k[layer], ref_keys[layer]) < 1e-5, f"layer {layer} K"
        assert _max_diff(v[layer], ref_values[layer]) < 1e-5, f"layer {layer} V"
    # kv() with an index tensor: the same slots, gathered
    slots = torch.tensor([0, 3, len(ids) - 1])
    k2, v2 = smol_model.kv(slots)
    assert k2.shape == (cfg.num_layers, cfg.num_kv_heads, 3, cfg.head_dim)
    assert torch.equal(k2, k[:, :, slots]) and torch.equal(v2, v[:, :, slots])


def test_prefill_chunks_equal_single_pass(smol_model, smol_tokenizer):
    """prefill() in small chunks (attending to earlier chunks through the cache) == one forward."""
    ids = chat_ids(smol_tokenizer, PROMPTS[20])  # the longest prompt (a paragraph to summarise)
    smol_model.reset()
    whole = smol_model.forward(torch.tensor(ids), logits_rows=slice(-1, None)).logits[-1]
    chunked = smol_model.prefill(ids, chunk=16).logits[-1]
    assert smol_model.length == len(ids)
    assert _max_diff(whole, chunked) < TOL


# --------------------------------------------------------------------------- (c) + (d)
def _real_tree(model: Transformer, prefix: list[int], root: int) -> Tree:
    """root -> its top-3 target tokens; the best child -> its top-2; the best grandchild -> its top-1."""
    model.reset()
    model.prefill(prefix)
    L = model.length
    children = model.forward(torch.tensor([root])).logits[0].topk(3).indices.tolist()
    grand = model.forward(torch.tensor([root, children[0]])).logits[-1].topk(2).indices.tolist()
    great = int(model.forward(torch.tensor([root, children[0], grand[0]])).logits[-1].argmax())
    assert model.length == L  # forward alone commits nothing
    #        0      1..3       4, 5      6
    return Tree([root, *children, *grand, great], [-1, 0, 0, 0, 1, 1, 4])


def _sequential(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Plain decoding of `tokens` one at a time after the committed prefix; rolled back afterwards."""
    L = model.length
    for t in tokens:
        logits = model.forward(torch.tensor([t])).logits[0]
        model.advance(1)
    model.truncate(L)
    return logits


@pytest.fixture(scope="module")
def tree_setup(smol_model, smol_tokenizer):
    ids = chat_ids(smol_tokenizer, "Write a haiku about autumn leaves.")
    prefix, root = ids[:-1], ids[-1]
    return prefix, _real_tree(smol_model, prefix, root)


def test_tree_pass_equals_sequential_paths(smol_model, tree_setup):
    prefix, tree = tree_setup
    smol_model.reset()
    smol_model.prefill(prefix)
    L = smol_model.length
    out = smol_model.forward(torch.tensor(tree.tokens), positions=tree.positions(L), tree_mask=tree.mask())
    assert out.logits.shape == (len(tree), smol_model.cfg.vocab_size)
    assert smol_model.length == L
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        ref = _sequential(smol_model, path)
        d = _max_diff(out.logits[node], ref)
        assert d < TOL, f"tree node {node} (path {path}) differs from sequential decoding by {d:.3e}"
    # the rows are genuinely different contexts (a broken mask that let siblings see each other would
    # still differ, but a mask ignoring the tree entirely would make siblings' rows collapse)
    assert _max_diff(out.logits[1], out.logits[2]) > 1.0
    assert _max_diff(out.logits[4], out.logits[5]) > 1.0


@pytest.mark.parametrize("path", [[0, 1, 4, 6], [0, 3], [0, 1, 5], [0, 1], [0]], ids=str)
def test_commit_compacts_cache(smol_model, tree_setup, path):
    prefix, tree = tree_setup
    smol_model.reset()
    smol_model.prefill(prefix)
    L = smol_model.length
    out = smol_model.forward(torch.tensor(tree.tokens), positions=tree.positions(L), tree_mask=tree.mask())
    smol_model.commit(path)
    assert smol_model.length == L + len(path)
    nxt = int(out.logits[path[-1]].argmax())
    after_commit = smol_model.forward(torch.tensor([nxt])).logits[0]
    committed_k, committed_v = (t.clone() for t in smol_model.kv(slice(L, L + len(path))))

    accepted = [tree.tokens[i] for i in path]
    smol_model.reset()
    fresh = smol_model.prefill(prefix + accepted + [nxt]).logits[-1]
    d = _max_diff(after_commit, fresh)
    assert d < TOL, f"decode after commit({path}) differs from a fresh prefill by {d:.3e}"
    fresh_k, fresh_v = smol_model.kv(slice(L, L + len(path)))
    assert _max_diff(committed_k, fresh_k) < TOL and _max_diff(committed_v, fresh_v) < TOL


def test_truncate_bounds(smol_model):
    from moaspec.errors import UserError

    smol_model.reset()
    smol_model.prefill([1, 2, 3])
    with pytest.raises(UserError):
        smol_model.truncate(4)
    with pytest.raises(UserError):
        smol_model.truncate(-1)
    smol_model.truncate(1)
    assert smol_model.length == 1


# --------------------------------------------------------------------------- (f) fp16
@pytest.fixture(scope="module")
def fp16_decoders():
    from moaspec.pipeline import SpecDecoder

    return {d: SpecDecoder("smollm2-135m", drafter=d, weights="fp16") for d in ("none", "lookup")}


def test_fp16_logits_close_to_fp32(fp16_decoders, smol_model, smol_tokenizer):
    ids = chat_ids(smol_tokenizer, PROMPT)
    m16 = fp16_decoders["none"].target
    assert m16.weights == "fp16"
    m16.reset()
    smol_model.reset()
    a = m16.forward(torch.tensor(ids), logits_rows=None).logits
    b = smol_model.forward(torch.tensor(ids), logits_rows=None).logits
    d = _max_diff(a, b)
    assert 0 < d < 0.1, f"fp16 logits differ from fp32 by {d:.3e}"  # > 0: fp16 mode really is in use


@pytest.mark.parametrize("index", [0, 6, 13, 20])
def test_fp16_speculative_equals_plain(fp16_decoders, index):
    plain_dec, spec_dec = fp16_decoders["none"], fp16_decoders["lookup"]
    cfg = GenerationConfig(max_new_tokens=48)
    plain = plain_dec.generate(PROMPTS[index], cfg)
    spec = spec_dec.generate(PROMPTS[index], cfg)
    assert spec.prompt_ids == plain.prompt_ids
    assert_same_or_near_tie(plain_dec.target, plain.prompt_ids, plain.token_ids, spec.token_ids,
                            f"fp16 lookup, prompt {index}")


# --------------------------------------------------------------------------- (g) Qwen
@pytest.mark.slow
def test_qwen_prefill_and_decode_match_transformers():
    from moaspec.models.store import load_tokenizer, reference_model, resolve

    folder = resolve("qwen2.5-coder-0.5b")
    hf = reference_model(folder)
    model = Transformer(folder, max_seq_len=512)
    ids = chat_ids(load_tokenizer(folder), "Write a Python function that checks whether a number is prime.")
    _check_against_hf(model, hf, ids)


# --------------------------------------------------------------------------- (h) context length
def test_context_length_error(smol_folder):
    m = Transformer(smol_folder, max_seq_len=64)
    assert m.max_seq_len == 64
    with pytest.raises(ContextLengthError):
        m.forward(torch.arange(65))
    m.prefill(list(range(100, 160)))
    assert m.length == 60
    with pytest.raises(ContextLengthError):
        m.forward(torch.arange(5))
    tree = Tree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1])
    with pytest.raises(ContextLengthError):
        m.forward(torch.tensor(tree.tokens), positions=tree.positions(60), tree_mask=tree.mask())
    assert m.forward(torch.arange(4)).logits.shape == (4, m.cfg.vocab_size)  # exactly full is fine
    m.advance(4)
    with pytest.raises(ContextLengthError):
        m.forward(torch.tensor([1]))
