"""Draft trees: the Tree data structure, EAGLE-2 growth (grow_tree) and the prompt-lookup drafter."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from moaspec.decoding.sampling import SamplingParams, target_probs
from moaspec.decoding.tree import (
    MAX_DEPTH,
    MAX_TOPK,
    MAX_TREE_TOKENS,
    PAPER_GPU_TREE,
    AdaptiveChain,
    DraftSampling,
    SampledTreeConfig,
    Tree,
    TreeConfig,
    _children_per_node,
    grow_tree,
    tree_for_costs,
)
from moaspec.drafters.lookup import LookupDrafter
from moaspec.errors import UserError
from moaspec.pipeline import plausible_costs


# --------------------------------------------------------------------------- Tree
def _hand_tree() -> Tree:
    #        0
    #      /   \
    #     1     2
    #    / \
    #   3   4
    #   |
    #   5
    return Tree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 3])


def test_tree_structure():
    t = _hand_tree()
    assert len(t) == 6
    assert t.depths == [0, 1, 1, 2, 2, 3]
    assert t.children == [[1, 2], [3, 4], [], [5], [], []]
    assert t.scores == [0.0] * 6


def test_tree_mask():
    ancestors_or_self = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 1, 3, 5}}
    expected = torch.tensor([[j in ancestors_or_self[i] for j in range(6)] for i in range(6)])
    m = _hand_tree().mask()
    assert m.dtype == torch.bool and m.shape == (6, 6)
    assert torch.equal(m, expected)


def test_tree_positions_and_paths():
    t = _hand_tree()
    assert t.positions(7).tolist() == [7, 8, 8, 9, 9, 10]
    assert t.positions(0).dtype == torch.long
    assert t.path_to(0) == [0]
    assert t.path_to(2) == [0, 2]
    assert t.path_to(4) == [0, 1, 4]
    assert t.path_to(5) == [0, 1, 3, 5]


def test_chain():
    t = Tree.chain(5, [6, 7, 8])
    assert t.tokens == [5, 6, 7, 8] and t.parents == [-1, 0, 1, 2]
    assert t.path_to(3) == [0, 1, 2, 3]
    assert torch.equal(t.mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert len(Tree.chain(5)) == 1


@pytest.mark.parametrize("parents", [[-1, 2, 0], [-1, 1], [-1, -1], [-1, 0, 3, 1]], ids=str)
def test_tree_rejects_parent_not_before_child(parents):
    with pytest.raises(ValueError):
        Tree(list(range(len(parents))), parents)


BAD_SHAPES = {
    "depth -1": ({"depth": -1}, "depth"), "depth 0": ({"depth": 0}, "depth"),
    "depth over max": ({"depth": MAX_DEPTH + 1, "total_tokens": MAX_DEPTH + 1}, "depth"),
    "topk 0": ({"topk": 0}, "topk"), "topk over max": ({"topk": MAX_TOPK + 1}, "topk"),
    "total -1": ({"total_tokens": -1}, "total_tokens"), "total 0": ({"total_tokens": 0}, "total_tokens"),
    "total over max": ({"total_tokens": MAX_TREE_TOKENS + 1}, "total_tokens"),
    "total below depth": ({"depth": 5, "total_tokens": 4}, "total_tokens >= 5"),
    "float depth": ({"depth": 2.5}, "depth"), "bool topk": ({"topk": True}, "topk"),
    "huge": ({"depth": 50, "topk": 1000, "total_tokens": 100000}, "depth"),
    "min_prob 1": ({"min_prob": 1.0}, "min_prob"), "min_prob -0.1": ({"min_prob": -0.1}, "min_prob"),
    "min_prob nan": ({"min_prob": float("nan")}, "min_prob"), "min_prob str": ({"min_prob": "0.2"}, "min_prob"),
}


@pytest.mark.parametrize("kw,says", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
def test_tree_config_validation(kw, says):
    with pytest.raises(UserError, match=says):
        TreeConfig(**kw)
    with pytest.raises(UserError, match=says):  # the sampled shape is checked the same way
        SampledTreeConfig(**kw, sampling=DraftSampling(SamplingParams(temperature=1.0), seed=0))


def test_tree_config_bounds_are_inclusive():
    for cfg in (TreeConfig(1, 1, 1), TreeConfig(MAX_DEPTH, MAX_TOPK, MAX_TREE_TOKENS), TreeConfig(3, 1, 3),
                TreeConfig(MAX_DEPTH, 1, MAX_DEPTH, adaptive=True), PAPER_GPU_TREE, TreeConfig()):
        assert TreeConfig.parse(f"{cfg.depth},{cfg.topk},{cfg.total_tokens}").depth == cfg.depth
    assert TreeConfig.parse(f"adaptive:{MAX_DEPTH}").depth == MAX_DEPTH
    for text in ("adaptive:0", f"adaptive:{MAX_DEPTH + 1}", "0,1,0", "4,0,6", f"2,2,{MAX_TREE_TOKENS + 1}", "6,4,5"):
        with pytest.raises(UserError):
            TreeConfig.parse(text)


# --------------------------------------------------------------------------- grow_tree
V = 7  # a tiny drafter vocabulary


def _logprobs(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed, arbitrary next-token distribution for each path of drafter-vocab indices."""
    g = torch.Generator().manual_seed(hash((12345, *path)) % (2**31))
    return torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2.0, -1).float()


