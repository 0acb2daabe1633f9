"""Sampling: the target distribution (temperature / top-k / top-p) and the losslessness of tree
verification, checked statistically against exact target probabilities.

Chi-square critical values use the Wilson-Hilferty approximation (scipy is not a dependency); every
test uses a seeded generator, so the outcome is deterministic.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections import Counter

import pytest
import torch
from conftest import chat_ids
from prompts import PROMPTS

from moaspec.decoding import sampling
from moaspec.decoding.sampling import SamplingParams, TokenNoise, sample, target_probs
from moaspec.decoding.tree import DraftDist, DraftSampling, Tree, TreeConfig, grow_tree
from moaspec.decoding.verify import Verdict, verify
from moaspec.errors import UserError

Z_0001 = 3.090232306167813  # upper 0.001 quantile of the standard normal


def chi2_critical(dof: int, z: float = Z_0001) -> float:
    """Wilson-Hilferty: the chi-square quantile for the normal quantile z (p = 0.001 by default)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; categories expected < 5 times are pooled into one
    'other' bucket. An observed outcome of probability zero gives an infinite statistic."""
    if any(probs.get(k, 0.0) <= 0.0 for k in counts):
        return math.inf, 1
    stat, buckets, other_obs, other_exp = 0.0, 0, 0, 0.0
    for k, p in probs.items():
        e = n * p
        if e < 5:
            other_obs += counts.get(k, 0)
            other_exp += e
            continue
        stat += (counts.get(k, 0) - e) ** 2 / e
        buckets += 1
    if other_exp > 0:
        stat += (other_obs - other_exp) ** 2 / other_exp
        buckets += 1
    return stat, buckets - 1


def test_chi2_critical_values():
    # tabulated p = 0.001 quantiles
    for dof, table in ((5, 20.515), (10, 29.588), (20, 45.315), (40, 73.402)):
        assert chi2_critical(dof) == pytest.approx(table, rel=0.02)


# --------------------------------------------------------------------------- the seeded exponential race
@pytest.mark.parametrize("head", [3, 64], ids=["tail-races-as-one", "all-raced"])
def test_token_noise_is_a_pure_function_and_races_exactly(monkeypatch, head):
    """The race's winner is a pure function of (seed, position, p), distributed exactly as p over seeds,
    also when most of p races as one tail racer (then drawn inside the tail by inverse CDF)."""
    monkeypatch.setattr(sampling, "RACE_HEAD", head)
    p = torch.softmax(torch.randn(40, generator=torch.Generator().manual_seed(0)) * 1.5, 0)
    assert TokenNoise(5).pick(p, 7) == TokenNoise(5).pick(p.clone(), 7)
    ids = torch.arange(40)
    assert torch.equal(TokenNoise(5).exp(7, ids), TokenNoise(5).exp(7, ids))
    assert not torch.equal(TokenNoise(5).exp(7, ids), TokenNoise(5).exp(8, ids))
    assert not torch.equal(TokenNoise(5).exp(7, ids), TokenNoise(6).exp(7, ids))
    assert bool((TokenNoise(5).exp(7, ids) > 0).all())
    n = 20_000
    counts = Counter(TokenNoise(seed).pick(p, 3) for seed in range(n))
    stat, dof = chi_square(counts, dict(enumerate(p.tolist())), n)
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} on {dof} dof"
    # positions are independent draws of the same law
    counts = Counter(TokenNoise(1).pick(p, pos) for pos in range(n))
    stat, dof = chi_square(counts, dict(enumerate(p.tolist())), n)
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} on {dof} dof"


# --------------------------------------------------------------------------- (c) SamplingParams, target_probs
@pytest.mark.parametrize(
    "kw",
    [{"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": 0.0},
     {"top_p": 1.5}, {"top_p": -0.2}, {"top_k": -1}, {"top_k": 2.5}],
    ids=str,
)
def test_sampling_params_validation(kw):
    with pytest.raises(UserError):
        SamplingParams(**kw)


def test_sampling_params_valid():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    a, b = SamplingParams(temperature=1.0, seed=3).generator(), SamplingParams(temperature=1.0, seed=3).generator()
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_target_probs_temperature():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    for t in (0.3, 1.0, 2.5):
        p = target_probs(logits, SamplingParams(temperature=t))
        assert torch.allclose(p, torch.softmax(logits / t, -1), atol=1e-6)


def test_target_probs_top_k_1_is_argmax():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = target_probs(logits, SamplingParams(temperature=0.7, top_k=1))
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 100).float())


def test_target_probs_top_k():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(2))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=10))
    top = logits.topk(10).indices
    assert set(p.nonzero().flatten().tolist()) == set(top.tolist())
    assert torch.allclose(p[top], torch.softmax(logits[top], -1), atol=1e-6)


def test_target_probs_top_p_smallest_prefix():
    base = torch.tensor([0.05, 0.5, 0.15, 0.3])  # unsorted on purpose: sorted 0.5, 0.3, 0.15, 0.05
    logits = base.log()
    cases = {0.45: {1}, 0.7: {1, 3}, 0.9: {1, 3, 2}, 0.97: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for top_p, keep in cases.items():
        p = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert set(p.nonzero().flatten().tolist()) == keep, top_p
        kept = torch.tensor(sorted(keep))
        assert torch.allclose(p[kept], base[kept] / base[kept].sum(), atol=1e-6), top_p


def test_target_probs_top_p_random_against_reference():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(200, generator=g) * 2
        top_p = float(torch.rand((), generator=g)) * 0.98 + 0.01
        probs = torch.softmax(logits.double(), -1)
        order = probs.argsort(descending=True).tolist()
        keep, mass = set(), 0.0
        for i in order:  # the smallest prefix reaching top_p
            keep.add(i)
            mass += float(probs[i])
            if mass >= top_p:
                break
        p = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert set(p.nonzero().flatten().tolist()) == keep
        assert float(p.sum()) == pytest.approx(1.0, abs=1e-5)


def test_target_probs_top_k_then_top_p():
    """HF order: top-k first, then top-p over the renormalised survivors."""
    logits = torch.tensor([0.1, 0.25, 0.2, 0.3, 0.15]).log()
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    # top-3: {3: .3, 1: .25, 2: .2} -> renormalised .4, .333, .267 -> top-p 0.6 keeps {3, 1}
    assert set(p.nonzero().flatten().tolist()) == {1, 3}


# --------------------------------------------------------------------------- greedy verification
def test_verify_greedy_follows_argmax():
    tree = Tree([0, 1, 3, 4, 2, 0, 5, 4], [-1, 0, 0, 0, 1, 1, 2, 4])
    logits = torch.full((len(tree), 6), -1.0)
    logits[0, 1] = 5.0  # root -> token 1 (node 1)
    logits[1, 0] = 5.0  # node 1 -> token 0 (node 5, the second child)
    logits[5, 3] = 5.0  # node 5 is a leaf: bonus 3
    for i in (2, 3, 4, 6, 7):
        logits[i, 2] = 5.0
    v = verify(tree, logits, SamplingParams(), None)
    assert v.path == [0, 1, 5] and v.accepted == [1, 0] and v.bonus == 3 and v.new_tokens == [1, 0, 3]
    logits[0] = -1.0
    logits[0, 2] = 5.0  # root's argmax is no child: nothing accepted
    assert verify(tree, logits, SamplingParams(), None) == Verdict([0], [], 2)


# --------------------------------------------------------------------------- (a) synthetic losslessness
VOCAB = 6
#                 node: 0   1   2   3   4   5   6   7
SYN_TREE = Tree(tokens=[0, 1, 3, 4, 2, 0, 5, 4],
                parents=[-1, 0, 0, 0, 1, 1, 2, 4],
                scores=[0.0, -0.5, -0.2, -1.5, -0.9, -0.3, -0.4, -1.6])  # siblings tried by score, not index
SYN_LOGITS = torch.randn(len(SYN_TREE), VOCAB, generator=torch.Generator().manual_seed(7)) * 1.2
# `make law` raises it (MOASPEC_LAW_SAMPLES) for the long run: a tighter bound on the law's distance
N_SYN = int(os.environ.get("MOASPEC_LAW_SAMPLES", "40000"))


def pair_distribution(tree: Tree, logits: torch.Tensor, params: SamplingParams) -> dict:
    """Exact law of the first two emitted tokens: (x, y) when x is a child of the root (then y follows
    the target at that child), (x, None) when x is not in the tree (x is the bonus, nothing follows)."""
    p0 = target_probs(logits[0], params).double()
    child = {tree.tokens[c]: c for c in tree.children[0]}
    out = {}
    for x in range(p0.shape[0]):
        if x in child:
            py = target_probs(logits[child[x]], params).double()
            out.update({(x, y): float(p0[x] * py[y]) for y in range(py.shape[0])})
        else:
            out[(x, None)] = float(p0[x])
    return out


def pair_counts(verifier, tree: Tree, logits: torch.Tensor, params: SamplingParams, n: int) -> Counter:
    g = torch.Generator().manual_seed(2024)
    counts: Counter = Counter()
    for _ in range(n):
        v = verifier(tree, logits, params, g)
        assert v.path[0] == 0 and all(tree.parents[b] == a for a, b in zip(v.path, v.path[1:], strict=False))
        assert v.accepted == [tree.tokens[i] for i in v.path[1:]]
        new = v.new_tokens
        counts[(new[0], new[1]) if len(new) > 1 else (new[0], None)] += 1
    return counts


def verify_accept_all(tree, logits, params, generator):
    """WRONG: takes the best child whenever there is one (draft probability treated as certainty)."""
    path = [0]
    while tree.children[path[-1]]:
        path.append(max(tree.children[path[-1]], key=lambda c: tree.scores[c]))
    bonus = sample(target_probs(logits[path[-1]], params), generator)
    return Verdict(path, [tree.tokens[i] for i in path[1:]], bonus)


def verify_no_residual(tree, logits, params, generator):
    """WRONG (subtly): rejection sampling as it should be, but the bonus comes from the full target
    distribution instead of the residual left after the rejected children."""
    path, node = [0], 0
    while True:
        p = target_probs(logits[node], params)
        nxt = None
        for c in sorted(tree.children[node], key=lambda c: -tree.scores[c]):
            if float(torch.rand((), generator=generator)) < float(p[tree.tokens[c]]):
                nxt = c
                break
        if nxt is None:
            return Verdict(path, [tree.tokens[i] for i in path[1:]], sample(p, generator))
        path.append(nxt)
        node = nxt


def verify_no_renormalise(tree, logits, params, generator):
    """WRONG (subtly, and with no impossible outcome): a rejected child is removed from p, but p is
    not renormalised, so later siblings are accepted with p(x) instead of p(x) / (1 - p(rejected))."""
    path, node = [0], 0
    while True:
        p = target_probs(logits[node], params)
        nxt = None
        for c in sorted(tree.children[node], key=lambda c: -tree.scores[c]):
            x = tree.tokens[c]
            if float(torch.rand((), generator=generator)) < float(p[x]):
                nxt = c
                break
            p[x] = 0.0
        if nxt is None:
            return Verdict(path, [tree.tokens[i] for i in path[1:]], sample(p, generator))
        path.append(nxt)
        node = nxt


@pytest.fixture(scope="module")
def synthetic_setup():
    params = SamplingParams(temperature=1.0)
    probs = pair_distribution(SYN_TREE, SYN_LOGITS, params)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-6)
    return params, probs


def test_verify_sampling_is_lossless_synthetic(synthetic_setup):
    params, probs = synthetic_setup
    counts = pair_counts(verify, SYN_TREE, SYN_LOGITS, params, N_SYN)
    stat, dof = chi_square(counts, probs, N_SYN)
    assert dof >= 15  # most of the 21 outcomes are frequent enough to be tested on their own
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} on {dof} dof (critical {chi2_critical(dof):.1f})"
    tv = 0.5 * sum(abs(counts.get(k, 0) / N_SYN - p) for k, p in probs.items())
    print(f"\nlaw of the first two tokens: {N_SYN} verifications, chi-square {stat:.1f} on {dof} dof (critical "
          f"{chi2_critical(dof):.1f} at p=0.001), total variation {tv:.5f}")


@pytest.mark.parametrize("wrong", [verify_accept_all, verify_no_residual, verify_no_renormalise],
                         ids=lambda f: f.__name__)
def test_chi_square_has_power_against_wrong_verifiers(synthetic_setup, wrong):
    params, probs = synthetic_setup
    counts = pair_counts(wrong, SYN_TREE, SYN_LOGITS, params, N_SYN)
    stat, dof = chi_square(counts, probs, N_SYN)
    assert stat > chi2_critical(dof), f"a wrong verifier passed: chi-square {stat:.1f} on {dof} dof"


# --------------------------------------------------------------------------- (b) real SmolLM2 logits
N_REAL = 20_000
SUB_VOCAB = 256  # per row; see real_tree_setup


@pytest.fixture(scope="module")
def real_tree_setup(smol_model, smol_tokenizer):
    """A real tree scored by SmolLM2 in one pass: root = the last token of a chat prompt, its 4 most
    likely next tokens as children, and each child's 2 most likely next tokens as grandchildren.

    The 20k verifications then run on the logits restricted to the union of every row's top-256
    tokens (a real distribution over that sub-vocabulary; verifying over all 49k tokens 60k times
    would take minutes on two cores). A smaller full-vocabulary run covers real token ids."""
    ids = chat_ids(smol_tokenizer, PROMPTS[10])  # a packing list: a broad first-token distribution
    prefix, root = ids[:-1], ids[-1]
    m = smol_model
    m.reset()
    m.prefill(prefix)
    lp0 = torch.log_softmax(m.forward(torch.tensor([root])).logits[0], -1)
    top = lp0.topk(4)
    tokens, parents, scores = [root], [-1], [0.0]
    for v, c in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        tokens.append(c)
        parents.append(0)
        scores.append(v)
    for node in range(1, 5):
        lp = torch.log_softmax(m.forward(torch.tensor([root, tokens[node]])).logits[-1], -1)
        t2 = lp.topk(2)
        for v, c in zip(t2.values.tolist(), t2.indices.tolist(), strict=True):
            tokens.append(c)
            parents.append(node)
            scores.append(scores[node] + v)
    tree = Tree(tokens, parents, scores)
    logits = m.forward(torch.tensor(tree.tokens), positions=tree.positions(m.length), tree_mask=tree.mask()).logits
    m.reset()
    vocab = sorted(set(logits.topk(SUB_VOCAB, dim=-1).indices.flatten().tolist()) | set(tokens))
    index = {t: i for i, t in enumerate(vocab)}
    sub_tree = Tree([index[t] for t in tokens], parents, scores)
    return tree, logits, sub_tree, logits[:, vocab]


REAL_PARAMS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.8, top_k=50),
]


def first_token_test(tree: Tree, logits: torch.Tensor, params: SamplingParams, n: int) -> tuple[float, int]:
    expected = target_probs(logits[0], params).double()
    probs = {i: float(p) for i, p in enumerate(expected.tolist()) if p > 0}
    g = torch.Generator().manual_seed(99)
    counts = Counter(verify(tree, logits, params, g).new_tokens[0] for _ in range(n))
    return chi_square(counts, probs, n)


@pytest.mark.parametrize("params", REAL_PARAMS, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}")
def test_verify_sampling_is_lossless_real(real_tree_setup, params):
    _, _, tree, logits = real_tree_setup
    stat, dof = first_token_test(tree, logits, params, N_REAL)
    assert dof >= 5, (stat, dof)  # enough distinct outcomes for the test to mean something
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} on {dof} dof (critical {chi2_critical(dof):.1f})"


def test_verify_sampling_is_lossless_real_full_vocab(real_tree_setup):
    tree, logits, _, _ = real_tree_setup
    n = 2000
    stat, dof = first_token_test(tree, logits, SamplingParams(temperature=0.8, top_k=50), n)
    assert dof >= 5
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} on {dof} dof (critical {chi2_critical(dof):.1f})"


# --------------------------------------------------------------------------- (d) sampled drafts
V_SD = 5
SD_PARAMS = SamplingParams(temperature=1.0)


@functools.cache
def sd_target(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy target: fixed arbitrary next-token logits for every prefix (int tuples hash the same in
    every process)."""
    g = torch.Generator().manual_seed(hash((1, *prefix)) % 2**31)
    return torch.randn(V_SD, generator=g) * 1.5


