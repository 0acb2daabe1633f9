"""The trained baselines (moaspec.drafters.eagle, moaspec.drafters.independent) on the real SmolLM2
target, untrained (random) weights: lossless in the engine, inference == forward_train at the matching
rows (root and drafted nodes, after prefill and after a verification), checkpoints, sizes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import chat_ids, record_grow_tree
from prompts import PROMPTS

import moaspec.drafters.eagle as eagle
import moaspec.drafters.independent as independent
import moaspec.drafters.moa as moa
from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import Tree, TreeConfig
from moaspec.drafters import SPECS
from moaspec.drafters.eagle import EagleConfig, EagleDrafter, FeatureEncoder
from moaspec.drafters.independent import IndependentConfig, IndependentDrafter
from moaspec.errors import UserError
from moaspec.models.runtime import ModelConfig
from moaspec.models.store import resolve

TOL = 1e-4
NAME, FINGERPRINT = "smollm2-135m", "0123456789abcdef"
MODULES = {"eagle": eagle, "independent": independent}
TRAINABLE = {"eagle": ("fc.", "layer."), "independent": ("layers.", "norm.")}


def _drafter(target, kind: str, vocab_ids: int = 0, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "eagle":
        cfg = EagleConfig.for_target(target.cfg, vocab_ids=vocab_ids, target_name=NAME, target_fingerprint=FINGERPRINT)
        cls = EagleDrafter
    else:
        cfg = IndependentConfig.for_target(target.cfg, vocab_ids=vocab_ids, target_name=NAME,
                                           target_fingerprint=FINGERPRINT)
        cls = IndependentDrafter
    ids = torch.randperm(cfg.vocab_size)[:vocab_ids] if vocab_ids else None
    d = cls.from_target(target, cfg, vocab_ids=ids).eval()
    if kind == "eagle":  # random biases: the fc bias must survive checkpoints too
        torch.nn.init.normal_(d.fc.bias, std=0.02)
    return d


def _generate(engine: Engine, ids: list[int], n: int) -> list[int]:
    chunks = engine.stream(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True))
    return [t for chunk in chunks for t in chunk.tokens]


def _features(target, seq: list[int]) -> torch.Tensor:
    """The target's final normed hidden states of a whole sequence [T, D] (what EAGLE trains on)."""
    target.reset()
    f = target.prefill(seq, hidden_layers=(target.cfg.num_layers,)).hidden[target.cfg.num_layers].clone()
    target.reset()
    return f


