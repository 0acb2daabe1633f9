"""The suffix drafter (drafters/suffix.py) and the hybrid of a free and a model drafter (drafters/hybrid.py):
index counts against brute force, drafting behaviour, tree shapes, scores, the history of earlier outputs,
the hybrid's policies on stub drafters, and greedy losslessness end to end on SmolLM2 (with the shipped
MoA checkpoint as the hybrid's model part)."""

from __future__ import annotations

import math
import random
import statistics
import time

import pytest
import torch
from conftest import assert_same_or_near_tie
from prompts import PROMPTS

from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import AdaptiveChain, DraftDist, Tree, TreeConfig
from moaspec.drafters import build_drafter
from moaspec.drafters.hybrid import EXPLORE_EVERY, HybridDrafter
from moaspec.drafters.suffix import SuffixDrafter, SuffixIndex
from moaspec.errors import UserError

CHAIN3 = TreeConfig(3, 1, 3)


def _occurrences(seqs: list[list[int]], s: list[int]) -> tuple[int, dict[int, int]]:
    n, nxt = 0, {}
    for q in seqs:
        for e in range(len(s) - 1, len(q)):
            if q[e - len(s) + 1:e + 1] == s:
                n += 1
                if e + 1 < len(q):
                    nxt[q[e + 1]] = nxt.get(q[e + 1], 0) + 1
    return n, nxt


def _count(index: SuffixIndex, s: list[int]):
    """(node, occurrences of s) read off the index: a leaf's one occurrence continues in its token list."""
    node = index.root
    for i, t in enumerate(s):
        if node.children is None:
            p = node.pos + i - node.depth + 1
            if p >= len(node.seq) or node.seq[p] != t:
                return None, 0
            continue
        node = node.children.get(t)
        if node is None:
            return None, 0
    return node, node.count if node.depth == len(s) else 1


def _check_index(index: SuffixIndex, seqs: list[list[int]]) -> None:
    subs = {tuple(q[i:i + n]) for q in seqs for i in range(len(q)) for n in range(1, index.max_depth + 1)
            if i + n <= len(q)}
    for s in map(list, subs):
        n, nxt = _occurrences(seqs, s)
        node, count = _count(index, s)
        assert count == n, (s, count, n)
        if node is not None and node.depth == len(s) and node.children is not None:
            assert {t: c.count for t, c in node.children.items()} == nxt, s
            assert node.total == sum(nxt.values()), s


def test_index_counts_match_brute_force():
    """Random texts over a tiny vocabulary (many repeats), extended in chunks, several sequences, some
    removed again: every substring's count and continuation counts are exact."""
    rng = random.Random(0)
    for _ in range(60):
        index = SuffixIndex(rng.choice([2, 3, 5, 8]))
        vocab = rng.choice([2, 3, 5])
        seqs: list[list[int]] = []
        for _ in range(rng.randint(1, 4)):
            seq: list[int] = []
            active: list = []
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            for i in range(0, len(tokens), 4):
                active = index.extend(seq, active, tokens[i:i + 4])
            seqs.append(seq)
        _check_index(index, seqs)
        while seqs and rng.random() < 0.7:
            index.remove(seqs.pop(rng.randrange(len(seqs))))
            _check_index(index, seqs)


def test_proposes_the_continuation_it_saw():
    d = SuffixDrafter()
    d.begin([7, 1, 2, 3, 4, 5, 6, 9, 8, 1, 2])
    tree = d.propose(3, TreeConfig(3, 1, 3))
    assert tree.tokens == [3, 4, 5, 6] and tree.parents == [-1, 0, 1, 2]
    assert d.last.match_len == 3 and d.last.probs == [1.0, 1.0, 1.0]
    d.observe([3, 4])  # the target took one draft: the index follows
    assert d.propose(5, TreeConfig(3, 1, 3)).tokens == [5, 6, 9, 8]
    # a 1-token match drafts at most 1 token (spec_factor 1): short matches are weak evidence
    d.begin([5, 1, 2, 3, 9])
    assert d.propose(5, TreeConfig(3, 1, 3)).tokens == [5, 1]
    assert d.propose(4, CHAIN3).tokens == [4]  # never seen: nothing to draft