@functools.cache
def sd_draft(prefix: tuple[int, ...]) -> DraftDist:
    """A toy drafter's q for every prefix: unlike the target's p, and with one token left out."""
    g = torch.Generator().manual_seed(hash((2, *prefix)) % 2**31)
    q = torch.softmax(torch.randn(V_SD, generator=g, dtype=torch.float64) * 1.5, -1)
    q[q.argmin()] = 0.0
    ids = q.nonzero().flatten().tolist()
    return DraftDist(tuple(ids), tuple((q[ids] / q.sum()).tolist()))


def draw_without_replacement(q: DraftDist, n: int, g: torch.Generator) -> list[int]:
    """n tokens drawn one after another from q, each from q without the earlier ones, renormalised."""
    probs = torch.tensor(q.probs, dtype=torch.float64)
    out = []
    for _ in range(min(n, len(q.ids))):
        i = int(torch.multinomial(probs, 1, generator=g))
        out.append(q.ids[i])
        probs[i] = 0.0
    return out


def sampled_tree(prefix: tuple[int, ...], g: torch.Generator, shape: tuple[int, ...]) -> Tree:
    """A tree whose node at depth d has shape[d] children sampled without replacement from its q."""
    tokens, parents, dists = [prefix[-1] if prefix else 0], [-1], {}

    def grow(node: int, path: tuple[int, ...]) -> None:
        depth = len(path) - len(prefix)
        if depth == len(shape):
            return
        dists[node] = sd_draft(path)
        for x in draw_without_replacement(dists[node], shape[depth], g):
            tokens.append(x)
            parents.append(node)
            grow(len(tokens) - 1, (*path, x))

    grow(0, prefix)
    return Tree(tokens, parents, dists=dists)