def _train_logits(target, d, seq: list[int], feats: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(d, EagleDrafter):
            return d.forward_train(torch.tensor([seq]), feats[None], noise_std=0.0)[1][0]
        return d.forward_train(torch.tensor([seq]))[1][0]


# ----------------------------------------------------------------------------- sizes
def _target_cfg(name: str) -> ModelConfig:
    try:
        folder = resolve(name, progress=False)
    except UserError as e:
        pytest.skip(f"{name} not available: {e}")
    return ModelConfig.from_folder(folder)


# (EAGLE, independent, MoA N=0) trainable parameters; vocab_ids changes nothing (the head is frozen).
EXPECTED_PARAMS = {
    # EAGLE: fc 2*576*576+576, attention 576*(2*576+2*192), MLP 3*576*1536, post norm 576
    # independent: 2 x (attention 884,736 + MLP 3*576*896 + 2 norms) + final norm
    "smollm2-135m": (4_203_648, 4_868_928, 6_196_800),
    # EAGLE's MLP is the target's intermediate size (4864 = 5.4x hidden), hence larger than MoA here
    "qwen2.5-coder-0.5b": (16_516_864, 10_899_840, 11_621_248),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_trainable_parameter_counts(name):
    c = _target_cfg(name)
    counts = (eagle.param_count(EagleConfig.for_target(c, vocab_ids=4096)),
              independent.param_count(IndependentConfig.for_target(c, vocab_ids=4096)),
              moa.param_count(moa.MoAConfig.for_target(c)))
    print(f"\n{name}: trainable parameters EAGLE {counts[0]:,}, independent {counts[1]:,}, MoA(N=0) {counts[2]:,}")
    assert counts == EXPECTED_PARAMS[name]


def test_eagle_paper_size(smol_model):
    llama8b = dataclasses.replace(smol_model.cfg, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                  head_dim=128, vocab_size=128256, intermediate_size=14336)
    c = EagleConfig.for_target(llama8b)
    assert (c.heads, c.kv_heads, c.head_dim, c.mlp, c.input_norm) == (32, 8, 128, 14336, False)
    assert 251e6 < eagle.param_count(c) < 253e6  # EAGLE-2's Llama-3-8B drafter (MoA: 264M)


@pytest.mark.parametrize("kind", ["eagle", "independent"])
def test_parameters_state_dict_and_frozen_parts(smol_model, kind):
    d = _drafter(smol_model, kind, vocab_ids=512)
    names = [n for n, _ in d.named_parameters()]
    assert names and all(n.startswith(TRAINABLE[kind]) for n in names)
    assert set(d.state_dict()) == set(names) | {"vocab_ids"}
    assert d.num_trainable_parameters() == sum(p.numel() for p in d.parameters()) == \
        MODULES[kind].param_count(d.cfg)
    assert d.name == kind
    assert d.embed is smol_model.embed and d.full_head.data_ptr() == smol_model.lm_head_weight.data_ptr()
    assert d.head.shape == (512, smol_model.cfg.hidden_size)
    assert torch.equal(d.head, smol_model.lm_head_weight[d.vocab_ids])
    if kind == "eagle":
        assert not any("input_norm" in n for n in names)  # EAGLE's layer has no input RMSNorm
        assert isinstance(d.encoder, FeatureEncoder) and d.encoder.hidden_layers == (smol_model.cfg.num_layers,)
        assert d.fc.in_features == 2 * d.fc.out_features and d.fc.bias is not None
    else:
        assert d.encoder is None and len(d.layers) == 2


@pytest.mark.parametrize("kind", ["eagle", "independent"])
def test_training_gradients_reach_only_trainable_weights(smol_model, kind):
    d = _drafter(smol_model, kind).train()
    seq = list(range(200, 216))
    if kind == "eagle":
        feats = _features(smol_model, seq)
        pred, logits = d.forward_train(torch.tensor([seq]), feats[None])
        assert pred.shape == feats[None].shape
        # noise (U(-0.1, 0.1) on the features) only in training mode
        with torch.no_grad():
            again = d.forward_train(torch.tensor([seq]), feats[None])[0]
            assert (again - pred).abs().max() > 1e-6
            d.eval()
            a = d.forward_train(torch.tensor([seq]), feats[None])[0]
            b = d.forward_train(torch.tensor([seq]), feats[None], noise_std=0.0)[0]
            assert torch.equal(a, b)
            d.train()
        loss = logits.logsumexp(-1).mean() + pred.pow(2).mean()
    else:
        hidden, logits = d.forward_train(torch.tensor([seq]))
        assert hidden.shape == (1, len(seq), smol_model.cfg.hidden_size)
        loss = logits.logsumexp(-1).mean() + hidden.pow(2).mean()
    assert logits.shape == (1, len(seq), smol_model.cfg.vocab_size)
    loss.backward()
    for n, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert not smol_model.embed.requires_grad and smol_model.embed.grad is None


def test_eagle_rows_are_causal_and_aligned(smol_model):
    """Row i reads (f_i, x_{i+1}): changing x_{k+1} or f_k changes rows >= k only."""
    d = _drafter(smol_model, "eagle")
    seq = list(range(400, 412))
    feats = _features(smol_model, seq)
    base = _train_logits(smol_model, d, seq, feats)
    k = 6
    seq2 = list(seq)
    seq2[k + 1] += 1
    changed = (_train_logits(smol_model, d, seq2, feats) - base).abs().amax(-1)
    assert (changed[:k] == 0).all() and changed[k] > 1e-6
    feats2 = feats.clone()
    feats2[k] += 0.5
    changed = (_train_logits(smol_model, d, seq, feats2) - base).abs().amax(-1)
    assert (changed[:k] == 0).all() and changed[k] > 1e-6


# ----------------------------------------------------------------------------- engine: lossless
@pytest.fixture(scope="module")
def greedy_reference(smol_model, smol_tokenizer):
    prompts = [chat_ids(smol_tokenizer, p) for p in PROMPTS[:3]]
    engine = Engine(LocalTarget(smol_model), None)
    return [(ids, _generate(engine, ids, 32)) for ids in prompts]


@pytest.mark.parametrize("kind,vocab_ids", [("eagle", 0), ("eagle", 4096), ("independent", 4096)])
def test_untrained_drafter_in_engine_is_lossless(smol_model, greedy_reference, kind, vocab_ids):
    d = _drafter(smol_model, kind, vocab_ids)
    engine = Engine(LocalTarget(smol_model, d.encoder), d, TreeConfig(depth=3, topk=2, total_tokens=4))
    for ids, expected in greedy_reference:
        assert _generate(engine, ids, 32) == expected
        assert engine.metrics.target_calls <= 32


# ----------------------------------------------------------------------------- inference == training


def _eagle_node_logprobs(smol_model, d: EagleDrafter, committed: list[int], feats: torch.Tensor,
                         path: list[int]) -> torch.Tensor:
    """forward_train's log-probs for the children of the last node of `path` (root first), fed like
    inference: real features for the P committed slots, then the drafter's own predictions (the pred of
    row P-1+k is the feature of row P+k)."""
    P = len(committed)
    seq = [*committed, *path]
    f = torch.cat([feats, torch.zeros(len(path), feats.shape[1])])
    for k in range(len(path) - 1):
        with torch.no_grad():
            pred = d.forward_train(torch.tensor([seq]), f[None], noise_std=0.0)[0][0]
        f[P + k] = pred[P - 1 + k]
    return torch.log_softmax(_train_logits(smol_model, d, seq, f)[P - 2 + len(path)], -1)


def _check_round(smol_model, d, seen: dict, committed: list[int], root: int, feats: torch.Tensor | None) -> None:
    P = len(committed)

    def reference(path: list[int]) -> torch.Tensor:
        if isinstance(d, EagleDrafter):
            return _eagle_node_logprobs(smol_model, d, committed, feats, path)
        return torch.log_softmax(_train_logits(smol_model, d, [*committed, *path])[-1], -1)

    assert (seen["root"] - reference([root])).abs().max() < TOL
    checked = set()
    for tree, frontier, lps in seen["expand"]:
        for r, node in enumerate(frontier):
            path = [tree.tokens[i] for i in tree.path_to(node)]  # root .. node
            assert (lps[r] - reference(path)).abs().max() < TOL, f"node {node} (depth {len(path) - 1})"
            checked.add(len(path) - 1)
    assert checked == {1, 2}  # depth 3: nodes of depth 1 and 2 are expanded
    assert P > 0


@pytest.mark.parametrize("kind,vocab_ids", [("eagle", 0), ("eagle", 2048), ("independent", 2048)])
def test_inference_equals_training(smol_model, monkeypatch, kind, vocab_ids):
    d = _drafter(smol_model, kind, vocab_ids, seed=1)
    module = MODULES[kind]
    prompt = list(range(1000, 1012))
    plain = _generate(Engine(LocalTarget(smol_model), None), prompt, 5)  # a chain the target accepts in full
    target = LocalTarget(smol_model, d.encoder)
    cfg = TreeConfig(depth=3, topk=2, total_tokens=5)

    # round 1: right after the prefill
    step = target.start(prompt, GenerationConfig().sampling)
    root = step.verdict.bonus
    assert root == plain[0]
    if kind == "eagle":
        assert step.context.states.shape == (len(prompt), smol_model.cfg.hidden_size)
    d.begin(prompt, step.context)
    seen = record_grow_tree(monkeypatch, module)
    d.propose(root, cfg)
    feats = _features(smol_model, prompt) if kind == "eagle" else None
    _check_round(smol_model, d, seen, prompt, root, feats)

    # round 2: verify a chain the target accepts in full, observe 4 tokens (3 of them pending)
    target.start(prompt, GenerationConfig().sampling)
    step = target.verify(Tree.chain(root, plain[1:4]))
    assert step.verdict.accepted == plain[1:4]
    d.observe([root, *plain[1:4]], step.context)
    seen = record_grow_tree(monkeypatch, module)
    d.propose(step.verdict.bonus, cfg)
    committed = [*prompt, *plain[:4]]
    feats = _features(smol_model, committed) if kind == "eagle" else None  # training's features: one prefill
    _check_round(smol_model, d, seen, committed, step.verdict.bonus, feats)


def test_eagle_needs_features(smol_model):
    d = _drafter(smol_model, "eagle")
    with pytest.raises(UserError, match="encoder"):
        d.begin([1, 2, 3], None)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("kind", ["eagle", "independent"])
def test_checkpoint_round_trip(smol_model, tmp_path, kind):
    d = _drafter(smol_model, kind, vocab_ids=1024, seed=2)
    seq = list(range(500, 520))
    feats = _features(smol_model, seq) if kind == "eagle" else None
    ref = _train_logits(smol_model, d, seq, feats)
    SPECS[kind].save(d, tmp_path / "fp32")
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["kind"] == kind and config["target_name"] == NAME and config["target_fingerprint"] == FINGERPRINT
    assert config["vocab_ids"] == 1024 and config["hidden_size"] == 576
    assert SPECS[kind].read_config(tmp_path / "fp32") == d.cfg
    loaded = SPECS[kind].load(tmp_path / "fp32", smol_model, NAME, FINGERPRINT)
    assert type(loaded) is type(d) and not loaded.training
    assert torch.equal(loaded.vocab_ids, d.vocab_ids) and torch.equal(loaded.head, d.head)
    assert torch.equal(_train_logits(smol_model, loaded, seq, feats), ref)

    SPECS[kind].save(d, tmp_path / "fp16", fp16=True)
    assert (tmp_path / "fp16" / "model.safetensors").stat().st_size < 0.6 * (
        tmp_path / "fp32" / "model.safetensors").stat().st_size
    half = SPECS[kind].load(tmp_path / "fp16", smol_model, NAME, FINGERPRINT)
    assert (_train_logits(smol_model, half, seq, feats) - ref).abs().max() < 0.05


@pytest.mark.parametrize("kind", ["eagle", "independent"])
def test_checkpoint_errors(smol_model, tmp_path, kind):
    d = _drafter(smol_model, kind)
    folder = SPECS[kind].save(d, tmp_path / "ckpt")
    with pytest.raises(UserError, match="fingerprint"):
        SPECS[kind].load(folder, smol_model, NAME, "ffffffffffffffff")
    with pytest.raises(UserError, match="trained for target"):
        SPECS[kind].load(folder, smol_model, "qwen2.5-coder-0.5b", FINGERPRINT)
    with pytest.raises(UserError, match="missing"):
        SPECS[kind].load(tmp_path / "nowhere", smol_model, NAME, FINGERPRINT)
    other_kind = SPECS["independent" if kind == "eagle" else "eagle"]
    with pytest.raises(UserError, match="kind"):
        other_kind.load(folder, smol_model, NAME, FINGERPRINT)
    moa_folder = SPECS["moa"].save(moa.MoADrafter.from_target(
        smol_model, moa.MoAConfig.for_target(smol_model.cfg, target_name=NAME, target_fingerprint=FINGERPRINT)),
        tmp_path / "moa")
    with pytest.raises(UserError, match="kind"):
        SPECS[kind].load(moa_folder, smol_model, NAME, FINGERPRINT)

    dims = SPECS[kind].save(d, tmp_path / "dims")
    cfg = json.loads((dims / "config.json").read_text())
    cfg["hidden_size"] = 896
    (dims / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="hidden_size"):
        SPECS[kind].load(dims, smol_model, NAME, FINGERPRINT)
    (dims / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        SPECS[kind].load(dims, smol_model, NAME, FINGERPRINT)

    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="corrupt"):
        SPECS[kind].load(folder, smol_model, NAME, FINGERPRINT)
    weights.write_bytes(b"")
    with pytest.raises(UserError):
        SPECS[kind].load(folder, smol_model, NAME, FINGERPRINT)
    weights.unlink()
    with pytest.raises(UserError, match="model.safetensors"):
        SPECS[kind].load(folder, smol_model, NAME, FINGERPRINT)