class SyntheticDrafter:
    """expand() for grow_tree: looks up `_logprobs` of each frontier node's path; records its calls."""

    def __init__(self, vocab: torch.Tensor | None = None):
        self.inverse = None if vocab is None else {int(t): i for i, t in enumerate(vocab)}
        self.calls: list[list[int]] = []

    def path(self, tree: Tree, node: int) -> tuple[int, ...]:
        toks = [tree.tokens[i] for i in tree.path_to(node)[1:]]
        return tuple(toks if self.inverse is None else [self.inverse[t] for t in toks])

    def __call__(self, tree: Tree, frontier: list[int]) -> torch.Tensor:
        assert frontier and all(0 < f < len(tree) for f in frontier)
        self.calls.append(list(frontier))
        return torch.stack([_logprobs(self.path(tree, f)) for f in frontier])


def _reference_candidates(cfg: TreeConfig) -> dict[tuple[int, ...], float]:
    """EAGLE-2 expansion written out independently: all candidate paths with cumulative log-probs."""
    k = min(cfg.topk, V)
    lp = _logprobs(()).double()
    top = lp.topk(k)
    frontier = {(int(i),): float(v) for v, i in zip(top.values, top.indices, strict=True)}
    cands = dict(frontier)
    for _ in range(1, cfg.depth):
        new = {}
        for path, score in frontier.items():
            top = (_logprobs(path).double() + score).topk(k)
            new.update({(*path, int(i)): float(v) for v, i in zip(top.values, top.indices, strict=True)})
        cands.update(new)
        frontier = dict(sorted(new.items(), key=lambda kv: -kv[1])[:k])
    return cands


CONFIGS = [
    TreeConfig(depth=1, topk=3, total_tokens=2),
    TreeConfig(depth=3, topk=2, total_tokens=5),
    TreeConfig(depth=4, topk=3, total_tokens=10),
    TreeConfig(depth=4, topk=4, total_tokens=6),
    TreeConfig(depth=5, topk=2, total_tokens=100),  # more room than candidates: keep them all
    TreeConfig(depth=3, topk=10, total_tokens=8),  # topk larger than the vocabulary
    TreeConfig(depth=6, topk=1, total_tokens=6),  # a chain
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.depth}k{c.topk}n{c.total_tokens}")
def test_grow_tree_shape_and_selection(cfg):
    root = 3
    drafter = SyntheticDrafter()
    tree = grow_tree(root, _logprobs(()), drafter, cfg)
    k = min(cfg.topk, V)

    assert tree.tokens[0] == root and tree.parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(tree.parents) if i)  # parents before children
    assert max(tree.depths) <= cfg.depth
    assert len(tree) - 1 <= cfg.total_tokens
    assert all(len(c) <= k for c in tree.children)
    for node in range(len(tree)):  # siblings are distinct tokens
        kids = [tree.tokens[c] for c in tree.children[node]]
        assert len(kids) == len(set(kids))
    # the expansion: depth-1 calls, each with at most k frontier nodes
    assert len(drafter.calls) == cfg.depth - 1
    assert all(1 <= len(f) <= k for f in drafter.calls)

    # scores are the cumulative log-probs along each path
    paths = {node: drafter.path(tree, node) for node in range(1, len(tree))}
    for node, path in paths.items():
        expected = sum(float(_logprobs(path[:i])[path[i]]) for i in range(len(path)))
        assert tree.scores[node] == pytest.approx(expected, abs=1e-4)

    # the kept set is exactly the top-`total_tokens` candidates by cumulative score
    cands = _reference_candidates(cfg)
    best = sorted(cands, key=lambda p: -cands[p])[: cfg.total_tokens]
    assert sorted(paths.values()) == sorted(best)
    assert len(tree) - 1 == min(cfg.total_tokens, len(cands))


