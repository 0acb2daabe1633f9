"""Token Recycling (moaspec.drafters.recycling): the table it learns from the target's own top-k, the
best-first trees it proposes, and greedy output identical to plain on the real SmolLM2 target, alone
and paired with the suffix drafter."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_same_or_near_tie
from prompts import PROMPTS

from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.target import Candidates, LocalTarget
from moaspec.decoding.tree import AdaptiveChain, TreeConfig
from moaspec.drafters import build_drafter
from moaspec.drafters.recycling import RecyclingDrafter

COSTS = {1: 10.0, 2: 10.0, 4: 10.5, 8: 12.0}


def test_the_table_holds_the_latest_candidates_and_drafts_best_first():
    d = RecyclingDrafter(k=3)
    d.observe([5, 6], Candidates([5, 6, 7], torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]),
                                 torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])))
    d.observe([1], Candidates([1], torch.tensor([[7, 8, 9]]), torch.tensor([[0.9, 0.05, 0.05]])))
    d.observe([2], Candidates([2], torch.tensor([[6, 3, 4]]), torch.tensor([[0.8, 0.1, 0.1]])))
    d.observe([5], Candidates([5], torch.tensor([[1, 2, 3]]), torch.tensor([[0.6, 0.3, 0.1]])))
    assert d.table[2] == ([6, 3, 4], pytest.approx([0.8, 0.1, 0.1]))  # the latest pass wins
    chain = d.propose(5, TreeConfig(3, 1, 3))
    assert chain.tokens == [5, 1, 7, 7] and chain.parents == [-1, 0, 1, 2]  # follows the best candidate
    tree = d.propose(5, TreeConfig(3, 2, 4))
    # by path probability: 1 (0.6), its child 7 (0.54), that one's 7 (0.486), then the root's 2 (0.3)
    assert tree.tokens == [5, 1, 7, 7, 2] and tree.parents == [-1, 0, 1, 2, 0]
    assert tree.scores[2] == pytest.approx(math.log(0.6 * 0.9), rel=1e-5)
    assert d.propose(42, TreeConfig(3, 2, 4)).tokens == [42]  # a token never seen: no draft
    assert d.propose(5, TreeConfig(1, 2, 6)).tokens == [5, 1, 2]  # depth and width bound the tree


def test_a_local_target_reports_the_candidates_it_scored(dec_none):
    target = LocalTarget(dec_none.target, candidates=4)
    step = target.start([1, 2, 3, 4, 5], dec_none.engine.target.params)
    assert isinstance(step.context, Candidates) and step.context.tokens == [5]
    assert step.context.ids[0, 0].item() == step.verdict.bonus  # greedy: the top candidate is the token
    assert LocalTarget(dec_none.target, encoder=object(), candidates=4).candidates == 0  # an encoder's context wins


@pytest.mark.parametrize("name,tree", [("recycling", TreeConfig.parse("adaptive:6x2")),
                                       ("recycling", TreeConfig(4, 2, 6)),
                                       ("hybrid", TreeConfig.parse("adaptive:6"))])
def test_greedy_output_equals_plain(dec_none, plain_greedy, name, tree):
    drafter = build_drafter(name, dec_none.model_name, dec_none.target, hybrid_model="recycling")
    adapt = AdaptiveChain(COSTS, tree.depth, width=tree.topk) if tree.adaptive else None
    engine = Engine(LocalTarget(dec_none.target, drafter.encoder, candidates=drafter.candidates), drafter, tree, adapt)
    taus = []
    for prompt in (PROMPTS[0], PROMPTS[9], PROMPTS[0]):
        prompt_ids, plain = plain_greedy(prompt, 48)
        got = [t for chunk in engine.stream(prompt_ids, GenerationConfig(max_new_tokens=48)) for t in chunk.tokens]
        assert_same_or_near_tie(dec_none.target, prompt_ids, plain, got, f"{name}/{tree.label()}")
        taus.append(engine.metrics.tau)
    # drafts are accepted; the table the first answer left drafts its repetition better than it drafted it
    assert min(taus) > 1.1 and taus[-1] > taus[0], taus


def test_the_pipeline_asks_the_target_for_candidates():
    from moaspec.pipeline import SpecDecoder

    dec = SpecDecoder("smollm2-135m", drafter="recycling", weights="int8")
    assert dec.engine.target.candidates == dec.drafter.candidates == 8
    ids = dec.tokenizer.encode("def fib(n):")
    plain = SpecDecoder("smollm2-135m", drafter="none", weights="int8")
    cfg = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    assert dec.generate(ids, cfg).token_ids == plain.generate(ids, cfg).token_ids  # int8: token-identical