def sd_logprobs(prefix: tuple[int, ...]) -> torch.Tensor:
    """The toy drafter as log-probs, for grow_tree: at T=1 its `draft_dist` is `sd_draft`."""
    q = sd_draft(prefix)
    lp = torch.full((V_SD,), float("-inf"))
    lp[list(q.ids)] = torch.tensor(q.probs).log()
    return lp


def grown_tree(prefix: tuple[int, ...], g: torch.Generator, cfg: TreeConfig) -> Tree:
    """The toy drafter's tree as the engine gets it: grow_tree with a per-call seed from `g`."""

    def expand(tree: Tree, frontier: list[int]) -> torch.Tensor:
        return torch.stack([sd_logprobs((*prefix, *(tree.tokens[i] for i in tree.path_to(f)[1:]))) for f in frontier])

    sampling = DraftSampling(SD_PARAMS, int(torch.randint(2**62, (), generator=g)))
    return grow_tree(prefix[-1] if prefix else 0, sd_logprobs(prefix), expand, cfg.sampled(sampling))


def first_three_counts(verifier, propose, n: int) -> tuple[Counter, int]:
    """Counts of the first three tokens of n toy generations, each round a fresh sampled tree
    (`propose(prefix, generator)`) verified against the toy target; and how many rounds accepted a
    child that was not its parent's first draw."""
    g_draft, g_target = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    counts: Counter = Counter()
    later_sibling = 0
    for _ in range(n):
        out: tuple[int, ...] = ()
        while len(out) < 3:
            tree = propose(out, g_draft)
            paths = [(*out, *(tree.tokens[i] for i in tree.path_to(node)[1:])) for node in range(len(tree))]
            v = verifier(tree, torch.stack([sd_target(p) for p in paths]), SD_PARAMS, g_target)
            later_sibling += any(tree.children[a].index(b) > 0 for a, b in zip(v.path, v.path[1:], strict=False))
            out = (*out, *v.new_tokens)
        counts[out[:3]] += 1
    return counts, later_sibling