@pytest.mark.parametrize("min_prob", [0.5, 0.2, 0.05, 0.01, 1e-4])
@pytest.mark.parametrize("topk", [1, 3])
def test_grow_tree_stops_below_min_prob(min_prob, topk):
    """EAGLE-2's confidence stop: a draft step runs only while the likeliest frontier path is at or above
    min_prob; what was drafted before the stop is the tree without a stop, cut at that depth."""
    cfg = TreeConfig(depth=6, topk=topk, total_tokens=100)  # every candidate kept: the cut is a prefix
    full = grow_tree(3, _logprobs(()), SyntheticDrafter(), cfg)
    drafter = SyntheticDrafter()
    cut = grow_tree(3, _logprobs(()), drafter, replace(cfg, min_prob=min_prob))
    steps = len(drafter.calls) + 1  # the root's distribution is the first step
    for d in range(1, steps):  # every expansion was made from a frontier path at or above min_prob
        assert max(s for s, dep in zip(full.scores, full.depths, strict=True) if dep == d) >= math.log(min_prob)
    if steps < cfg.depth:  # and the stop came where the best path fell below it
        assert max(s for s, dep in zip(full.scores, full.depths, strict=True) if dep == steps) < math.log(min_prob)
    assert max(cut.depths) == steps
    kept = {drafter.path(cut, n) for n in range(1, len(cut))}
    assert kept == {drafter.path(full, n) for n in range(1, len(full)) if full.depths[n] <= steps}
    assert TreeConfig.parse(f"6,{topk},100@{min_prob}") == replace(cfg, min_prob=min_prob)


def test_grow_tree_vocab_map():
    """A trimmed drafter vocabulary: indices are mapped to target ids; the structure is unchanged."""
    vocab = torch.tensor([101, 57, 230, 14, 999, 3, 77])
    cfg = TreeConfig(depth=4, topk=3, total_tokens=9)
    plain = grow_tree(5, _logprobs(()), SyntheticDrafter(), cfg)
    mapped = grow_tree(5, _logprobs(()), SyntheticDrafter(vocab), cfg, vocab=vocab)
    assert mapped.tokens[0] == 5  # the root is already a target id
    assert mapped.tokens[1:] == [int(vocab[t]) for t in plain.tokens[1:]]
    assert mapped.parents == plain.parents
    assert mapped.scores == pytest.approx(plain.scores)


# --------------------------------------------------------------------------- grow_tree, sampled children
def _sampled(cfg: TreeConfig, seed: int, **kw) -> TreeConfig:
    return cfg.sampled(DraftSampling(SamplingParams(temperature=1.0, **kw), seed))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.depth}k{c.topk}n{c.total_tokens}")
