"""The MoA drafter (moaspec.drafters.moa) on the real SmolLM2 target, untrained (random) weights.

The central check: what the drafter computes at inference (prefill, verification rounds, tree
expansion with tentative caches) equals what `forward_train` computes in one pass with the training
masks, so the masks reproduce exactly the information the drafter has at inference.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import chat_ids, record_grow_tree
from prompts import PROMPTS

import moaspec.drafters.moa as moa
from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import Tree, TreeConfig
from moaspec.drafters import SPECS
from moaspec.drafters.moa import (
    ContextEncoder,
    FrozenTargetLayer,
    MoAConfig,
    MoAContext,
    MoADrafter,
    ca_mask,
    param_count,
    sa_curriculum_mask,
    verification_starts,
)
from moaspec.errors import UserError
from moaspec.models.runtime import rms_norm

TOL = 1e-4
NAME, FINGERPRINT = "smollm2-135m", "0123456789abcdef"
TRAINABLE = ("sa.", "ca.", "encoder.lsa.", "encoder.proj.")


def _cfg(target, tli_layers=0, vocab_ids=0, query_state=False):
    return MoAConfig.for_target(target.cfg, tli_layers=tli_layers, vocab_ids=vocab_ids, target_name=NAME,
                                target_fingerprint=FINGERPRINT, query_state=query_state)


def _drafter(target, tli_layers=0, vocab_ids=0, seed=0, query_state=False):
    torch.manual_seed(seed)
    cfg = _cfg(target, tli_layers, vocab_ids, query_state)
    ids = torch.randperm(cfg.vocab_size)[:vocab_ids] if vocab_ids else None
    d = MoADrafter.from_target(target, cfg, vocab_ids=ids).eval()
    if query_state:  # it starts at zero (the paper's drafter): random weights make the tests see it
        torch.nn.init.normal_(d.state_proj.weight, std=0.02)
    return d


def _generate(engine: Engine, ids: list[int], n: int) -> list[int]:
    chunks = engine.stream(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True))
    return [t for chunk in chunks for t in chunk.tokens]


def _training_inputs(target, drafter: MoADrafter, seq: list[int]):
    """The target's K/V over a whole sequence -> (context vectors [1, T, D], tail K/V [1, N, Hkv, T, d],
    final states [1, T, D])."""
    target.reset()
    L = target.cfg.num_layers
    states = target.prefill(seq, hidden_layers=(L,)).hidden[L][None]
    K, V = target.kv(slice(0, len(seq)))  # [L, Hkv, T, d]
    with torch.no_grad():
        ctx = drafter.encoder(K.permute(2, 0, 1, 3)[None], V.permute(2, 0, 1, 3)[None])
    N = drafter.cfg.tli_layers
    tail = (K[-N:][None].clone(), V[-N:][None].clone()) if N else None
    target.reset()
    return ctx, tail, states


# ----------------------------------------------------------------------------- masks
def test_verification_starts():
    # prompt slots 0..4 and multiples of 6 are verified; row i reads up to the last verified slot before i
    start = verification_starts(20, prompt_len=5, every=6)
    expect = [0, 0, 1, 2, 3, 4, 4, 6, 6, 6, 6, 6, 6, 12, 12, 12, 12, 12, 12, 18]
    assert start.tolist() == expect
    assert (start[1:] < torch.arange(1, 20)).all()  # never the row's own slot
    batched = verification_starts(20, torch.tensor([5, 9]), torch.tensor([6, 7]))
    assert batched.shape == (2, 20)
    assert batched[0].tolist() == expect
    assert batched[1].tolist() == [0, *range(9), 8, 8, 8, 8, 8, 14, 14, 14, 14, 14]
    # a prompt longer than a stride: prompt rows are all verified (start i-1) up to the prompt's end
    assert verification_starts(8, prompt_len=8, every=2).tolist() == [0, 0, 1, 2, 3, 4, 5, 6]


def test_ca_mask_sees_exactly_up_to_start():
    start = torch.stack([verification_starts(24, 3, 5), verification_starts(24, 10, 7)])
    m = ca_mask(start)
    assert m.shape == (2, 24, 24) and m.dtype == torch.bool
    for b in range(2):
        for i in range(24):
            assert m[b, i].nonzero().flatten().tolist() == list(range(int(start[b, i]) + 1))


def test_sa_curriculum_mask():
    start = verification_starts(16, 4, 5)
    m = sa_curriculum_mask(start)
    for i in range(16):
        assert m[i].nonzero().flatten().tolist() == sorted({*range(int(start[i]) + 1, i + 1), i})
    assert m.diagonal().all()


def test_lsa_is_bidirectional_over_layers(smol_model):
    torch.manual_seed(0)
    cfg = _cfg(smol_model)
    enc = ContextEncoder(cfg)
    L, H, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    k, v = torch.randn(2, L, H, d), torch.randn(2, L, H, d)
    with torch.no_grad():
        base = enc.layer_states(k, v)
        assert base.shape == (2, L, 2 * H * d)
        for layer in (0, L // 2, L - 1):
            k2 = k.clone()
            k2[:, layer] += 1.0
            changed = (enc.layer_states(k2, v) - base).abs().amax(-1)  # [2, L]
            assert (changed > 1e-6).all(), f"perturbing layer {layer} left some layer outputs unchanged"
        out = enc(k, v)
    assert out.shape == (2, cfg.hidden_size)


# ----------------------------------------------------------------------------- sizes
def test_paper_sizes_and_trainable_parameters(smol_model):
    llama8b = dataclasses.replace(smol_model.cfg, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                  head_dim=128, vocab_size=128256)
    c = MoAConfig.for_target(llama8b)
    assert (c.sa_kv_heads, c.sa_mlp, c.lsa_hidden, c.lsa_mlp) == (4, 6144, 2048, 3072)
    assert 263e6 < param_count(c) < 265e6  # the paper: 264M trainable parameters for Llama-3-8B

    d = _drafter(smol_model, tli_layers=1, vocab_ids=512)
    names = [n for n, _ in d.named_parameters()]
    assert names and all(n.startswith(TRAINABLE) for n in names)
    assert all(any(n.startswith(p) for n in names) for p in TRAINABLE)
    assert set(d.state_dict()) == set(names) | {"vocab_ids"}
    assert d.num_trainable_parameters() == sum(p.numel() for p in d.parameters()) == param_count(d.cfg)
    # frozen parts are the target's own tensors, not copies
    assert d.embed is smol_model.embed and d.full_head.data_ptr() == smol_model.lm_head_weight.data_ptr()
    assert d.tli[0].layer is smol_model.layers[-1]
    assert d.head.shape == (512, smol_model.cfg.hidden_size)
    assert torch.equal(d.head, smol_model.lm_head_weight[d.vocab_ids])


def test_training_gradients_reach_only_trainable_weights(smol_model):
    d = _drafter(smol_model, tli_layers=1).train()
    seq = list(range(200, 216))
    _, tail, _ = _training_inputs(smol_model, d, seq)
    smol_model.prefill(seq)
    K, V = smol_model.kv(slice(0, len(seq)))
    smol_model.reset()
    ctx = d.encoder(K.permute(2, 0, 1, 3)[None], V.permute(2, 0, 1, 3)[None])  # with grad: LSA/proj train too
    start = verification_starts(len(seq), 4, 6)
    out = d.forward_train(torch.tensor([seq]), ctx, start, tail, sa_mask=sa_curriculum_mask(start))
    assert out.hidden.shape == out.final.shape == (1, len(seq), smol_model.cfg.hidden_size)
    assert out.logits.shape == (1, len(seq), smol_model.cfg.vocab_size)
    (out.logits.logsumexp(-1).mean() + out.hidden.pow(2).mean()).backward()
    for n, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert not smol_model.embed.requires_grad and smol_model.embed.grad is None


# ----------------------------------------------------------------------------- TLI layers are the target's
def test_frozen_tli_layer_reproduces_target(smol_model):
    seq = list(range(300, 320))
    L = smol_model.cfg.num_layers
    smol_model.reset()
    out = smol_model.forward(torch.tensor(seq), hidden_layers=(L - 1,))
    smol_model.reset()
    layer = FrozenTargetLayer(smol_model.layers[-1], smol_model.cfg)
    n = len(seq)
    with torch.no_grad():
        x = layer(out.hidden[L - 1][None], smol_model.cos[:n], smol_model.sin[:n],
                  torch.ones(n, n, dtype=torch.bool).tril())
        logits = torch.nn.functional.linear(rms_norm(x[0], smol_model.norm, smol_model.cfg.rms_eps),
                                            smol_model.lm_head_weight)
    assert (logits - out.logits).abs().max() < TOL


# ----------------------------------------------------------------------------- engine: lossless
@pytest.fixture(scope="module")
def greedy_reference(smol_model, smol_tokenizer):
    prompts = [chat_ids(smol_tokenizer, p) for p in PROMPTS[:3]]
    engine = Engine(LocalTarget(smol_model), None)
    return [(ids, _generate(engine, ids, 32)) for ids in prompts]


@pytest.mark.parametrize("tli_layers,vocab_ids,query_state", [(0, 0, False), (1, 4096, False), (0, 4096, True)])
def test_untrained_drafter_in_engine_is_lossless(smol_model, greedy_reference, tli_layers, vocab_ids, query_state):
    d = _drafter(smol_model, tli_layers, vocab_ids, query_state=query_state)
    engine = Engine(LocalTarget(smol_model, d.encoder), d, TreeConfig(depth=3, topk=2, total_tokens=4))
    for ids, expected in greedy_reference:
        assert _generate(engine, ids, 32) == expected
        assert engine.metrics.target_calls <= 32


# ----------------------------------------------------------------------------- inference == training


def _train_logprobs(smol_model, d: MoADrafter, seq: list[int], verified: int) -> torch.Tensor:
    """forward_train log-probs [T, K] for `seq`, whose first `verified` slots the target has verified."""
    ctx, tail, states = _training_inputs(smol_model, d, seq)
    start = verification_starts(len(seq), prompt_len=verified, every=10**6)
    with torch.no_grad():
        out = d.forward_train(torch.tensor([seq]), ctx, start, tail, states=states)
    return torch.log_softmax(out.logits[0], -1)


def _check_round(smol_model, d: MoADrafter, seen: dict, committed: list[int], root: int) -> None:
    P = len(committed)
    vocab = d.draft_vocab
    index = {int(t): i for i, t in enumerate(vocab.tolist())} if vocab is not None else None
    lp = _train_logprobs(smol_model, d, [*committed, root], P)
    assert (seen["root"] - lp[P]).abs().max() < TOL
    checked = 0
    for tree, frontier, lps in seen["expand"]:
        for r, node in enumerate(frontier):
            path = [tree.tokens[i] for i in tree.path_to(node)]  # root .. node
            lp = _train_logprobs(smol_model, d, [*committed, *path], P)
            assert (lps[r] - lp[-1]).abs().max() < TOL, f"node {node} (depth {len(path) - 1})"
            checked += 1
    assert checked >= 2
    # the kept tree's cumulative scores are the training log-probs summed along each path
    tree = seen["tree"]
    for node in range(1, len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        lp = _train_logprobs(smol_model, d, [*committed, *path[:-1]], P)
        cols = [index[t] if index else t for t in path[1:]]
        score = sum(float(lp[P + k, c]) for k, c in enumerate(cols))
        assert abs(score - tree.scores[node]) < TOL


@pytest.mark.parametrize("tli_layers,vocab_ids,query_state", [(0, 0, False), (1, 2048, False), (1, 2048, True)])
def test_inference_equals_training_with_masks(smol_model, monkeypatch, tli_layers, vocab_ids, query_state):
    d = _drafter(smol_model, tli_layers, vocab_ids, seed=1, query_state=query_state)
    prompt = list(range(1000, 1012))
    # The target's own greedy continuation, so that a chain of it is accepted in full below.
    plain = _generate(Engine(LocalTarget(smol_model), None), prompt, 5)
    target = LocalTarget(smol_model, d.encoder)
    cfg = TreeConfig(depth=3, topk=2, total_tokens=5)

    # round 1: right after the prefill (the root sees the prompt's 12 context vectors)
    step = target.start(prompt, GenerationConfig().sampling)
    root = step.verdict.bonus
    assert root == plain[0] and isinstance(step.context, MoAContext) and len(step.context) == len(prompt)
    d.begin(prompt, step.context)
    seen = record_grow_tree(monkeypatch, moa)
    d.propose(root, cfg)
    _check_round(smol_model, d, seen, prompt, root)

    # round 2: verify a chain the target accepts in full, observe 4 tokens (3 of them pending for SA)
    target.start(prompt, GenerationConfig().sampling)
    step = target.verify(Tree.chain(root, plain[1:4]))
    assert step.verdict.accepted == plain[1:4]
    d.observe([root, *plain[1:4]], step.context)
    seen = record_grow_tree(monkeypatch, moa)
    d.propose(step.verdict.bonus, cfg)
    _check_round(smol_model, d, seen, [*prompt, *plain[:4]], step.verdict.bonus)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("query_state", [False, True])
def test_checkpoint_round_trip(smol_model, tmp_path, query_state):
    d = _drafter(smol_model, tli_layers=1, vocab_ids=1024, seed=2, query_state=query_state)
    seq = list(range(500, 520))
    ctx, tail, states = _training_inputs(smol_model, d, seq)
    start = verification_starts(len(seq), 6, 5)
    with torch.no_grad():
        ref = d.forward_train(torch.tensor([seq]), ctx, start, tail, states=states).logits
    SPECS["moa"].save(d, tmp_path / "fp32")
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["kind"] == "moa" and config["target_name"] == NAME and config["target_fingerprint"] == FINGERPRINT
    assert config["tli_layers"] == 1 and config["vocab_ids"] == 1024 and config["hidden_size"] == 576
    assert config["query_state"] == query_state
    loaded = SPECS["moa"].load(tmp_path / "fp32", smol_model, NAME, FINGERPRINT)
    assert torch.equal(loaded.vocab_ids, d.vocab_ids)
    with torch.no_grad():
        assert torch.equal(loaded.forward_train(torch.tensor([seq]), ctx, start, tail, states=states).logits, ref)

    SPECS["moa"].save(d, tmp_path / "fp16", fp16=True)
    assert (tmp_path / "fp16" / "model.safetensors").stat().st_size < 0.6 * (
        tmp_path / "fp32" / "model.safetensors").stat().st_size
    half = SPECS["moa"].load(tmp_path / "fp16", smol_model, NAME, FINGERPRINT)
    with torch.no_grad():
        assert (half.forward_train(torch.tensor([seq]), ctx, start, tail, states=states).logits - ref).abs().max() \
            < 0.05


def test_checkpoint_errors(smol_model, tmp_path):
    d = _drafter(smol_model)
    folder = SPECS["moa"].save(d, tmp_path / "ckpt")
    with pytest.raises(UserError, match="fingerprint"):
        SPECS["moa"].load(folder, smol_model, NAME, "ffffffffffffffff")
    with pytest.raises(UserError, match="trained for target"):
        SPECS["moa"].load(folder, smol_model, "qwen2.5-coder-0.5b", FINGERPRINT)
    with pytest.raises(UserError, match="missing"):
        SPECS["moa"].load(tmp_path / "nowhere", smol_model, NAME, FINGERPRINT)

    other = tmp_path / "dims"
    SPECS["moa"].save(d, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_size"] = 896
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="hidden_size"):
        SPECS["moa"].load(other, smol_model, NAME, FINGERPRINT)

    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="corrupt"):
        SPECS["moa"].load(folder, smol_model, NAME, FINGERPRINT)
    weights.write_bytes(b"")
    with pytest.raises(UserError):
        SPECS["moa"].load(folder, smol_model, NAME, FINGERPRINT)
    weights.unlink()
    with pytest.raises(UserError, match="model.safetensors"):
        SPECS["moa"].load(folder, smol_model, NAME, FINGERPRINT)


def test_draft_linear_fast_path_matches_and_follows_weight_updates():
    """Drafting runs nn.Linear through the decoding kernels; the view must track optimiser steps."""
    import torch.nn.functional as F

    from moaspec.drafters.layers import DraftLinear

    torch.manual_seed(0)
    lin = DraftLinear(64, 48, bias=True)
    for rows in (1, 3, 12):
        x = torch.randn(1, rows, 64)
        with torch.no_grad():
            assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)
    with torch.no_grad():
        lin.weight.add_(1.0)
        assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-4)
    assert lin(x).requires_grad  # training keeps autograd's own path