def test_most_frequent_continuation_wins_and_scores_are_path_probabilities():
    d = SuffixDrafter(min_prob=0.0)
    # after "1 2": 3 three times, 4 once; after "1 2 3": 5 twice, 6 once
    d.begin([1, 2, 3, 5, 0, 1, 2, 3, 5, 0, 1, 2, 4, 0, 1, 2, 3, 6, 0, 1])
    tree = d.propose(2, TreeConfig(2, 1, 2))
    assert tree.tokens == [2, 3, 5]
    probs = [math.exp(s) for s in tree.scores[1:]]
    assert probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3]) == d.last.probs
    assert d.last.score == pytest.approx(sum(probs))
    tree = d.propose(2, TreeConfig(2, 2, 4))  # a tree: the runner-up children too
    assert sorted(tree.tokens[1:]) == [3, 4, 5, 6]
    for i in range(1, len(tree)):
        p = math.exp(tree.scores[i])
        assert 0 < p <= 1 and p <= math.exp(tree.scores[tree.parents[i]]) + 1e-12
    assert sum(math.exp(s) for s in tree.scores[1:]) == pytest.approx(d.last.score)


def test_min_prob_cuts_unlikely_paths():
    text = [1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 5, 9, 1]  # after "1 2": 3, 4 and 5, a third each
    d = SuffixDrafter(min_prob=0.5)
    d.begin(text)
    assert d.propose(2, TreeConfig(3, 3, 3)).tokens == [2]
    d = SuffixDrafter(min_prob=0.3)
    d.begin(text)
    assert sorted(d.propose(2, TreeConfig(3, 3, 3)).tokens[1:]) == [3, 4, 5]


@pytest.mark.parametrize("cfg", [TreeConfig(1, 1, 1), TreeConfig(4, 1, 4), TreeConfig(3, 2, 4), TreeConfig(5, 3, 6),
                                 TreeConfig(2, 4, 8)])
def test_respects_the_tree_shape(cfg):
    rng = random.Random(1)
    text = [rng.randrange(4) for _ in range(400)]  # many repeats: bushy continuations
    d = SuffixDrafter(spec_factor=8, min_prob=0.0)
    d.begin(text)
    for root in range(4):
        tree = d.propose(root, cfg)
        assert len(tree) - 1 <= cfg.total_tokens and max(tree.depths) <= cfg.depth
        assert all(len(c) <= cfg.topk for c in tree.children)
        assert all(len({tree.tokens[c] for c in kids}) == len(kids) for kids in tree.children)


def test_remembers_an_earlier_generation():
    d = SuffixDrafter()
    answer = [40, 41, 42, 43, 44, 45, 46]
    d.begin([1, 2, 3])
    d.observe([40, 41, 42, 43])
    d.observe([44, 45, 46])
    d.begin([9, 8, 7])  # a new generation: the last one's output is now history
    assert d.outputs[-1] == answer and d.cached == len(answer)
    assert d.propose(40, CHAIN3).tokens == [40, 41]  # one token matched: one drafted
    d.observe([40, 41])
    assert d.propose(42, CHAIN3).tokens == [42, 43, 44, 45]
    # the current text wins ties with history, and history follows the text across rounds
    d.observe([42, 43, 50])
    assert d.propose(51, CHAIN3).tokens == [51]


def test_history_is_bounded():
    d = SuffixDrafter(cache_tokens=10)
    for g in range(5):
        d.begin([1000 + g])
        d.observe([100 * g + i for i in range(4)])
    d.begin([0])
    assert d.cached <= 10 and list(d.outputs) == [[300, 301, 302, 303], [400, 401, 402, 403]]
    assert 200 not in d.history.root.children and 300 in d.history.root.children
    with pytest.raises(UserError):
        SuffixDrafter(min_prob=2.0)


def test_propose_and_observe_are_cheap():
    """Tens of microseconds at 4k tokens of context (ample margin here: the machine is shared)."""
    rng = random.Random(2)
    words = [[rng.randrange(5000) for _ in range(rng.randint(1, 4))] for _ in range(300)]
    text = [t for _ in range(1500) for t in rng.choice(words)][:4096]
    d = SuffixDrafter()
    t = time.perf_counter()
    d.begin(text[:3500])
    begin_s = time.perf_counter() - t
    times = []
    i = 3500
    while i < len(text) - 1:
        t = time.perf_counter()
        tree = d.propose(text[i], TreeConfig(4, 1, 4))
        n = next((k for k, tok in enumerate(tree.tokens[1:]) if tok != text[i + 1 + k]), len(tree) - 1)
        d.observe(text[i:i + 1 + n])
        times.append(time.perf_counter() - t)
        i += 1 + n
    print(f"\nbegin 3500 tokens {begin_s * 1e3:.1f} ms; propose+observe median {statistics.median(times) * 1e6:.0f} us")
    assert statistics.median(times) < 1e-3 and begin_s < 0.5


