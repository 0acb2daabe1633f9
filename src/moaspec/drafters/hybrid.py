"""Hybrid drafting: a nearly free drafter (suffix, or prompt lookup) with a model drafter (MoA by default).

Why: on a CPU a draft step of a trained drafter costs a visible share of a target step, while the free
drafter costs microseconds and is often right where the text repeats its context or earlier answers
(ArcticInference's suffix + speculator, RASD's retrieval + draft trees). Both drafters see every
`begin`/`observe`, so the model drafter's context is current whenever it is asked to draft; its
target-side encoder is the hybrid's `encoder`.

Each source's node probabilities (the free drafter's path probabilities from counts, the model's
softmax) are calibrated online against what verification accepted: a factor per source = accepted
nodes / the sum of the conditional probabilities of its nodes that were looked at (decayed). The
model's acceptance by depth and the live verify and draft times give the value of a model draft
before it is drafted.

Policies (both keep to the tree shape asked for):
- `switch`: per round, the free draft when its expected accepted length (the sum of its calibrated
  path probabilities) per millisecond reaches what a model draft would bring (`_free_wins`), else the
  model's draft. An empty free draft counts too: where the model does not pay for its draft steps the
  round is a plain step (the model still drafts every EXPLORE_EVERY-th such round). The model drafts
  the chain length, up to the one asked for, with the most expected tokens per millisecond by its own
  acceptance: the adaptive chain picks one length from the rounds of both sources together.

In one process the target defers the model's context (`decoding.target.DeferredContext`): the model
encodes it, several rounds at once, only before it drafts, so rounds it sits out cost it nothing.
- `merge`: one tree: the free draft and the model's draft merged by prefix, then the `total_tokens`
  most probable nodes (calibrated) kept, as RASD does. The model is not run when the free draft alone
  fills the budget with nodes likelier than the model's measured first-token acceptance. Sampled model
  children (T > 0, `Tree.dists`) are kept whole and in draw order, with no free sibling beside them:
  verification is exact only for the drafter's own draws.

Neither policy drafts past the length asked for, even where the suffix is sure of a long copy: replayed
on the benchmark's own answers with this CPU's row costs, a suffix chain run on past d while its path
probability stayed >= 0.7 raised tau (2.05 from 1.90) but lost speed (rows past the 4th cost ~0.13 of a
step each), and `AdaptiveChain` keeps statistics by level and row costs only up to the depth it asked for.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from moaspec.decoding.drafter import Drafter
from moaspec.decoding.tree import DraftDist, Tree, TreeConfig, row_cost_ratios
from moaspec.errors import UserError

if TYPE_CHECKING:
    from moaspec.drafters import DrafterRequest

POLICIES = ("switch", "merge")  # per round the suffix draft or the model's, or both in one tree
EXPLORE_EVERY = 16

FREE, MODEL = "free", "model"


class _Calibration:
    """accepted / sum of the conditional probabilities the source gave its looked-at nodes; decayed,
    with a prior of 1 worth `prior` nodes."""

    def __init__(self, decay: float = 0.95, prior: float = 2.0):
        self.decay, self.prior = decay, prior
        self.hits = self.mass = 0.0

    @property
    def factor(self) -> float:
        return (self.hits + self.prior) / (self.mass + self.prior)

    def update(self, looked: list[tuple[float, bool]]) -> None:
        self.hits *= self.decay
        self.mass *= self.decay
        for q, hit in looked:
            self.mass += q
            self.hits += hit


class _DepthRates:
    """P(the model's node at depth j is accepted | depth j - 1 was), decayed, each depth leaning on the
    one above (as `decoding.tree.AdaptiveChain` does): the expected accepted length of a model chain."""

    def __init__(self, max_depth: int = 64, decay: float = 0.95):
        self.decay = decay
        self.offered = [0.0] * max_depth
        self.hits = [0.0] * max_depth

    def rates(self, d: int) -> list[float]:
        out, a = [], 0.5
        for j in range(min(d, len(self.offered))):
            a = (self.hits[j] + 2 * a) / (self.offered[j] + 2)
            out.append(a)
        return out

    def expected(self, d: int) -> list[float]:
        """Expected accepted tokens of model chains of 1..d tokens."""
        out, reach, total = [], 1.0, 0.0
        for a in self.rates(d):
            reach *= a
            total += reach
            out.append(total)
        return out

    def update(self, looked: dict[int, bool]) -> None:
        """`looked`: depth (1-based) -> whether the model's node there was accepted."""
        self.offered = [x * self.decay for x in self.offered]
        self.hits = [x * self.decay for x in self.hits]
        for depth, hit in looked.items():
            if depth <= len(self.offered):
                self.offered[depth - 1] += 1
                self.hits[depth - 1] += hit


@dataclass
class _Draft:
    """A draft tree with, per node, each source's own conditional probability and the calibrated path
    probability the hybrid ranks it by (node 0 is the root). `dists`: the sampled parents (`Tree.dists`)."""

    tokens: list[int]
    parents: list[int]
    raw: list[dict[str, float]]
    prob: list[float]
    depths: list[int]
    dists: dict[int, DraftDist] = field(default_factory=dict)

    @classmethod
    def of(cls, tree: Tree, source: str, factor: float) -> _Draft:
        raw: list[dict[str, float]] = [{}]
        prob = [1.0]
        for i in range(1, len(tree)):
            p = tree.parents[i]
            q = math.exp(min(0.0, tree.scores[i] - tree.scores[p]))
            raw.append({source: q})
            prob.append(prob[p] * min(1.0, factor * q))
        return cls(list(tree.tokens), list(tree.parents), raw, prob, list(tree.depths), dict(tree.dists))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def expected(self) -> float:
        """Expected accepted length: the sum of the nodes' calibrated path probabilities."""
        return sum(self.prob[1:])

    def keep(self, nodes: set[int]) -> _Draft:
        """The sub-draft of `nodes` (closed under ancestors), in the same order (sampled siblings stay in
        draw order), level by level."""
        order = sorted(nodes, key=lambda i: (self.depths[i], i))
        index = {0: 0, **{old: new for new, old in enumerate(order, start=1)}}
        pick = [0, *order]
        return _Draft([self.tokens[i] for i in pick], [-1, *(index[self.parents[i]] for i in order)],
                      [self.raw[i] for i in pick], [self.prob[i] for i in pick], [self.depths[i] for i in pick],
                      {index[i]: q for i, q in self.dists.items() if i in index})

    def tree(self, names: dict[str, str]) -> Tree:
        """The draft as a tree, each node's origin the `names` of its sources ("suffix+moa" when both)."""
        origins = {i: "+".join(names[s] for s in (FREE, MODEL) if s in raw) for i, raw in enumerate(self.raw) if raw}
        return Tree(list(self.tokens), list(self.parents), [math.log(max(p, 1e-30)) for p in self.prob],
                    dict(self.dists), origins)


def merge_drafts(model: _Draft, free: _Draft) -> _Draft:
    """Union of two drafts from the same root, shared prefixes merged (a node's sources are both drafts'
    and its probability the larger). The model's nodes come first, in their order; a free node that
    would be a new child of a sampled model node is left out, with its subtree."""
    out = _Draft([model.tokens[0]], [-1], [{}], [1.0], [0], {0: model.dists[0]} if 0 in model.dists else {})
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node of out
    for d in (model, free):
        where = {0: 0}
        for i in range(1, len(d)):
            if d.parents[i] not in where:
                continue
            parent = where[d.parents[i]]
            node = index.get((parent, d.tokens[i]))
            if node is None:
                if d is free and parent in out.dists:
                    continue
                node = index[(parent, d.tokens[i])] = len(out)
                out.tokens.append(d.tokens[i])
                out.parents.append(parent)
                out.raw.append({})
                out.prob.append(0.0)
                out.depths.append(out.depths[parent] + 1)
            out.raw[node] = {**out.raw[node], **d.raw[i]}
            out.prob[node] = max(out.prob[node], d.prob[i])
            where[i] = node
            if i in d.dists:
                out.dists[node] = d.dists[i]
    return out


class HybridDrafter:
    """A free drafter and a model drafter behind one `Drafter` (see the module doc for the policies)."""

    name = "hybrid"
    branching = False  # its policies pick or merge per round on a chain's length

    def __init__(self, free: Drafter, model: Drafter, policy: str = "switch"):
        if policy not in POLICIES:
            raise UserError(f"unknown hybrid policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.free, self.model, self.policy = free, model, policy
        self.encoder = model.encoder  # the target encodes context for the model drafter only
        self.candidates = getattr(model, "candidates", 0)  # or reports its top-k (`drafters.recycling`)
        self.calibration = {FREE: _Calibration(), MODEL: _Calibration()}
        self.model_rates = _DepthRates()
        # a verification of one row (its root), as seen between propose and observe, each scaled by what its
        # rows cost against one (`set_row_costs`; without them every row count is taken to cost the same)
        self.verify_ms: float | None = None
        self.rel: list[float] = [1.0]
        self.step_ms: float | None = None  # one model draft token
        self.catch_up_ms: float | None = None  # encoding the model's deferred context, per model round
        self.rounds = {FREE: 0, MODEL: 0, "both": 0, "none": 0}  # whose nodes the verified trees held
        self._last: _Draft | None = None
        self._proposed_at: float | None = None
        self._idle = 0  # rounds in which neither source was worth drafting

    @property
    def defers_context(self) -> bool:
        """In one process the target defers the model's context to the rounds the model drafts (batched),
        where the model takes deferred contexts (`catch_up`: MoA)."""
        return hasattr(self.model, "catch_up")

    # ------------------------------------------------------------------ Drafter protocol
    def begin(self, prompt: list[int], context: Any = None) -> None:
        self.free.begin(prompt, None)
        self.model.begin(prompt, context)
        self._last = self._proposed_at = None

    def set_row_costs(self, cost_ms: dict[int, float]) -> None:
        """The target's calibrated cost of a pass by its row count (`pass_costs`): what a longer draft
        adds to its verification."""
        self.rel = row_cost_ratios(cost_ms, max(cost_ms))

    def _rows(self, n: int) -> float:
        return self.rel[min(n, len(self.rel)) - 1]

    def observe(self, tokens: list[int], context: Any = None) -> None:
        if self._proposed_at is not None and self._last is not None:
            ms = (time.perf_counter() - self._proposed_at) * 1e3 / self._rows(len(self._last))
            self.verify_ms = _ema(self.verify_ms, ms)
        self.free.observe(tokens, None)
        self.model.observe(tokens, context)
        if self._last is not None:
            self._learn(self._last, tokens[1:])
        self._last = self._proposed_at = None

    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        free = _Draft.of(self.free.propose(root, cfg), FREE, self.calibration[FREE].factor)
        if cfg.topk == 1:  # a chain (the adaptive chain asks for d, 1, d): the model's own best length
            d = self._model_length(cfg.depth)
            model_cfg = replace(cfg, depth=d, total_tokens=d)
        else:
            model_cfg = cfg
        if self.policy == "merge":
            draft = self._merge(root, cfg, free, model_cfg)
        elif self._free_wins(free, model_cfg.depth) and (len(free) > 1 or not self._explore()):
            draft = free  # also an empty one: a plain step beats a model draft that does not pay
        else:
            draft = self._model_draft(root, model_cfg)
        self._last = draft
        self.rounds[_label(draft)] += 1
        self._proposed_at = time.perf_counter()
        return draft.tree({FREE: self.free.name, MODEL: self.model.name})

    # ------------------------------------------------------------------ choices
    def _explore(self) -> bool:
        """Every EXPLORE_EVERY-th round that would draft nothing, the model drafts anyway, so that its
        measured acceptance follows the text and can make it pay again."""
        self._idle += 1
        return self._idle % EXPLORE_EVERY == 0

    def _model_draft(self, root: int, cfg: TreeConfig) -> _Draft:
        if (catch_up := getattr(self.model, "catch_up", None)) is not None:
            t = time.perf_counter()
            catch_up()  # the deferred context: a cost of this round, apart from the draft steps
            self.catch_up_ms = _ema(self.catch_up_ms, (time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        tree = self.model.propose(root, cfg)
        if len(tree) > 1:
            self.step_ms = _ema(self.step_ms, (time.perf_counter() - t) * 1e3 / (len(tree) - 1))
        return _Draft.of(tree, MODEL, self.calibration[MODEL].factor)

    def _round_ms(self, rows: int, model_steps: int = 0) -> float | None:
        """What a round costs: the verification of `rows` rows, and a model draft of `model_steps` tokens."""
        if self.verify_ms is None or (model_steps and self.step_ms is None):
            return None
        extra = model_steps * self.step_ms + (self.catch_up_ms or 0.0) if model_steps else 0.0
        return self.verify_ms * self._rows(rows) + extra

    def _model_length(self, d: int) -> int:
        """The model chain length (<= d) with the most expected tokens per millisecond."""
        costs = [self._round_ms(j + 1, j) for j in range(1, d + 1)]
        if d <= 1 or None in costs:
            return d
        rates = [(1 + e) / c for e, c in zip(self.model_rates.expected(d), costs, strict=True)]
        return max(range(len(rates)), key=rates.__getitem__) + 1

    def _free_wins(self, free: _Draft, d: int) -> bool:
        """Whether the free draft (an empty one: a plain step) brings more tokens per millisecond than a
        d-token model draft; before the costs are measured, whether it expects as many tokens."""
        e = self.model_rates.expected(d)[-1] if d > 0 else 0.0
        free_ms, model_ms = self._round_ms(len(free)), self._round_ms(d + 1, d)
        if free_ms is None or model_ms is None:
            return len(free) > 1 and free.expected >= e
        return (1 + free.expected) / free_ms >= (1 + e) / model_ms

    def _merge(self, root: int, cfg: TreeConfig, free: _Draft, model_cfg: TreeConfig) -> _Draft:
        budget = cfg.total_tokens
        best_free = sorted(free.prob[1:], reverse=True)
        if len(best_free) >= budget and (budget == 0 or best_free[budget - 1] >= self._first()):
            return free  # the free nodes fill the budget, each likelier than a model node is expected to be
        model = self._model_draft(root, model_cfg)
        both = merge_drafts(model, free)
        nodes = range(1, len(both))
        if model.dists:  # sampled: keep every draw, fill the rest of the budget with free nodes
            keep = {i for i in nodes if MODEL in both.raw[i]}
            rest = sorted((i for i in nodes if i not in keep), key=lambda i: (-both.prob[i], i))
            keep |= set(rest[:max(0, budget - len(keep))])
        else:
            keep = set(sorted(nodes, key=lambda i: (-both.prob[i], i))[:budget])
        for i in list(keep):  # ancestors too (probabilities fall along a path, so this only settles ties)
            p = both.parents[i]
            while p > 0 and p not in keep:
                keep.add(p)
                p = both.parents[p]
        return both.keep(keep)

    def _first(self) -> float:
        """The model's measured acceptance at depth 1: what its best node is worth, before drafting it."""
        return self.model_rates.rates(1)[0]

    # ------------------------------------------------------------------ learning from the verdict
    def _learn(self, draft: _Draft, accepted: list[int]) -> None:
        """Calibrate each source on the nodes verification looked at: the children of the accepted path."""
        children: list[list[int]] = [[] for _ in draft.tokens]
        for i in range(1, len(draft)):
            children[draft.parents[i]].append(i)
        looked: dict[str, list[tuple[float, bool]]] = {FREE: [], MODEL: []}
        model_depths: dict[int, bool] = {}
        node = 0
        for depth, tok in enumerate([*accepted, None], start=1):
            nxt = None
            for c in children[node]:
                hit = draft.tokens[c] == tok
                nxt = c if hit else nxt
                for source, q in draft.raw[c].items():
                    looked[source].append((q, hit))
                if MODEL in draft.raw[c]:
                    model_depths[depth] = model_depths.get(depth, False) or hit
            if nxt is None:
                break
            node = nxt
        for source, nodes in looked.items():
            if nodes:
                self.calibration[source].update(nodes)
        if model_depths:
            self.model_rates.update(model_depths)


def _ema(old: float | None, new: float, keep: float = 0.8) -> float:
    return new if old is None else keep * old + (1 - keep) * new


def _label(draft: _Draft) -> str:
    sources = {s for raw in draft.raw[1:] for s in raw}
    return "both" if len(sources) == 2 else (sources.pop() if sources else "none")


def build(request: DrafterRequest) -> HybridDrafter:
    """The suffix drafter (over the request's datastore) + the model drafter `request.hybrid_model`."""
    from moaspec.drafters import HYBRID_MODELS, build_drafter
    from moaspec.drafters.suffix import SuffixDrafter, store_for

    if request.hybrid_model not in HYBRID_MODELS:
        raise UserError(f"the hybrid drafter pairs the suffix drafter with one of {', '.join(HYBRID_MODELS)}; "
                        f"got {request.hybrid_model!r}")
    model = build_drafter(request.hybrid_model, request.model, request.target, draft_model=request.draft_model,
                          drafter_path=request.drafter_path)
    return HybridDrafter(SuffixDrafter(store=store_for(request)), model, request.hybrid_policy)