def test_grow_sampled_tree_shape(cfg):
    """Children are distinct draws from their parent's stated q (the drafter's distribution at the
    generation's sampling params), listed in drawing order; depth, top-k and total are kept; no more
    expand calls than EAGLE-2's; scores are cumulative log q; a seed gives one tree."""
    trees = []
    for seed in range(6):
        drafter = SyntheticDrafter()
        tree = grow_tree(3, _logprobs(()), drafter, _sampled(cfg, seed, top_k=5))
        trees.append((tree.tokens, tree.parents))
        assert max(tree.depths) <= cfg.depth and 1 <= len(tree) - 1 <= cfg.total_tokens
        assert all(len(c) <= min(cfg.topk, 5) for c in tree.children)
        assert len(drafter.calls) <= cfg.depth - 1 and all(1 <= len(f) <= cfg.topk for f in drafter.calls)
        assert set(tree.dists) == {n for n in range(len(tree)) if tree.children[n]}
        for node, dist in tree.dists.items():
            path = drafter.path(tree, node)
            q = target_probs(_logprobs(path).topk(5).values, SamplingParams(temperature=DraftSampling.sharpen))
            assert dist.ids == tuple(_logprobs(path).topk(5).indices.tolist())
            assert dist.probs == pytest.approx(q.tolist(), abs=1e-6)
            prob = dict(zip(dist.ids, dist.probs, strict=True))
            for c in tree.children[node]:
                assert tree.scores[c] == pytest.approx(tree.scores[node] + math.log(prob[tree.tokens[c]]), abs=1e-5)
        again = grow_tree(3, _logprobs(()), SyntheticDrafter(), _sampled(cfg, seed, top_k=5))
        assert (again.tokens, again.parents, again.dists) == (tree.tokens, tree.parents, tree.dists)
    assert len(set(map(str, trees))) > 1


@pytest.mark.parametrize("min_prob", [0.8, 0.5, 0.3, 0.005])
def test_grow_sampled_tree_stops_below_min_prob(min_prob):
    """The confidence stop with sampled children: no level is drawn below a best path under min_prob
    (by q), and the levels before the stop are the same draws as without it (same seed)."""
    cfg = TreeConfig(depth=6, topk=3, total_tokens=40)
    for seed in range(5):
        full = grow_tree(3, _logprobs(()), SyntheticDrafter(), _sampled(cfg, seed))
        cut = grow_tree(3, _logprobs(()), SyntheticDrafter(), _sampled(replace(cfg, min_prob=min_prob), seed))
        last = max(cut.depths)
        assert cut.tokens == [t for t, d in zip(full.tokens, full.depths, strict=True) if d <= last]
        if last < max(full.depths):
            assert max(sc for sc, d in zip(cut.scores, cut.depths, strict=True) if d == last) < math.log(min_prob)
        for d in range(1, last):
            assert max(sc for sc, dd in zip(cut.scores, cut.depths, strict=True) if dd == d) >= math.log(min_prob)


def test_grow_sampled_tree_draws_without_replacement_in_order():
    """Root children of a 2-child tree: the first ~ q, the second ~ q without the first, renormalised."""
    cfg, n = TreeConfig(depth=1, topk=2, total_tokens=2), 6000
    q = torch.softmax(_logprobs(()).double() / DraftSampling.sharpen, -1)  # drafted at T x sharpen
    law = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in range(V) for b in range(V) if a != b}
    counts = Counter(tuple(grow_tree(3, _logprobs(()), SyntheticDrafter(), _sampled(cfg, seed)).tokens[1:])
                     for seed in range(n))
    stat = sum((counts[k] - n * v) ** 2 / (n * v) for k, v in law.items())
    assert sum(counts.values()) == n and set(counts) <= set(law)
    assert stat < 75, stat  # chi-square, 41 dof: p = 0.001 at 74.7


def test_children_per_node_follows_confidence():
    """The budget goes deep under a confident q and wide under a flat one, as EAGLE-2's rerank does."""
    confident = torch.tensor([[0.95, 0.05]]).log()
    flat = torch.tensor([[0.5, 0.5]]).log()
    assert _children_per_node([0.0], confident, budget=4, levels=4) == [1]
    assert _children_per_node([0.0], flat, budget=3, levels=4) == [2]
    assert _children_per_node([0.0, -3.0], flat.expand(2, 2), budget=3, levels=2) == [2, 0]
    assert _children_per_node([0.0], torch.tensor([[0.0, float("-inf")]]), budget=3, levels=1) == [1]