# ----------------------------------------------------------------------------- hybrid on stub drafters
class StubModel:
    """A model drafter that always drafts `chain` (or `tree`) and records what it was shown."""

    name = "stub"

    def __init__(self, chain=(), tree: Tree | None = None):
        self.chain, self.tree = list(chain), tree
        self.encoder = object()
        self.seen: list[int] = []
        self.contexts: list = []
        self.proposals = 0

    def begin(self, prompt, context=None):
        self.seen = list(prompt)
        self.contexts = [context]

    def observe(self, tokens, context=None):
        self.seen += tokens
        self.contexts.append(context)

    def propose(self, root, cfg):
        self.proposals += 1
        if self.tree is not None:
            return self.tree
        n = min(cfg.depth, len(self.chain))
        return Tree([root, *self.chain[:n]], [-1, *range(n)], [0.0, *(math.log(0.5) * (i + 1) for i in range(n))])


def test_hybrid_switch_takes_the_free_draft_when_it_is_worth_more():
    model = StubModel([90, 91, 92])
    h = HybridDrafter(SuffixDrafter(), model)
    assert h.encoder is model.encoder
    h.begin([1, 2, 3, 4, 5, 6, 1, 2], context="ctx")
    assert h.propose(3, CHAIN3).tokens == [3, 4, 5, 6]  # a sure copy beats the model's 0.5-probability chain
    h.observe([3, 4, 5], context="c1")
    assert h.propose(77, CHAIN3).tokens == [77, 90, 91, 92]  # nothing to copy: the model drafts
    h.observe([77], context="c2")
    # the model drafter was kept up to date in every round, its own or not, and got the target's context
    assert model.seen == [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 77] and model.contexts == ["ctx", "c1", "c2"]
    assert h.rounds["free"] == 1 and h.rounds["model"] == 1 and model.proposals == 1
    assert h.calibration["model"].hits == 0 and h.calibration["free"].hits > 0


def test_hybrid_switch_drafts_nothing_where_the_model_does_not_pay():
    """No free draft and a model whose drafts are rarely accepted for what its steps cost: the round is
    a plain step, except every EXPLORE_EVERY-th, where the model drafts to keep its acceptance measured."""
    model = StubModel([90, 91, 92])
    h = HybridDrafter(SuffixDrafter(), model)
    h.begin([1, 2, 3])
    for _ in range(30):
        h.model_rates.update({1: False})
    trees = []
    for i in range(2 * EXPLORE_EVERY):
        h.verify_ms, h.step_ms = 10.0, 4.0  # as measured on a CPU (these stubs take microseconds)
        trees.append(h.propose(50 + i, CHAIN3))  # tokens never seen: nothing to copy
        h.observe([50 + i])
    assert sum(len(t) > 1 for t in trees) == 2 and model.proposals == 2
    assert h.rounds["none"] == 2 * EXPLORE_EVERY - 2
    h.model_rates = type(h.model_rates)()  # no evidence against the model: it drafts
    h.verify_ms, h.step_ms = 10.0, 4.0
    assert len(h.propose(7, CHAIN3)) > 1
    h.observe([7])
    # unless the rows it adds to the verification cost more than its expected tokens bring
    h.set_row_costs({1: 10.0, 2: 15.0, 4: 25.0})
    h.model_rates = type(h.model_rates)()
    h.verify_ms, h.step_ms = 10.0, 0.5
    assert len(h.propose(8, CHAIN3)) == 1


def test_hybrid_merge_fits_both_drafts_in_the_budget():
    model = StubModel([90, 91, 92])
    h = HybridDrafter(SuffixDrafter(), model, policy="merge")
    h.begin([1, 2, 3, 4, 5, 6, 1, 2])
    tree = h.propose(3, TreeConfig(3, 2, 5))
    assert len(tree) == 6 and sorted(tree.tokens[1:]) == [4, 5, 6, 90, 91]  # the likeliest 5 of the 6
    assert all(p < i for i, p in enumerate(tree.parents) if i)
    assert tree.children[0] == [1, 2] and h.rounds["both"] == 1
    h.observe([3, 4, 5, 6])
    # a chain budget of 3 that the free chain fills with sure tokens: the model is not even asked
    tree = h.propose(1, CHAIN3)
    assert tree.tokens == [1, 2, 3, 4] and model.proposals == 1


