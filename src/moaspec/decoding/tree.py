"""Draft trees as plain data, and EAGLE-2's dynamic expansion (top-k or sampled children).

Node 0 is the root: the last emitted token, not yet in the target's cache. Every other node is a
drafted token whose parent index is smaller than its own, so parents come before children and one
target pass can score the whole tree with an ancestor mask and depth-based positions.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from moaspec.decoding.sampling import SamplingParams, target_probs
from moaspec.errors import UserError

DRAFT_TOP_M = 32  # q keeps the drafter's m most likely tokens: small enough to send with the tree


@dataclass(frozen=True)
class DraftSampling:
    """How the children of a tree are sampled at T > 0: without replacement from q, the drafter's own
    distribution at the generation's `params` (top-k, top-p; temperature times `sharpen`) restricted
    to its `top_m` most likely tokens and renormalised. Any stated q keeps the output exact; a sharper
    q than the generation's suits drafters less confident than their target (measured at T=1: at half
    the temperature, first-draft acceptance 0.98-1.06x of top-k drafts on Qwen 0.5B, where q at the
    full temperature gave 0.77-0.88x, and 1.15-1.29x on SmolLM2). `seed` seeds this call's draws; the
    engine takes it from a stream of its own, so drafts never share the target's random numbers.

    A seeded generation (`params.seed`) samples by the exponential race (`TokenNoise`) and gives
    `position`, the sequence index of the root: the children at depth d are then drawn with the target's
    own noise at position + d, so that a child is the target's pick whenever q and p agree."""

    params: SamplingParams
    seed: int
    top_m: int = DRAFT_TOP_M
    sharpen: float = 0.5
    position: int | None = None

    def __post_init__(self) -> None:
        if self.params.greedy:
            raise UserError("drafts are sampled only at temperature > 0; at 0 the tree takes the top-k children")
        if self.top_m < 1 or not 0.0 < self.sharpen <= 1.0:
            raise UserError(f"draft sampling needs top_m >= 1 and sharpen in (0, 1], got {self.top_m}, {self.sharpen}")
        if self.position is not None and self.params.seed is None:
            raise ValueError("draws coupled to the target's race (a position) need a seeded generation")