def test_grow_sampled_tree_vocab_map():
    vocab = torch.tensor([101, 57, 230, 14, 999, 3, 77])
    cfg = _sampled(TreeConfig(depth=3, topk=2, total_tokens=4), 11)
    plain = grow_tree(5, _logprobs(()), SyntheticDrafter(), cfg)
    mapped = grow_tree(5, _logprobs(()), SyntheticDrafter(vocab), cfg, vocab=vocab)
    assert mapped.tokens[1:] == [int(vocab[t]) for t in plain.tokens[1:]] and mapped.parents == plain.parents
    for node, dist in plain.dists.items():
        assert mapped.dists[node].ids == tuple(int(vocab[t]) for t in dist.ids)


def test_draft_sampling_validation():
    with pytest.raises(UserError):
        DraftSampling(SamplingParams(), seed=0)  # greedy: drafts are the top-k
    with pytest.raises(UserError):
        DraftSampling(SamplingParams(temperature=1.0), seed=0, top_m=0)


# --------------------------------------------------------------------------- LookupDrafter
def _lookup(context: list[int], root: int, cfg: TreeConfig, **kw) -> Tree:
    d = LookupDrafter(**kw)
    d.begin(context[:3])
    d.observe(context[3:])  # the context arrives in two parts, as in a generation
    return d.propose(root, cfg)


def test_lookup_continues_repeated_ngram():
    context = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2]
    tree = _lookup(context, 3, TreeConfig(depth=4, topk=4, total_tokens=10))
    assert tree.tokens == [3, 4, 5, 6, 9] and tree.parents == [-1, 0, 1, 2, 3]


def test_lookup_respects_depth_and_total_tokens():
    context = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2]
    assert _lookup(context, 3, TreeConfig(depth=2, topk=4, total_tokens=10)).tokens == [3, 4, 5]
    assert _lookup(context, 3, TreeConfig(depth=1, topk=4, total_tokens=1)).tokens == [3, 4]
    # two matches of (7, 8): the most recent continuation first, then the older one as a sibling
    context = [7, 8, 1, 2, 0, 7, 8, 3, 4, 0, 5, 7]
    both = _lookup(context, 8, TreeConfig(depth=4, topk=4, total_tokens=10))
    assert both.tokens == [8, 3, 4, 0, 5, 1, 2, 0, 7]
    assert both.parents == [-1, 0, 1, 2, 3, 0, 5, 6, 7]
    assert _lookup(context, 8, TreeConfig(depth=4, topk=1, total_tokens=10)).tokens == [8, 3, 4, 0, 5]
    cut = _lookup(context, 8, TreeConfig(depth=4, topk=4, total_tokens=6))
    assert cut.tokens == [8, 3, 4, 0, 5, 1, 2]


def test_lookup_shares_common_prefixes():
    context = [1, 2, 5, 6, 1, 2, 5, 7, 1]
    tree = _lookup(context, 2, TreeConfig(depth=4, topk=4, total_tokens=10))
    assert tree.tokens == [2, 5, 7, 1, 2, 6, 1, 2]
    assert tree.parents == [-1, 0, 1, 2, 3, 1, 5, 6]


def test_lookup_longest_ngram_wins():
    # (4, 5, 6) occurred once, followed by 7; the single token 6 also occurred followed by 9
    context = [6, 9, 9, 4, 5, 6, 7, 0, 4, 5]
    tree = _lookup(context, 6, TreeConfig(depth=2, topk=4, total_tokens=10))
    assert tree.tokens == [6, 7, 0]


def test_lookup_no_match_gives_root_only():
    assert _lookup([1, 2, 3, 4], 5, TreeConfig()).tokens == [5]
    d = LookupDrafter()
    d.begin([])
    assert d.propose(5, TreeConfig()).tokens == [5]


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.mark.parametrize("seed", range(4))
def test_lookup_random_contexts(seed):
    """On random token streams, every proposal is a valid tree within the limits whose every path
    (root included) was actually seen in the context."""
    rng = random.Random(seed)
    for _ in range(50):
        context = [rng.randrange(6) for _ in range(rng.randrange(0, 60))]
        root = rng.randrange(6)
        depth = rng.randrange(1, 6)
        cfg = TreeConfig(depth=depth, topk=rng.randrange(1, 5), total_tokens=rng.randrange(depth, 12))
        tree = _lookup(context, root, cfg)
        assert tree.tokens[0] == root
        assert len(tree) - 1 <= cfg.total_tokens
        assert max(tree.depths) <= cfg.depth
        leaves = [i for i in range(len(tree)) if not tree.children[i]]
        assert len(tree) == 1 or len(leaves) <= cfg.topk
        for node in range(1, len(tree)):
            path = [tree.tokens[i] for i in tree.path_to(node)]
            assert _contains([*context, root], path), (context, root, path)
        # any earlier occurrence of the root is a 1-gram match with at least one token after it
        assert (len(tree) > 1) == (root in context)


