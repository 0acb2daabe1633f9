"""Sampled drafts at T > 0 through the whole engine (prefill, drafter, sampled EAGLE-2 tree, tree pass,
verification by the seeded race or by recursive rejection sampling, commit): the exact joint law of the
first three tokens, reproducible seeded runs equal to plain seeded sampling, and T = 0 unchanged.

The law test runs a tiny randomly initialised Llama built here (12-token vocabulary, one layer) as the
target and a copy of it with a doubled LM head as the draft model (the target at temperature 1/2), so
that drafts are rejected where the drafter is overconfident and later siblings are accepted from the
residual. top_k 5 keeps the law enumerable by target passes (125 outcomes). A generation costs ~2 ms,
so enough of them to catch a half-point bias in any outcome fit in the fast suite.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import SMOL
from safetensors.torch import save_file

from moaspec import cli
from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.sampling import SamplingParams, target_probs
from moaspec.decoding.target import ContextEncoder, LocalTarget, Step
from moaspec.decoding.tree import Tree, TreeConfig
from moaspec.drafters.draft_model import DraftModelDrafter
from moaspec.models.runtime import Transformer

TINY_VOCAB = 12
PROMPT = [1, 2, 3]
TREE = TreeConfig(depth=2, topk=3, total_tokens=4)
LAW_PARAMS = dict(temperature=1.0, top_k=5)
N_LAW = 18_000
HALF_POINT = 0.005
Z = 4.0  # per outcome; 125 outcomes: a false alarm in ~0.8% of seeds (the seeds are fixed)


def tiny_llama(folder: Path, seed: int, head_scale: float = 0.5, vocab: int = TINY_VOCAB, hidden: int = 16,
               mlp: int = 32) -> Path:
    """A randomly initialised one-layer Llama folder (config.json + model.safetensors) for the runtime."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    p = "model.layers.0"
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g), "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": w(vocab, hidden) * head_scale,  # small: a flat law, many outcomes, none likely
        f"{p}.self_attn.q_proj.weight": w(hidden, hidden), f"{p}.self_attn.k_proj.weight": w(hidden // 2, hidden),
        f"{p}.self_attn.v_proj.weight": w(hidden // 2, hidden), f"{p}.self_attn.o_proj.weight": w(hidden, hidden),
        f"{p}.mlp.gate_proj.weight": w(mlp, hidden), f"{p}.mlp.up_proj.weight": w(mlp, hidden),
        f"{p}.mlp.down_proj.weight": w(hidden, mlp),
        f"{p}.input_layernorm.weight": torch.ones(hidden), f"{p}.post_attention_layernorm.weight": torch.ones(hidden),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class RecordingTarget(LocalTarget):
    """A local target that counts its rounds and those accepting a child that was not its parent's
    first draw (only a sampled tree's later sibling is accepted after a rejection)."""

    def __init__(self, model: Transformer, encoder: ContextEncoder | None = None):
        super().__init__(model, encoder)
        self.trees: list[Tree] = []
        self.later_sibling = 0

    def verify(self, tree: Tree) -> Step:
        step = super().verify(tree)
        self.trees.append(tree)
        path = step.verdict.path
        self.later_sibling += any(tree.children[a].index(b) > 0 for a, b in zip(path, path[1:], strict=False))
        return step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = Transformer(tiny_llama(root / "target", seed=0), max_seq_len=32)
    draft = Transformer(tiny_llama(root / "draft", seed=0, head_scale=1.0), max_seq_len=32)
    return target, draft


def tiny_engine(tiny, tree: TreeConfig = TREE, drafter: bool = True) -> Engine:
    target, draft = tiny
    return Engine(RecordingTarget(target), DraftModelDrafter(draft) if drafter else None, tree)


def first_tokens(engine: Engine, cfg: GenerationConfig, n: int, prompt: list[int] = PROMPT) -> tuple[int, ...]:
    """The first n tokens of a generation (it stops there: no later round is drafted)."""
    out: list[int] = []
    for chunk in engine.stream(prompt, cfg):
        out += chunk.tokens
        if len(out) >= n:
            break
    return tuple(out[:n])


def exact_law(model: Transformer, params: SamplingParams, n: int,
              prompt: list[int] = PROMPT) -> dict[tuple[int, ...], float]:
    """The target's law of its first n tokens after `prompt`, by enumerating the prefixes with positive
    probability (one prefill each). Each top-k cut must be clear of float round-off (a tree pass and
    a prefill differ by ~1e-6 in the logits)."""
    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        model.reset()
        logits = model.prefill([*prompt, *prefix]).logits[-1]
        model.reset()
        top = logits.topk(params.top_k + 1).values
        assert top[-2] - top[-1] > 1e-4, f"a near-tie at the top-k cut after {prefix}: choose other seeds"
        return target_probs(logits, params).double()

    law = {(): 1.0}
    for _ in range(n):
        law = {(*seq, x): pr * float(p[x]) for seq, pr in law.items()
               for p in [probs(seq)] for x in p.nonzero().flatten().tolist()}
    return law


@pytest.mark.parametrize("seeded", [pytest.param(True, marks=pytest.mark.slow), False],  # seeded: ~50 s, test-slow
                         ids=["seeded-race", "rejection"])
def test_sampled_drafts_exact_joint_law_through_engine(tiny, seeded, monkeypatch):
    """T = 1, top_k 5: the first three tokens of N generations against the exact law, seeded (the race,
    drafts drawn with the target's noise) or unseeded (recursive rejection sampling; torch.seed made
    deterministic here). Every outcome's frequency must be within Z standard errors of its probability,
    and N makes a half-point bias at least Z + 1 standard errors in every outcome: such a bias fails."""
    law = exact_law(tiny[0], SamplingParams(**LAW_PARAMS), 3)
    assert len(law) == 125 and sum(law.values()) == pytest.approx(1.0)
    se = {seq: math.sqrt(p * (1 - p) / N_LAW) for seq, p in law.items()}
    assert (Z + 1) * max(se.values()) <= HALF_POINT

    fake_seeds = itertools.count(10**6)
    monkeypatch.setattr(torch, "seed", lambda: next(fake_seeds))
    engine = tiny_engine(tiny)
    counts = Counter(first_tokens(engine, GenerationConfig(
        max_new_tokens=8, ignore_eos=True, sampling=SamplingParams(**LAW_PARAMS, seed=i if seeded else None)), 3)
        for i in range(N_LAW))
    rounds = engine.target.trees
    assert all(t.dists for t in rounds if len(t) > 1)  # the drafts were sampled
    assert max(len(t.children[0]) for t in rounds) >= 2
    assert engine.target.later_sibling >= 500, engine.target.later_sibling  # about 6% of the rounds
    assert set(counts) <= set(law), set(counts) - set(law)
    z = {seq: abs(counts[seq] / N_LAW - p) / se[seq] for seq, p in law.items()}
    worst = max(z, key=z.get)
    assert z[worst] < Z, f"{worst}: {counts[worst] / N_LAW:.4f} observed vs {law[worst]:.4f} exact ({z[worst]:.1f} SE)"


def test_seeded_sampled_drafts_reproducible(tiny):
    engine = tiny_engine(tiny, TreeConfig(depth=3, topk=2, total_tokens=5))

    def run(seed: int, sampled: bool = True) -> tuple[tuple[int, ...], list]:
        cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True, sampled_drafts=sampled,
                               sampling=SamplingParams(temperature=1.0, seed=seed))
        engine.target.trees = []
        tokens = first_tokens(engine, cfg, 24)
        return tokens, [(t.tokens, t.parents, t.dists) for t in engine.target.trees]

    first = run(7)
    assert run(7) == first  # tokens, and every drafted tree with its q
    drafted = [dists for tokens, _, dists in first[1] if len(tokens) > 1]
    assert drafted and all(drafted)
    assert run(8)[0] != first[0]
    assert not any(dists for _, _, dists in run(7, sampled=False)[1])  # the switch: top-k drafts


def test_greedy_unchanged_by_sampled_drafts(tiny):
    """T = 0: the same tokens as plain greedy decoding, with the switch on or off, and no sampled tree."""
    plain = first_tokens(tiny_engine(tiny, drafter=False), GenerationConfig(max_new_tokens=20, ignore_eos=True), 20)
    for sampled in (True, False):
        engine = tiny_engine(tiny)
        cfg = GenerationConfig(max_new_tokens=20, ignore_eos=True, sampled_drafts=sampled)
        assert first_tokens(engine, cfg, 20) == plain
        assert not any(t.dists for t in engine.target.trees)


def test_deterministic_drafts_flag():
    parse = cli.build_parser().parse_args
    assert cli.generation_config(parse(["generate", "--prompt", "hi"])).sampled_drafts
    args = parse(["chat", "--deterministic-drafts", "--temperature", "1"])
    assert not cli.generation_config(args).sampled_drafts


@pytest.mark.slow
def test_sampled_drafts_law_smollm2_eagle():
    """The same law check on SmolLM2 with its shipped EAGLE-2 drafter (trimmed vocabulary, target
    features) at T = 1, top_k 3 (27 outcomes). ~0.2 s a generation (6 minutes), so 2000 of them catch a
    bias of a few points only; the tiny-model test above is the half-point one."""
    from moaspec.pipeline import SpecDecoder

    dec = SpecDecoder(SMOL, drafter="eagle", tree=TREE)
    target = RecordingTarget(dec.target, dec.drafter.encoder)
    engine = Engine(target, dec.drafter, TREE)
    prompt = dec.encode("List three colours.", chat=False)
    params, n = dict(temperature=1.0, top_k=3), 2000
    law = exact_law(dec.target, SamplingParams(**params), 3, prompt)
    counts = Counter(first_tokens(engine, GenerationConfig(max_new_tokens=8, ignore_eos=True,
                                                           sampling=SamplingParams(**params, seed=i)), 3, prompt)
                     for i in range(n))
    assert target.later_sibling > 0 and set(counts) <= set(law)
    z = {seq: abs(counts[seq] / n - p) / math.sqrt(p * (1 - p) / n) for seq, p in law.items()}
    assert max(z.values()) < Z, max(z.items(), key=lambda kv: kv[1])


SEEDED_DRAFTERS = ["lookup", "suffix", "model", "moa", "eagle", "independent", "hybrid"]
FAST_SEEDED = ("lookup", "suffix", "moa")  # the others (~15 s each) run in make test-slow


@pytest.mark.parametrize("drafter", [d if d in FAST_SEEDED else pytest.param(d, marks=pytest.mark.slow)
                                     for d in SEEDED_DRAFTERS])
def test_seeded_sampling_equals_plain_for_every_drafter(dec_none, drafter):
    """A seeded generation samples by the exponential race, so its tokens are plain seeded sampling's,
    whatever the drafter proposes and whether its drafts are sampled (with the target's noise) or its
    top-k; and a drafter that remembers earlier calls (suffix) does not change a repeated generation."""
    prompt = dec_none.encode("Write a short story about a robot who learns to paint.")
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    plain = dec_none.generate(prompt, GenerationConfig(max_new_tokens=40, sampling=params)).token_ids
    assert plain != dec_none.generate(prompt, GenerationConfig(
        max_new_tokens=40, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=12))).token_ids
    dec_none.set_drafter(drafter, tree=TreeConfig(depth=3, topk=2, total_tokens=5))
    try:
        drafted = 0
        for sampled in (True, False, True):
            g = dec_none.generate(prompt, GenerationConfig(max_new_tokens=40, sampling=params, sampled_drafts=sampled))
            assert g.token_ids == plain, (drafter, sampled)
            drafted += g.metrics.drafted_tokens
        assert drafted > 0
    finally:
        dec_none.set_drafter("none")