@functools.cache
def first_three_law() -> dict[tuple[int, ...], float]:
    law = {}
    for seq in itertools.product(range(V_SD), repeat=3):
        law[seq] = math.prod(float(target_probs(sd_target(seq[:i]), SD_PARAMS)[seq[i]]) for i in range(3))
    return law


def test_draft_dist_and_tree_validation():
    q = DraftDist((3, 1), (0.75, 0.25))
    Tree([0, 3, 1], [-1, 0, 0], dists={0: q})  # distinct draws from q, in any order
    for tokens, dists in (([0, 3, 3], {0: q}), ([0, 3, 2], {0: q}), ([0, 3, 1], {5: q}),
                          ([0, 3, 1], {0: DraftDist((3, 1), (0.5, 0.1))})):
        with pytest.raises(ValueError):
            Tree(tokens, [-1, 0, 0], dists=dists)


SD_TREES = {
    "chain": (functools.partial(sampled_tree, shape=(1, 1, 1)), 8000, False),
    "siblings": (functools.partial(sampled_tree, shape=(3, 2)), 10_000, True),
    "grow_tree": (functools.partial(grown_tree, cfg=TreeConfig(depth=3, topk=2, total_tokens=4)), 8000, True),
}


@pytest.mark.parametrize("name", SD_TREES)
def test_verify_sampled_drafts_exact_law(name):
    """Chain: Leviathan/Chen speculative sampling. Siblings: recursive rejection sampling without
    replacement, with rounds that accept a later sibling. grow_tree: the sampled EAGLE-2 tree, whose
    shape depends on what was drawn. Each way the first three tokens follow the target exactly."""
    propose, n, siblings = SD_TREES[name]
    counts, later_sibling = first_three_counts(verify, propose, n)
    stat, dof = chi_square(counts, first_three_law(), n)
    assert dof >= 40
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} on {dof} dof (critical {chi2_critical(dof):.1f})"
    assert (later_sibling > n // 20) == siblings, later_sibling


def rrs_wrong(tree, logits, params, generator, *, remove: bool, residual: bool):
    """WRONG variants of recursive rejection sampling over sampled children: q keeps the rejected child
    (`remove` False: the law of sampling WITH replacement), or p is not replaced by its residual."""
    path, node = [0], 0
    while True:
        p = target_probs(logits[node], params).double()
        dist = tree.dists.get(node)
        nxt = None
        if dist is not None:
            q = torch.zeros_like(p)
            q[list(dist.ids)] = torch.tensor(dist.probs, dtype=torch.float64)
            for c in tree.children[node]:
                x = tree.tokens[c]
                if float(torch.rand((), generator=generator)) * float(q[x]) < float(p[x]):
                    nxt = c
                    break
                if residual:
                    p = (p - q).clamp_min(0.0)
                    p /= p.sum()
                if remove:
                    q[x] = 0.0
                    q /= q.sum()
        if nxt is None:
            return Verdict(path, [tree.tokens[i] for i in path[1:]], sample(p, generator))
        path.append(nxt)
        node = nxt


def pruned_tree(prefix: tuple[int, ...], g: torch.Generator) -> Tree:
    """WRONG: three children drawn and the two most likely kept, as EAGLE-2's rerank would keep them:
    which draws stay then depends on what they are."""
    tree = sampled_tree(prefix, g, shape=(3,))
    q = dict(zip(tree.dists[0].ids, tree.dists[0].probs, strict=True))
    kept = sorted(sorted(tree.children[0], key=lambda c: -q[tree.tokens[c]])[:2])
    return Tree([tree.tokens[0], *(tree.tokens[c] for c in kept)], [-1, 0, 0], dists=tree.dists)


WRONG_SD = {
    "q-keeps-rejected": (functools.partial(rrs_wrong, remove=False, residual=True), SD_TREES["siblings"][0]),
    "no-residual": (functools.partial(rrs_wrong, remove=True, residual=False), SD_TREES["siblings"][0]),
    "rerank-drops-draws": (verify, pruned_tree),
}


@pytest.mark.parametrize("name", WRONG_SD)
def test_sampled_drafts_chi_square_has_power(name):
    verifier, propose = WRONG_SD[name]
    n = 4000
    counts, _ = first_three_counts(verifier, propose, n)
    stat, dof = chi_square(counts, first_three_law(), n)
    assert stat > chi2_critical(dof), f"a wrong verifier passed: chi-square {stat:.1f} on {dof} dof"


def test_a_vanishing_temperature_is_greedy():
    """Found by fuzzing the API: temperature 5e-324 made logits / T infinite and the distribution NaN."""
    from moaspec.decoding.sampling import MIN_TEMPERATURE

    for t in (5e-324, 1e-300, MIN_TEMPERATURE / 2):
        p = SamplingParams(temperature=t)
        assert p.greedy and p.temperature == 0.0
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert torch.isfinite(target_probs(logits, SamplingParams(temperature=MIN_TEMPERATURE))).all()
    # and a top_p below fp32's least value (5e-324 rounds to 0) keeps the top token, not none
    assert target_probs(logits, SamplingParams(temperature=1.0, top_p=5e-324)).tolist() == [[0.0, 1.0, 0.0]]