def test_tree_for_costs_gpu_gets_the_paper_tree_cpu_an_adaptive_chain():
    gpu = {1: 10.0, 2: 10.0, 4: 10.1, 8: 10.3, 16: 10.8, 32: 11.5, 64: 12.4}
    assert tree_for_costs(gpu) == PAPER_GPU_TREE
    chain = TreeConfig.parse("adaptive")
    cpu = {1: 78.3, 2: 78.6, 4: 93.0, 8: 189.0, 16: 222.0, 32: 375.0}  # Qwen 0.5B fp32, measured
    assert tree_for_costs(cpu) == chain
    flat_to_8 = {1: 32.1, 2: 33.7, 4: 35.7, 8: 39.4, 16: 66.0, 32: 111.0, 64: 219.9}  # Qwen 0.5B fp16, measured
    assert tree_for_costs(flat_to_8) == chain  # 7 tokens over 6 levels: a chain that pays 6 draft steps
    # ... unless siblings come from the same draft step: then two tokens a level, as deep as acceptance says
    assert tree_for_costs(flat_to_8, branching=True) == TreeConfig.parse("adaptive:8x2")
    steep = {1: 58.1, 2: 63.1, 4: 74.2, 8: 94.9, 16: 154.3, 32: 225.8, 64: 379.3}  # 5 rows 1.37x: a chain
    assert tree_for_costs(steep, branching=True) == tree_for_costs(steep) == chain
    mid = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.5, 16: 14.0, 32: 20.0}
    t = tree_for_costs(mid)
    assert t.total_tokens == 15 and t.depth == 6 and t.topk == 3 and not t.adaptive
    assert tree_for_costs({1: 10.0, 2: 30.0}) == chain
    assert tree_for_costs({1: 41.0, 2: 41.8, 4: 57.4, 8: 114.0}) == chain
    with pytest.raises(ValueError):
        tree_for_costs({4: 1.0})


def test_auto_tree_is_measured_once_and_cached(dec_none, tmp_path, monkeypatch):
    monkeypatch.setenv("MOASPEC_HOME", str(tmp_path))
    assert dec_none.target.pass_costs(ks=(1, 2), reps=1).keys() == {1, 2}
    assert dec_none.target.length == 0  # calibration leaves the cache empty
    calls = []
    gpu = {1: 10.0, 2: 10.0, 4: 10.1, 8: 10.3, 16: 10.8, 32: 11.5, 64: 12.4}
    monkeypatch.setattr(dec_none.target, "pass_costs", lambda: calls.append(1) or dict(gpu))
    assert dec_none.auto_tree() == PAPER_GPU_TREE
    assert dec_none.auto_tree() == PAPER_GPU_TREE and len(calls) == 1
    (tmp_path / "calibration.json").write_text("{not json")
    assert dec_none.auto_tree() == PAPER_GPU_TREE and len(calls) == 2