def test_hybrid_merge_keeps_sampled_model_children_whole_and_alone():
    """A sampled parent's children are the drafter's own draws: all kept, in draw order, no free sibling."""
    dist = DraftDist((90, 91, 4), (0.5, 0.3, 0.2))
    sampled = Tree([3, 91, 90, 95], [-1, 0, 0, 2], [0.0, math.log(0.3), math.log(0.5), math.log(0.1)], {0: dist})
    h = HybridDrafter(SuffixDrafter(), StubModel(tree=sampled), policy="merge")
    h.begin([1, 2, 3, 4, 5, 6, 1, 2])
    tree = h.propose(3, TreeConfig(3, 2, 4))
    assert tree.dists == {0: dist}
    assert [tree.tokens[c] for c in tree.children[0]] == [91, 90]  # no free 4 beside the draws, order kept
    assert 95 in tree.tokens and len(tree) == 4


def test_hybrid_rejects_unknown_parts(dec_none):
    with pytest.raises(UserError, match="policy"):
        HybridDrafter(SuffixDrafter(), StubModel(), policy="both")
    with pytest.raises(UserError, match="pairs the suffix drafter"):
        build_drafter("hybrid", dec_none.model_name, dec_none.target, hybrid_model="lookup")


# ----------------------------------------------------------------------------- end to end: lossless
ADAPTIVE = TreeConfig.parse("adaptive:6")
COSTS = {1: 10.0, 2: 10.0, 4: 10.5, 8: 12.0}


def _engine(dec, name: str, tree: TreeConfig, policy: str = "switch") -> Engine:
    drafter = build_drafter(name, dec.model_name, dec.target, hybrid_policy=policy)
    adapt = AdaptiveChain(COSTS, tree.depth) if tree.adaptive else None
    defer = getattr(drafter, "defers_context", False)  # as SpecDecoder builds it
    return Engine(LocalTarget(dec.target, drafter.encoder, defer_context=defer), drafter, tree, adapt)


@pytest.mark.parametrize("name,policy,tree", [
    ("suffix", "switch", ADAPTIVE),
    ("suffix", "switch", TreeConfig(4, 2, 6)),
    ("hybrid", "switch", ADAPTIVE),
    ("hybrid", "merge", ADAPTIVE),
    ("hybrid", "merge", TreeConfig(3, 2, 4)),
])
def test_greedy_output_equals_plain(dec_none, plain_greedy, name, policy, tree):
    engine = _engine(dec_none, name, tree, policy)
    prompts = [PROMPTS[0], PROMPTS[20], PROMPTS[9], PROMPTS[0]]  # the last one again: history drafts it
    taus = []
    for prompt in prompts:
        prompt_ids, plain = plain_greedy(prompt, 48)
        got = [t for chunk in engine.stream(prompt_ids, GenerationConfig(max_new_tokens=48)) for t in chunk.tokens]
        assert_same_or_near_tie(dec_none.target, prompt_ids, plain, got, f"{name}/{policy}/{tree.label()}")
        taus.append(engine.metrics.tau)
    assert taus[-1] > 2.5 and taus[-1] > taus[0], taus  # the earlier answer to the same prompt is remembered
    if name == "hybrid":
        rounds = engine.drafter.rounds
        assert rounds["free"] + rounds["both"] > 0 and rounds["model"] + rounds["both"] > 0, rounds


def _hybrid_query_state(dec) -> HybridDrafter:
    """The hybrid with the shipped MoA given the query-state route (random small weights), so that its
    encoder reads the target's final states."""
    import dataclasses

    from moaspec.drafters import moa

    base = build_drafter("moa", dec.model_name, dec.target)
    qs = moa.MoADrafter.from_target(dec.target, dataclasses.replace(base.cfg, query_state=True))
    assert set(qs.load_state_dict(base.state_dict(), strict=False).missing_keys) == {"state_proj.weight"}
    torch.manual_seed(0)
    torch.nn.init.normal_(qs.state_proj.weight, std=0.002)
    return HybridDrafter(SuffixDrafter(), qs.eval())


