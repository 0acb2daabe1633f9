"""The drafter checkpoints that ship with the package: they load, and greedy speculative output with
each one is token-identical to plain greedy (or parts at a documented near-tie)."""

from __future__ import annotations

import json

import pytest
from conftest import SMOL, assert_same_or_near_tie
from prompts import PROMPTS

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import TreeConfig
from moaspec.drafters import TRAINED, drafter_kind, resolve_auto, shipped_checkpoint

SHIPPED = [kind for kind in TRAINED if shipped_checkpoint(kind, SMOL).exists()]


def test_moa_ships_for_the_default_target():
    assert "moa" in SHIPPED
    # `auto` takes MoA only once its checkpoint is marked as measured faster than the suffix drafter
    meta = json.loads((shipped_checkpoint("moa", SMOL) / "training.json").read_text())
    assert resolve_auto(SMOL) == ("moa" if meta.get("default") else "suffix")


# MoA's in the fast suite; the baselines' (~40 s each) with the slow tests
@pytest.fixture(scope="module", params=[pytest.param(k, marks=() if k == "moa" else pytest.mark.slow) for k in SHIPPED])
def trained(request):
    from moaspec.pipeline import SpecDecoder

    return request.param, SpecDecoder(SMOL, drafter=request.param, tree=TreeConfig())


def test_shipped_drafter_is_lossless_and_useful(trained, plain_greedy):
    kind, dec = trained
    taus = []
    for i, prompt in enumerate(PROMPTS[:8]):
        prompt_ids, plain = plain_greedy(prompt, 64)
        g = dec.generate(prompt_ids, GenerationConfig(max_new_tokens=64))
        assert_same_or_near_tie(dec.target, prompt_ids, plain, g.token_ids, f"{kind} prompt {i}")
        taus.append(g.metrics.tau)
    # a trained drafter must get more than the bonus token per target call on average
    assert sum(taus) / len(taus) > 1.2, (kind, taus)


@pytest.mark.slow  # all prompts x two stop rules (~28 s): make test-slow
def test_confidence_stop_is_lossless_and_drafts_less(plain_greedy):
    """TreeConfig.min_prob: MoA's chain stops where its own path probability falls below it, so fewer
    draft tokens reach verification, each likelier to be accepted, and the output is still plain greedy's."""
    from moaspec.pipeline import SpecDecoder

    dec = SpecDecoder(SMOL, drafter="moa", tree=TreeConfig(4, 1, 4))
    stats = {}
    for min_prob in (0.0, 0.3):
        dec.set_drafter("moa", tree=TreeConfig(4, 1, 4, min_prob=min_prob))
        drafted = accepted = 0
        for i, prompt in enumerate(PROMPTS[:4]):
            prompt_ids, plain = plain_greedy(prompt, 48)
            g = dec.generate(prompt_ids, GenerationConfig(max_new_tokens=48))
            assert_same_or_near_tie(dec.target, prompt_ids, plain, g.token_ids, f"min_prob {min_prob} prompt {i}")
            drafted += g.metrics.drafted_tokens
            accepted += sum(g.metrics.accept_lengths) - g.metrics.target_calls
        stats[min_prob] = drafted, accepted / drafted
    assert stats[0.3][0] < 0.8 * stats[0.0][0], stats
    assert stats[0.3][1] > stats[0.0][1], stats


def test_shipped_drafter_samples(trained, monkeypatch):
    """At T > 0 the drafts are sampled (every drafted tree states its q), unless switched off."""
    kind, dec = trained
    trees = []
    verify = dec.engine.target.verify
    monkeypatch.setattr(dec.engine.target, "verify", lambda tree: trees.append(tree) or verify(tree))
    for sampled in (True, False):
        trees.clear()
        cfg = GenerationConfig(max_new_tokens=32, sampling=SamplingParams(temperature=1.0, seed=0),
                               sampled_drafts=sampled)
        g = dec.generate(PROMPTS[0], cfg)
        assert 1 <= g.metrics.new_tokens <= 32 and g.metrics.tau >= 1.0
        drafted = [t for t in trees if len(t) > 1]
        assert drafted and all(bool(t.dists) == sampled for t in drafted), kind


QWEN = "qwen2.5-coder-0.5b"
QWEN_SHIPPED = sorted(p.parent.name for p in shipped_checkpoint("moa", QWEN).parent.glob("*/config.json")
                      if drafter_kind(p.parent.name) in TRAINED)  # not the datastore beside them


@pytest.mark.slow
def test_shipped_qwen_drafters_are_lossless():
    """Every drafter shipped for Qwen2.5-Coder-0.5B (MoA N=0/1/3, EAGLE-2, independent) on one copy of
    the target: greedy output identical to plain greedy."""
    from moaspec.pipeline import SpecDecoder

    assert {"moa", "moa-n1", "moa-n3", "eagle", "independent"} <= set(QWEN_SHIPPED)
    dec = SpecDecoder(QWEN, drafter="none")
    cfg = GenerationConfig(max_new_tokens=32)
    plain = [dec.generate(p, cfg) for p in PROMPTS[:3]]
    for label in QWEN_SHIPPED:
        dec.set_drafter(drafter_kind(label), drafter_path=str(shipped_checkpoint(label, QWEN)),
                        tree=TreeConfig(depth=3, topk=2, total_tokens=4))
        for i, ref in enumerate(plain):
            g = dec.generate(ref.prompt_ids, cfg)
            assert_same_or_near_tie(dec.target, ref.prompt_ids, ref.token_ids, g.token_ids, f"{label} prompt {i}")