def test_disturbed_calibration_is_measured_again_and_never_cached(dec_none, tmp_path, monkeypatch):
    """Two threads sharing a core with other work measured SmolLM2's 2-row pass at 30x its 1-row pass;
    such costs are re-measured, not cached, and capped at linear growth if they stay implausible."""
    monkeypatch.setenv("MOASPEC_HOME", str(tmp_path))
    disturbed = {1: 27.0, 2: 798.5, 4: 3211.9, 8: 3488.1}
    calls = []
    monkeypatch.setattr(dec_none.target, "pass_costs", lambda: calls.append(1) or dict(disturbed))
    assert dec_none.pass_costs() == {1: 27.0, 2: 27.0 * 2.5, 4: 27.0 * 2.5 ** 2, 8: 27.0 * 2.5 ** 3}
    assert len(calls) == 2 and not (tmp_path / "calibration.json").exists()
    assert plausible_costs({1: 10.0, 2: 10.0, 4: 11.0, 8: 20.0}) == {1: 10.0, 2: 10.0, 4: 11.0, 8: 20.0}
    with pytest.raises(ValueError, match="implausible"):
        plausible_costs(disturbed)
    slow_single = {1: 79.9, 2: 60.3, 4: 74.1, 8: 133.1}  # a 1-row pass cannot cost more than a 2-row one
    with pytest.raises(ValueError, match="implausible"):
        plausible_costs(slow_single)
    assert plausible_costs(slow_single, clamp=True) == {1: 60.3, 2: 60.3, 4: 74.1, 8: 133.1}


def _drive(chain: AdaptiveChain, calls: int, accept: float, step_ms: float = 1.0, pass_ms: float = 10.0,
           others: int = 0) -> list[int]:
    """Feed `calls` target calls where each draft is accepted with chance `accept` (deterministic
    pattern), each pass carrying `others` rows of other sequences; returns the lengths chosen."""
    chosen, credit = [], 0.0
    for _ in range(calls):
        d = chain.choose()
        chosen.append(d)
        n = 0
        while n < d:
            credit += accept
            if credit < 1:
                break
            credit -= 1
            n += 1
        rows = d * chain.width
        chain.update(d, n, d * step_ms / 1e3, pass_ms * chain.rel[rows + others] / 1e3, rows=rows,
                     pass_rows=rows + 1 + others)
    return chosen


def test_adaptive_chain_follows_acceptance_and_costs():
    flat = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0}  # a GPU-like flat verify cost
    a = AdaptiveChain(flat, max_depth=8)
    assert a.choose() == 3  # nothing measured yet
    assert _drive(a, 30, 1.0)[-1] == 8  # cheap drafts, all accepted: the longest chain
    # nothing accepted: plain steps, and one probe of a level every PROBE_EVERY calls
    idle = _drive(AdaptiveChain(flat, 8), 40, 0.0)
    assert idle[-AdaptiveChain.PROBE_EVERY:].count(1) == 1 and set(idle[-16:]) == {0, 1}
    assert _drive(AdaptiveChain(flat, 8, floor=1), 30, 0.0)[-1] == 1  # floor 1: always one level
    assert _drive(a, 40, 0.0)[-1] <= 1  # the regime changed: it follows within a window of calls
    back = AdaptiveChain(flat, 8)
    _drive(back, 40, 0.0)
    assert _drive(back, 60, 1.0)[-1] == 8  # a text that turns repetitive is found by the probes
    cpu = {1: 10.0, 2: 10.0, 4: 11.0, 8: 40.0}  # rows past 4 get dear, as on this CPU
    assert _drive(AdaptiveChain(cpu, 8), 30, 1.0)[-1] == 3
    # dear draft steps (a draft model a third of the target) need high acceptance to draft long
    assert _drive(AdaptiveChain(flat, 8), 30, 0.5, step_ms=3.3)[-1] <= 2
    with pytest.raises(ValueError):
        AdaptiveChain({2: 1.0})
    for bad in (0, MAX_DEPTH + 1):
        with pytest.raises(ValueError, match="max_depth"):
            AdaptiveChain(flat, max_depth=bad)
    # a drafter may draft past max_depth (a long suffix match) and have it all accepted
    long = AdaptiveChain(flat, max_depth=4)
    long.update(12, 12, 0.001, 0.01)
    assert long.offered[-1] > 0 and 1 <= long.choose() <= 4