@pytest.mark.parametrize("query_state", [False, True])
def test_deferred_context_is_the_eager_one(dec_none, smol_tokenizer, query_state):
    """What a local target defers for the hybrid's MoA is what it would have sent: after the same text
    (rounds of both sources, deferred contexts encoded in batches, with the final states' rows where the
    encoder reads them) MoA's Cross-Attention cache and query state are the same; and a deferred context
    refuses to outlive its cache slots. A hybrid over EAGLE-2 (no `catch_up`) is sent its context eagerly."""
    from conftest import chat_ids

    assert not build_drafter("hybrid", dec_none.model_name, dec_none.target, hybrid_model="eagle").defers_context
    ids = chat_ids(smol_tokenizer, PROMPTS[0])
    got = []
    for defer in (False, True):
        drafter = _hybrid_query_state(dec_none) if query_state else \
            build_drafter("hybrid", dec_none.model_name, dec_none.target)
        assert drafter.defers_context and bool(drafter.encoder.hidden_layers) == query_state
        engine = Engine(LocalTarget(dec_none.target, drafter.encoder, defer_context=defer), drafter,
                        TreeConfig(3, 1, 3))
        for _ in range(2):  # the second time the suffix drafter copies the first answer
            out = [t for c in engine.stream(ids, GenerationConfig(max_new_tokens=40)) for t in c.tokens]
        moa_drafter = drafter.model
        assert bool(moa_drafter.deferred) == defer
        moa_drafter.catch_up()
        n = moa_drafter.ctx_len
        got.append((out, n, moa_drafter.ca_cache.k[:, :, :n].clone(), moa_drafter.ca_cache.v[:, :, :n].clone(),
                    moa_drafter.state_vec))
        assert drafter.rounds["free"] > 0 and drafter.rounds["model"] > 0, drafter.rounds
    (out0, n0, k0, v0, s0), (out1, n1, k1, v1, s1) = got
    assert out0 == out1 and n0 == n1 == len(ids) + len(out0) - 1
    assert torch.allclose(k0, k1, atol=1e-4) and torch.allclose(v0, v1, atol=1e-4)
    assert (s0 is None and s1 is None) if not query_state else torch.allclose(s0, s1, atol=1e-5)

    target = LocalTarget(dec_none.target, drafter.model.encoder, defer_context=True)
    ctx = target.start(ids, SamplingParams()).context
    assert len(ctx) == len(ids)
    target.start(ids[:5], SamplingParams())
    with pytest.raises(RuntimeError, match="outlived"):
        ctx.resolve()


@pytest.mark.parametrize("policy", ["switch", "merge"])
def test_hybrid_samples_with_the_model_drafter(dec_none, smol_tokenizer, policy):
    """T > 0: the model's sampled children (with their q) pass through both policies into valid trees."""
    from conftest import chat_ids


    engine = _engine(dec_none, "hybrid", TreeConfig(3, 2, 4), policy)
    cfg = GenerationConfig(max_new_tokens=32, sampling=SamplingParams(temperature=0.8, seed=3))
    chunks = list(engine.stream(chat_ids(smol_tokenizer, PROMPTS[3]), cfg))
    assert sum(len(c.tokens) for c in chunks) == 32 or chunks[-1].finish_reason == "stop"
    assert engine.drafter.rounds["model"] + engine.drafter.rounds["both"] > 0


def test_cli_runs_the_new_drafters(capsys):
    import json

    from moaspec import cli

    for argv in (["--drafter", "suffix"], ["--drafter", "hybrid", "--hybrid-policy", "merge"]):
        code = cli.main(["generate", "--model", "smollm2-135m", "--prompt", "Name three colours.", "--max-new-tokens",
                         "8", "--json", "--depth", "3", "--topk", "1", "--total-tokens", "3", *argv])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert json.loads(out)["drafter"] == argv[1]


def test_bench_methods(tmp_path):
    from moaspec.bench.suite import BenchConfig, resolve_methods

    methods, _ = resolve_methods(BenchConfig(model="smollm2-135m", methods=("suffix", "hybrid", "hybrid-merge")))
    got = {m.name: (m.drafter, m.policy, m.path is not None) for m in methods}
    assert got == {"plain": ("none", "switch", False), "suffix": ("suffix", "switch", False),
                   "hybrid": ("hybrid", "switch", True), "hybrid-merge": ("hybrid", "merge", True)}
    with pytest.raises(UserError, match="moa checkpoint"):
        resolve_methods(BenchConfig(model="smollm2-135m", methods=("hybrid",), checkpoints=str(tmp_path)))