# Bounds on a tree's shape. A tree is scored in one target pass, one row per draft token, and every
# row costs time (a CPU pays per row past a few; a GPU runs flat only up to a few dozen rows), and
# every draft step is a drafter call: a server taking shapes from its clients must bound them. The
# limits leave ample room above any shape that pays (the paper's GPU tree is depth 6, top-k 8, 62
# tokens; the adaptive chain defaults to 8) while keeping one call's work small and predictable.
MAX_DEPTH = 32  # draft steps: each is a sequential drafter call
MAX_TOPK = 64  # children per expanded node: each step scores topk x topk candidates
ADAPTIVE_MAX_DEPTH = 8  # levels of an adaptive chain unless given
LOAD_ROWS = 256  # other sequences' rows in a pass that an adaptive chain prices its rows against, at most
MAX_TREE_TOKENS = 256  # draft tokens per target pass (its rows, the root aside)


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 tree shape: `depth` draft steps, `topk` children per expanded node, and `total_tokens`
    draft nodes kept after reranking (the pass scores `total_tokens + 1` rows with the root).
    CPU default is small (docs/results.md: verifying many tokens is compute-bound); the paper's GPU
    default is depth 6, top-k 8, 62 tokens. Bounded by MAX_DEPTH, MAX_TOPK and MAX_TREE_TOKENS; a
    path of `depth` drafts is `depth` nodes, so `total_tokens` is at least `depth` (fewer would
    leave the deepest draft steps unused)."""

    depth: int = 4
    topk: int = 4
    total_tokens: int = 6
    # The number of levels (up to `depth`) is chosen per call (`AdaptiveChain`), each level `topk` wide
    # (total_tokens = depth x topk): a chain when topk is 1.
    adaptive: bool = False
    # EAGLE-2's confidence stop: no further draft step once the likeliest frontier path (by the
    # drafter's own probabilities; sampled trees: by q) is below this; the nodes already drafted are
    # still verified. Model drafters and the suffix drafter; prompt lookup has no probabilities.
    min_prob: float = 0.0

    def __post_init__(self) -> None:
        for name, limit, flag in (("depth", MAX_DEPTH, "--depth"), ("topk", MAX_TOPK, "--topk"),
                                  ("total_tokens", MAX_TREE_TOKENS, "--total-tokens")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= limit:
                raise UserError(f"tree {name} ({flag}) must be an integer from 1 to {limit}, got {value!r}")
        if self.total_tokens < self.depth:
            raise UserError(f"a tree of depth {self.depth} needs total_tokens >= {self.depth} (a chain of depth d "
                            f"is d draft tokens), got {self.total_tokens}; raise --total-tokens or lower --depth")
        if isinstance(self.min_prob, bool) or not isinstance(self.min_prob, numbers.Real) or \
                not 0.0 <= self.min_prob < 1.0:
            raise UserError(f"min_prob (--min-prob) must be a number in [0, 1), got {self.min_prob!r}")
        if self.adaptive and self.total_tokens != self.depth * self.topk:
            raise UserError(f"an adaptive tree drafts topk tokens at each of its levels: total_tokens = depth x "
                            f"topk; got {self}")

    @classmethod
    def parse(cls, text: str) -> TreeConfig:
        """ "depth,topk,total" as written on command lines, or "adaptive[:max depth[xwidth]]" (e.g.
        adaptive:4x2, up to 4 levels of 2 tokens); either with "@P" after it for `min_prob` P."""
        shape, min_prob = split_min_prob(text)
        min_prob = min_prob or 0.0
        try:
            if shape.startswith("adaptive"):
                spec = shape.removeprefix("adaptive")
                if spec and not spec.startswith(":"):
                    raise ValueError(spec)
                depth_text, x, width_text = spec[1:].partition("x")
                return cls.adaptive_tree(int(depth_text or ADAPTIVE_MAX_DEPTH), int(width_text) if x else 1, min_prob)
            return cls(*map(int, shape.split(",")), min_prob=min_prob)
        except (TypeError, ValueError):
            raise UserError(f"a tree is written depth,topk,total (e.g. 3,1,3) or adaptive[:max depth[xwidth]] (e.g. "
                            f"adaptive:4x2), optionally with @min_prob (e.g. adaptive@0.2); got {text!r}") from None

    @classmethod
    def adaptive_tree(cls, depth: int = ADAPTIVE_MAX_DEPTH, width: int = 1, min_prob: float = 0.0) -> TreeConfig:
        """Up to `depth` levels of `width` tokens, the depth chosen per call (`AdaptiveChain`)."""
        if not 1 <= width <= MAX_TOPK or not 1 <= depth <= MAX_DEPTH:
            raise UserError(f"an adaptive tree is 1 to {MAX_DEPTH} levels of 1 to {MAX_TOPK} tokens, got {depth} "
                            f"levels of {width}")
        return cls(depth, width, depth * width, adaptive=True, min_prob=min_prob)

    def label(self) -> str:
        if self.adaptive:
            shape = f"adaptive chain <= {self.depth}" if self.topk == 1 else \
                f"adaptive tree <= {self.depth} levels x {self.topk}"
        else:
            shape = f"d{self.depth}/k{self.topk}/t{self.total_tokens}"
        return f"{shape}, stop below p {self.min_prob:g}" if self.min_prob else shape

    def sampled(self, sampling: DraftSampling) -> SampledTreeConfig:
        """This shape with sampled children."""
        return SampledTreeConfig(**{f.name: getattr(self, f.name) for f in fields(TreeConfig)}, sampling=sampling)


def split_min_prob(text: str) -> tuple[str, float | None]:
    """A tree written with "@P" (its `min_prob`): the shape before it and P (None when absent)."""
    shape, at, prob = text.partition("@")
    if not at:
        return shape, None
    try:
        value = float(prob)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise UserError(f"the min_prob after @ in a tree must be a number in [0, 1), got {prob!r} in {text!r}")
    return shape, value


@dataclass(frozen=True, kw_only=True)
class SampledTreeConfig(TreeConfig):
    """A tree shape whose children are to be sampled (`grow_sampled_tree`): what the engine asks of a
    drafter at T > 0. A drafter that cannot sample (prompt lookup) takes it as the plain shape; its
    tree is then verified as drafted, which is exact too."""

    sampling: DraftSampling


PAPER_GPU_TREE = TreeConfig(depth=6, topk=8, total_tokens=62)


# A drafter whose siblings come from its one softmax gets a 2-wide adaptive tree where two levels of it
# (5 rows) cost at most this x a 1-row pass; else a chain.
SIBLING_BUDGET = 1.2


def tree_for_costs(cost_ms: dict[int, float], budget: float = 1.5, branching: bool = False) -> TreeConfig:
    """The tree shape a machine affords, from the measured cost of one target pass over k rows.

    Verify the largest k whose pass costs at most `budget` x a single-row pass (k - 1 draft tokens):
    a drafter that gets ~60% of its tokens accepted turns a 3-token chain into ~2.2 tokens per call,
    so extra rows pay as long as they cost less than ~1.5 steps. A GPU (flat cost up to 64 rows) gets
    the paper's big tree. A memory-bound CPU, where rows past a few cost visibly more, affords only a
    chain; how long a chain pays then hangs on the drafter's acceptance on the text at hand, which
    only the live run knows, so it gets an adaptive chain (`AdaptiveChain`: measured 1.0-1.1x the
    best fixed chain length for lookup, EAGLE-2 and MoA on Qwen 0.5B). So does a CPU whose passes stay
    flat to 8 rows but not 16: a tree that cannot be two wide at each of its levels is a chain with a
    sibling or two that pays all its draft steps whatever the acceptance (Qwen 0.5B fp16, 8 rows at
    1.23x one row: the 6-deep, 7-token tree ran MoA at 0.94x and EAGLE-2 at 1.02x of plain, the
    adaptive chain at 1.04x and 1.13x). There a `branching` drafter (siblings from the same draft
    step) gets the adaptive tree two wide at each level, whose depth follows acceptance like the
    chain's: on that machine a fixed 2-deep, 2-wide tree ran MoA at 1.06x and EAGLE-2 at 1.18x against
    the chain's 1.00x and 1.10x; where 5 rows cost 1.37x one row, the chain won (MoA 1.07x against
    1.03x for one level of two)."""
    if 1 not in cost_ms:
        raise ValueError("the cost of a 1-row pass is the reference: measure k = 1")
    ref = min(ms for k, ms in cost_ms.items() if k <= 2)  # 1 row may run padded to 2 (models/linear.py)
    rows = max(k for k, ms in cost_ms.items() if ms <= budget * ref)
    total = min(rows - 1, PAPER_GPU_TREE.total_tokens)
    if total < 2 * PAPER_GPU_TREE.depth:
        width = 2 if branching and row_cost_ratios(cost_ms, 5)[4] <= SIBLING_BUDGET else 1
        return TreeConfig(ADAPTIVE_MAX_DEPTH, width, ADAPTIVE_MAX_DEPTH * width, adaptive=True)
    depth = PAPER_GPU_TREE.depth
    topk = min(PAPER_GPU_TREE.topk, max(2, -(-total // depth)))
    return TreeConfig(depth=depth, topk=topk, total_tokens=total)


def row_cost_ratios(cost_ms: dict[int, float], rows: int, extrapolate: bool = False) -> list[float]:
    """The cost of a target pass over 1..rows rows as a multiple of a 1-row pass (element k - 1 for k
    rows), linear between the measured row counts and past the last flat or, with `extrapolate`, on the
    slope of the last two (a pass of many rows is compute-bound: its cost grows with every row)."""
    if 1 not in cost_ms:
        raise ValueError("the cost of a 1-row pass is the reference: measure k = 1")
    ks = sorted(cost_ms)
    slope = 0.0
    if extrapolate and len(ks) > 1:
        slope = max(0.0, (cost_ms[ks[-1]] - cost_ms[ks[-2]]) / (ks[-1] - ks[-2]))
    out = []
    for k in range(1, rows + 1):
        lo = max(x for x in ks if x <= k)
        hi = min((x for x in ks if x >= k), default=lo)
        if hi == lo:
            ms = cost_ms[lo] + slope * (k - lo)
        else:
            ms = cost_ms[lo] + (cost_ms[hi] - cost_ms[lo]) * (k - lo) / (hi - lo)
        out.append(ms / cost_ms[1])
    return out


class AdaptiveChain:
    """Chooses before every target call how many levels to draft: the number with the most expected
    tokens per millisecond, from the acceptance seen so far and the costs seen so far. A level is one
    draft step; it adds one token to a chain, or `width` siblings to a tree (`TreeConfig.adaptive`).

    Expected tokens of d levels are 1 + a1 + a1*a2 + ... with a_j the chance that level j is accepted
    once j - 1 were, counted over this generation with a decay so that the estimate follows the text
    (code, prose, a quoted passage); a depth with few counts leans on the rate of the depth above it,
    so a draft that is accepted whole gets tried one longer.
    The cost of a call is the network's share of it (what the call took beyond the target's own time:
    zero in one process, the round trip to a remote target) plus the target's pass over d x width + 1
    rows (the calibrated cost per row count, scaled to the pass time seen live) plus d draft steps at
    their live time. So a long round trip makes longer drafts pay. Where other sequences' rows share the
    pass (a batched server: R rows as seen in recent passes, yielding N = R x this sequence's tokens per
    row), the length is the one with the most tokens per millisecond for the whole pass:
    (N + expected) / cost(R + d x width + 1), against (N + 1) / cost(R + 1) for a plain step. Alone, N = R
    = 0 and this is the rule above; under load a pass past a few rows is compute-bound, every draft row
    costs about what another sequence's token does, and the chain shortens, to plain steps where drafts
    would lower the aggregate. Where no length is expected to beat a
    plain step (1 token for the pass over one row: drafts rarely match, or this weight mode's extra rows
    are dear), it drafts nothing, trying the best length once every `PROBE_EVERY` calls so that acceptance
    stays measured and a text that turns repetitive is noticed (`floor=1`: always at least one level)."""

    PROBE_EVERY = 8

    def __init__(self, verify_ms: dict[int, float], max_depth: int = 8, decay: float = 0.95, width: int = 1,
                 floor: int = 0):
        if not 1 <= max_depth <= MAX_DEPTH:
            raise ValueError(f"an adaptive tree drafts 1 to {MAX_DEPTH} levels, got max_depth {max_depth}")
        if not 1 <= width <= MAX_TOPK:
            raise ValueError(f"an adaptive tree's levels are 1 to {MAX_TOPK} wide, got width {width}")
        if floor not in (0, 1):
            raise ValueError(f"an adaptive tree's floor is 0 or 1 levels, got {floor}")
        self.max_depth, self.decay, self.width, self.floor = max_depth, decay, width, floor
        self.rel = row_cost_ratios(verify_ms, LOAD_ROWS + max_depth * width + 1, extrapolate=True)
        # rows of other sequences in this sequence's recent passes (a batched server's load, which outlives
        # a generation: not reset with the text's statistics), and the tokens a verified row yields
        self.others, self.yield_ = 0.0, 1.0
        self.reset()

    def reset(self) -> None:
        self.offered = [0.0] * self.max_depth
        self.hits = [0.0] * self.max_depth
        self.step_ms: float | None = None  # one draft step
        self.pass_ms: float | None = None  # one single-row verify pass of the target
        self.net_ms = 0.0  # a call's time beyond the target's pass (the round trip, for a remote target)
        self.idle = 0  # calls in a row that drafted nothing

    def _pass_ms(self, rows: int) -> float:
        """ms of a pass over this sequence's `rows` and the others' (alone: its own)."""
        return self.net_ms + self.pass_ms * self.rel[min(round(self.others), LOAD_ROWS) + rows - 1]

    def choose(self) -> int:
        if self.step_ms is None or self.pass_ms is None:
            return min(3, self.max_depth)  # nothing measured yet: a middle length
        others = round(self.others) * self.yield_  # the tokens the other sequences' rows give in the same pass
        best, best_rate, expected, reach, a = 1, 0.0, 1.0, 1.0, 0.5
        for d in range(1, self.max_depth + 1):
            a = (self.hits[d - 1] + 2 * a) / (self.offered[d - 1] + 2)  # prior: the depth above's rate
            reach *= a
            expected += reach
            rate = (others + expected) / (self._pass_ms(d * self.width + 1) + d * self.step_ms)
            if rate > best_rate:
                best, best_rate = d, rate
        if self.floor == 0 and best_rate < (others + 1.0) / self._pass_ms(1):
            self.idle += 1
            if self.idle % self.PROBE_EVERY:
                return 0
        else:
            self.idle = 0
        return best

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float,
               target_s: float | None = None, rows: int | None = None, pass_rows: int | None = None) -> None:
        """After a call that verified `drafted` levels of draft tokens (`rows` tokens in all; default: a
        chain's) and accepted `accepted` of them in `verify_s`, of which the target's own pass took
        `target_s` (default: all of it); `pass_rows`: the rows of that pass, other sequences' included
        (default: this call's own, rows + 1). A call that drafted nothing updates the pass and network times."""
        rows = drafted if rows is None else rows
        whole = rows + 1 if pass_rows is None else max(pass_rows, rows + 1)
        self.others = 0.8 * self.others + 0.2 * (whole - rows - 1)
        self.yield_ = 0.9 * self.yield_ + 0.1 * (min(accepted, rows) + 1) / (rows + 1)
        scale = self.rel[min(whole, len(self.rel)) - 1]  # the pass over `whole` rows, in 1-row passes
        if drafted <= 0:
            if self.pass_ms is not None:
                target_s = verify_s if target_s is None else min(target_s, verify_s)
                self.pass_ms = 0.8 * self.pass_ms + 0.2 * target_s * 1e3 / scale
                self.net_ms = 0.8 * self.net_ms + 0.2 * (verify_s - target_s) * 1e3
            return
        self.offered = [x * self.decay for x in self.offered]
        self.hits = [x * self.decay for x in self.hits]
        # level j + 1 was looked at; levels past max_depth (a drafter that chose a longer draft) are not tracked
        for j in range(min(accepted + 1, drafted, len(self.offered))):
            self.offered[j] += 1
            self.hits[j] += j < accepted
        target_s = verify_s if target_s is None else min(target_s, verify_s)
        step, pass_ = draft_s * 1e3 / drafted, target_s * 1e3 / scale
        net = (verify_s - target_s) * 1e3
        ema = 0.8
        first = self.step_ms is None
        self.step_ms = step if first else ema * self.step_ms + (1 - ema) * step
        self.pass_ms = pass_ if self.pass_ms is None else ema * self.pass_ms + (1 - ema) * pass_
        self.net_ms = net if first else ema * self.net_ms + (1 - ema) * net


@dataclass(frozen=True)
class DraftDist:
    """q of one parent node: the sparse distribution (target token ids, probabilities summing to 1)
    its children were sampled from, without replacement, in the order of their node indices."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass
class Tree:
    """A draft tree. `dists` maps a parent node to the `DraftDist` its children were sampled from;
    the children of any other node were proposed deterministically (top-k, lookup). Verification
    treats the two kinds differently (`decoding/verify.py`), so a drafter must never add children
    of its own choosing under a sampled parent."""

    tokens: list[int]
    parents: list[int]
    scores: list[float] = field(default_factory=list)  # cumulative draft log-prob (of q when sampled); root 0
    dists: dict[int, DraftDist] = field(default_factory=dict)
    # node -> the drafter that proposed it, where that is not the drafter that returned the tree (a hybrid's
    # parts): what a client shows of each accepted token
    origins: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.scores:
            self.scores = [0.0] * len(self.tokens)
        self.depths = [0] * len(self.tokens)
        self.children: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"tree node {i} has parent {p}: parents must come before children")
            self.depths[i] = self.depths[p] + 1
            self.children[p].append(i)
        for node, q in self.dists.items():
            prob = dict(zip(q.ids, q.probs, strict=True))
            kids = [self.tokens[c] for c in self.children[node]] if 0 <= node < len(self.tokens) else None
            if (kids is None or len(prob) != len(q.ids) or abs(sum(q.probs) - 1.0) > 1e-3
                    or len(set(kids)) != len(kids) or any(prob.get(t, 0.0) <= 0.0 for t in kids)):
                raise ValueError(f"the children of tree node {node} are not distinct draws from its q")

    @classmethod
    def chain(cls, root: int, drafts: list[int] = ()) -> Tree:
        return cls([root, *drafts], [-1, *range(len(drafts))])

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self) -> torch.Tensor:
        """[n, n] bool: True where node i may attend to node j (j is i or one of its ancestors)."""
        n = len(self)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            m[i, i] = True
            if i:
                m[i] |= m[self.parents[i]]
        return m

    def positions(self, start: int) -> torch.Tensor:
        return start + torch.tensor(self.depths, dtype=torch.long)

    def restrict(self, keep: list[int]) -> tuple[Tree, dict[int, int]]:
        """The tree of the nodes `keep` (ascending, the root first, each node's parent kept too), for a pass that
        scores only those; and each kept node's index in it."""
        index = {node: i for i, node in enumerate(keep)}
        return Tree([self.tokens[n] for n in keep], [-1, *(index[self.parents[n]] for n in keep[1:])]), index

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


# logprobs over the drafter's vocabulary for the next token after each node of `frontier`
ExpandFn = Callable[[Tree, list[int]], torch.Tensor]


def grow_tree(
    root: int,
    root_logprobs: torch.Tensor,
    expand: ExpandFn,
    cfg: TreeConfig,
    vocab: torch.Tensor | None = None,
) -> Tree:
    """EAGLE-2 dynamic tree (arXiv 2410.03804, section 5); for a `SampledTreeConfig`, `grow_sampled_tree`.

    Step 1 takes the top-k children of the root; each further step expands the k frontier nodes with
    top-k children each, scores them by cumulative log-prob and keeps the best k as the new frontier.
    All candidates are then reranked and the best `total_tokens` kept. No step is taken once the best
    frontier path's probability is below `cfg.min_prob`. `vocab` maps the drafter's (possibly trimmed)
    vocabulary indices to target token ids.
    """
    tokens, parents, scores = [root], [-1], [0.0]
    if isinstance(cfg, SampledTreeConfig):
        return grow_sampled_tree(root, root_logprobs, expand, cfg, vocab)

    def add(parent_nodes: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> list[int]:
        first = len(tokens)
        mapped = ids if vocab is None else vocab[ids]
        tokens.extend(mapped.tolist())
        parents.extend(parent_nodes.tolist())
        scores.extend(values.tolist())
        return list(range(first, len(tokens)))

    k = min(cfg.topk, root_logprobs.shape[-1])
    top = root_logprobs.float().topk(k)
    frontier = add(torch.zeros(k, dtype=torch.long), top.indices, top.values)
    floor = math.log(cfg.min_prob) if cfg.min_prob > 0 else -math.inf
    for _ in range(1, cfg.depth):
        if max(scores[i] for i in frontier) < floor:
            break
        lp = expand(Tree(list(tokens), list(parents), list(scores)), frontier).float()  # [f, V]
        base = torch.tensor([scores[i] for i in frontier])
        child = lp.topk(k, dim=-1)
        cum = (base[:, None] + child.values).flatten()
        owner = torch.tensor(frontier).repeat_interleave(k)
        new = add(owner, child.indices.flatten(), cum)
        best = cum.topk(min(k, cum.numel())).indices
        frontier = [new[i] for i in best.tolist()]

    # Rerank: cumulative log-probs only fall along a path, so the top set is closed under ancestors
    # up to ties; add any missing ancestor explicitly so the tree stays valid.
    order = sorted(range(1, len(tokens)), key=lambda i: -scores[i])[: cfg.total_tokens]
    keep = set(order)
    for i in order:
        p = parents[i]
        while p > 0 and p not in keep:
            keep.add(p)
            p = parents[p]
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    kept = sorted(keep, key=lambda i: (depth[i], -scores[i], i))
    index = {0: 0, **{old: new for new, old in enumerate(kept, start=1)}}
    return Tree(
        [root] + [tokens[i] for i in kept],
        [-1] + [index[parents[i]] for i in kept],
        [0.0] + [scores[i] for i in kept],
    )


def draft_dist(logprobs: torch.Tensor, s: DraftSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """q for rows of drafter log-probs [f, V]: (drafter-vocab ids [f, m], probs [f, m]), the top m
    tokens under the generation's top-k / top-p and its temperature times `sharpen`, renormalised."""
    top = logprobs.float().topk(min(s.top_m, logprobs.shape[-1]), dim=-1)
    return top.indices, target_probs(top.values, replace(s.params, temperature=s.params.temperature * s.sharpen))


def _children_per_node(bases: list[float], logq: torch.Tensor, budget: int, levels: int) -> list[int]:
    """How many children each frontier node draws now: those among the `budget` best nodes of a
    projected tree in which every node below a frontier node drafts like that node (its sorted log q,
    `logq` [f, k], -inf past its support), `levels` deep, ranked by cumulative log q as EAGLE-2 ranks.
    A confident q so keeps a chain, a flat one a bush."""
    counts = [0] * len(bases)
    # (-score, level below the frontier, tie-break, frontier node, sibling rank, parent's score)
    heap = [(-(b + float(logq[u, 0])), 0, u, u, 0, b) for u, b in enumerate(bases)]
    heapq.heapify(heap)
    tie = len(heap)
    while heap and budget > 0:
        neg, level, _, u, j, base = heapq.heappop(heap)
        budget -= 1
        counts[u] += level == 0
        nxt = [(base + float(logq[u, j + 1]), level, j + 1, base)] if j + 1 < logq.shape[1] else []
        if level + 1 < levels:
            nxt.append((-neg + float(logq[u, 0]), level + 1, 0, -neg))
        for score, lvl, jj, b in nxt:
            if score > float("-inf"):
                heapq.heappush(heap, (-score, lvl, tie, u, jj, b))
                tie += 1
    return counts


def grow_sampled_tree(
    root: int,
    root_logprobs: torch.Tensor,
    expand: ExpandFn,
    cfg: SampledTreeConfig,
    vocab: torch.Tensor | None = None,
) -> Tree:
    """EAGLE-2's expansion with children sampled without replacement from q (`draft_dist`), for
    recursive rejection sampling (`decoding/verify.py`), which is exact only if the children of each
    node are the first n draws from its q with n fixed before they are drawn.

    So a drawn node is never dropped (EAGLE-2's final rerank would keep or drop a child by its own
    probability), and each level fixes its counts before drawing: the frontier is the best k nodes of
    the level above by cumulative log q, and `_children_per_node` shares the rest of the budget of
    `total_tokens` from their q alone. Children are listed in the order they were drawn (Gumbel top-n).
    `min_prob` compares the best frontier path's q (sharpened, top-m) with the floor.
    """
    s = cfg.sampling
    g = torch.Generator().manual_seed(s.seed)
    race = None if s.position is None else s.params.noise()
    tokens, parents, scores, dists = [root], [-1], [0.0], {}
    level_nodes, budget = [0], cfg.total_tokens
    floor = math.log(cfg.min_prob) if cfg.min_prob > 0 else -math.inf
    for level in range(cfg.depth):
        frontier = sorted(level_nodes, key=lambda i: -scores[i])[: cfg.topk]
        if level and scores[frontier[0]] < floor:  # decided from drawn nodes only: the draws stay exact
            break
        logprobs = root_logprobs[None] if level == 0 else expand(Tree(list(tokens), list(parents), list(scores)),
                                                                 frontier)
        ids, q = draft_dist(logprobs, s)
        logq = q.log()
        k = min(cfg.topk, q.shape[1])
        counts = _children_per_node([scores[u] for u in frontier], logq.topk(k, dim=-1).values,
                                    budget, cfg.depth - level)
        first = len(tokens)
        for r, u in enumerate(frontier):
            if not counts[r]:
                continue
            mapped = ids[r] if vocab is None else vocab[ids[r]]
            if race is None:
                e = torch.empty_like(q[r]).exponential_(generator=g)
            else:
                e = race.exp(s.position + level + 1, mapped).to(q.dtype)
            drawn = (logq[r] - e.log()).topk(counts[r]).indices  # sequential draws without replacement
            support = (q[r] > 0).nonzero().flatten()
            dists[u] = DraftDist(tuple(mapped[support].tolist()), tuple(q[r, support].tolist()))
            tokens.extend(mapped[drawn].tolist())
            parents.extend([u] * len(drawn))
            scores.extend((scores[u] + logq[r, drawn]).tolist())
        level_nodes = list(range(first, len(tokens)))
        budget -= len(level_nodes)  # every level draws at least one node while budget is left
        if budget <= 0:
            break
    return Tree(tokens, parents, scores, dists)