def test_adaptive_chain_drafts_less_where_other_sequences_fill_the_pass():
    """On a batched server a pass carries other sequences' rows: past a few rows every extra row costs about as
    much as another sequence's token, so the chain prices its rows at what they add to such a pass and
    shortens, to plain steps where drafts do not pay for the aggregate (issue 53: `auto` never below plain)."""
    cpu = {1: 10.0, 2: 10.5, 4: 12.0, 8: 20.0, 16: 36.0, 32: 68.0}  # compute-bound past a few rows

    def drive(others: int, accept: float) -> list[int]:
        return _drive(AdaptiveChain(cpu, 8), 60, accept, step_ms=0.1, others=others)

    alone, busy = drive(0, 0.7), drive(56, 0.7)
    assert sum(alone[-20:]) / 20 >= 2  # alone: drafts of a few tokens pay
    assert busy[-20:].count(0) >= 14  # beside 7 sequences' trees: plain steps
    assert any(busy[-AdaptiveChain.PROBE_EVERY:])  # and a probe now and then keeps the acceptance measured
    # where rows cost alike, d drafts cost what d other tokens would: not even drafts always accepted pay
    assert drive(56, 1.0)[-20:].count(0) >= 14
    # the learnt 1-row pass time is the same whether the pass was shared or not
    a, b = AdaptiveChain(cpu, 8), AdaptiveChain(cpu, 8)
    a.update(2, 1, 0.0002, 10.0 * a.rel[2] / 1e3, rows=2)
    b.update(2, 1, 0.0002, 10.0 * b.rel[2 + 56] / 1e3, rows=2, pass_rows=3 + 56)
    assert a.pass_ms == pytest.approx(10.0) and b.pass_ms == pytest.approx(10.0)


def test_adaptive_tree_prices_its_width():
    """A level of a 2-wide tree is two verify rows: where rows past four get dear, a fully accepted tree
    stops two levels short of the chain; where they are flat, both go the whole way."""
    cpu = {1: 10.0, 2: 10.0, 4: 11.0, 8: 40.0}
    assert _drive(AdaptiveChain(cpu, 8, width=2), 30, 1.0)[-1] == 1
    flat = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0, 32: 10.0}
    wide = AdaptiveChain(flat, 8, width=2)
    assert len(wide.rel) >= 17 and _drive(wide, 30, 1.0)[-1] == 8
    assert _drive(AdaptiveChain(flat, 8, width=2, floor=1), 30, 0.0)[-1] == 1
    # the pass time is learnt per row count: 2 levels of 2 read as a 5-row pass, not a 3-row one
    a = AdaptiveChain({1: 10.0, 2: 10.0, 4: 20.0, 8: 40.0}, 4, width=2)
    a.update(2, 1, 0.002, 0.020, rows=4)
    assert a.pass_ms == pytest.approx(20.0 / a.rel[4]) and a.step_ms == pytest.approx(1.0)
    with pytest.raises(ValueError, match="width"):
        AdaptiveChain(flat, 4, width=0)


def test_adaptive_tree_config():
    t = TreeConfig.parse("adaptive:5")
    assert (t.depth, t.topk, t.total_tokens, t.adaptive) == (5, 1, 5, True)
    assert TreeConfig.parse("adaptive").depth == 8 and "adaptive" in t.label()
    with pytest.raises(UserError, match="depth x topk"):
        TreeConfig(4, 2, 4, adaptive=True)
    wide = TreeConfig.parse("adaptive:4x2")
    assert wide == TreeConfig(4, 2, 8, adaptive=True) and "4 levels x 2" in wide.label()
    assert TreeConfig.parse("adaptive:x3") == TreeConfig(8, 3, 24, adaptive=True)
    assert TreeConfig.parse("adaptive:3x2@0.1").min_prob == 0.1
    for bad in ("adaptive:x", "adaptive:4x", "adaptive:4x0", "adaptive:0x2", "adaptive:4x2x2", "adaptive4"):
        with pytest.raises(UserError, match="adaptive"):
            TreeConfig.parse(bad)
    with pytest.raises(UserError, match="total_tokens"):
        TreeConfig.parse(f"adaptive:{MAX_DEPTH}x{MAX_TOPK}")  # more rows than a tree may have
    stop = TreeConfig.parse("adaptive:5@0.25")
    assert (stop.depth, stop.adaptive, stop.min_prob) == (5, True, 0.25) and "0.25" in stop.label()
    for bad in ("adaptive@1", "adaptive@x", "3,1,3@-0.5", "3,1,3@"):
        with pytest.raises(UserError, match="min_prob"):
            TreeConfig.parse(bad)
