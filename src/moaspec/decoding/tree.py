"""Draft trees as plain data, and EAGLE-2's dynamic expansion.

Node 0 is the root: the last emitted token, not yet in the target's cache. Every other node is a
drafted token whose parent index is smaller than its own, so parents come before children and one
target pass can score the whole tree with an ancestor mask and depth-based positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moaspec.errors import UserError


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 tree shape: `depth` draft steps, `topk` children per expanded node, and `total_tokens`
    draft nodes kept after reranking (the pass scores `total_tokens + 1` rows with the root).
    CPU default is small (CPU.md: verifying many tokens is compute-bound); the paper's GPU
    default is depth 6, top-k 8, 62 tokens."""

    depth: int = 4
    topk: int = 4
    total_tokens: int = 6
    adaptive: bool = False  # a chain whose length (up to `depth`) is chosen per call: `AdaptiveChain`

    def __post_init__(self) -> None:
        if self.depth < 0 or self.topk < 1 or self.total_tokens < 0:
            raise UserError(f"invalid tree shape {self}: depth >= 0, topk >= 1, total_tokens >= 0")
        if self.adaptive and (self.topk != 1 or self.total_tokens != self.depth or self.depth < 1):
            raise UserError(f"an adaptive tree is a chain: topk 1, total_tokens = depth >= 1; got {self}")

    @classmethod
    def parse(cls, text: str) -> TreeConfig:
        """ "depth,topk,total" as written on command lines, or "adaptive[:max depth]"."""
        try:
            if text.startswith("adaptive"):
                depth = int(text.partition(":")[2] or ADAPTIVE_MAX_DEPTH)
                return cls(depth, 1, depth, adaptive=True)
            return cls(*map(int, text.split(",")))
        except (TypeError, ValueError):
            raise UserError(f"a tree is written depth,topk,total (e.g. 3,1,3) or adaptive[:max depth]; "
                            f"got {text!r}") from None

    def label(self) -> str:
        return f"adaptive chain <= {self.depth}" if self.adaptive else \
            f"d{self.depth}/k{self.topk}/t{self.total_tokens}"


ADAPTIVE_MAX_DEPTH = 8


PAPER_GPU_TREE = TreeConfig(depth=6, topk=8, total_tokens=62)


def tree_for_costs(cost_ms: dict[int, float], budget: float = 1.5) -> TreeConfig:
    """The tree shape a machine affords, from the measured cost of one target pass over k rows.

    Verify the largest k whose pass costs at most `budget` x a single-row pass (k - 1 draft tokens):
    a drafter that gets ~60% of its tokens accepted turns a 3-token chain into ~2.2 tokens per call,
    so extra rows pay as long as they cost less than ~1.5 steps. A GPU (flat cost up to 64 rows) gets
    the paper's big tree. A memory-bound CPU, where rows past a few cost visibly more, affords only a
    chain; how long a chain pays then hangs on the drafter's acceptance on the text at hand, which
    only the live run knows, so it gets an adaptive chain (`AdaptiveChain`: measured 1.0-1.1x the
    best fixed chain length for lookup, EAGLE-2 and MoA on Qwen 0.5B)."""
    if 1 not in cost_ms:
        raise ValueError("the cost of a 1-row pass is the reference: measure k = 1")
    ref = min(ms for k, ms in cost_ms.items() if k <= 2)  # 1 row may run padded to 2 (models/linear.py)
    rows = max(k for k, ms in cost_ms.items() if ms <= budget * ref)
    total = min(rows - 1, PAPER_GPU_TREE.total_tokens)
    if total <= PAPER_GPU_TREE.depth:
        return TreeConfig(ADAPTIVE_MAX_DEPTH, 1, ADAPTIVE_MAX_DEPTH, adaptive=True)
    depth = PAPER_GPU_TREE.depth
    topk = min(PAPER_GPU_TREE.topk, max(2, -(-total // depth)))
    return TreeConfig(depth=depth, topk=topk, total_tokens=total)


class AdaptiveChain:
    """Chooses before every target call how many tokens to draft in a chain: the length with the most
    expected tokens per millisecond, from the acceptance seen so far and the costs seen so far.

    Expected tokens of a d-token chain are 1 + a1 + a1*a2 + ... with a_j the chance that draft j is
    accepted once j - 1 were, counted over this generation with a decay so that the estimate follows
    the text (code, prose, a quoted passage); a depth with few counts leans on the rate of the depth
    above it, so a chain that is accepted whole gets tried one longer.
    The cost is a verify pass over d + 1 rows (the machine's calibrated cost per row count, scaled to
    the verify time seen live, so a remote target's latency counts) plus d draft steps at their live
    time. One draft token is the floor: it keeps acceptance measured and costs the least."""

    def __init__(self, verify_ms: dict[int, float], max_depth: int = 8, decay: float = 0.95):
        if 1 not in verify_ms:
            raise ValueError("the cost of a 1-row pass is the reference: measure k = 1")
        self.max_depth, self.decay = max_depth, decay
        ks = sorted(verify_ms)
        # relative verify cost for 1..max_depth+1 rows, linear between measured row counts
        self.rel = []
        for k in range(1, max_depth + 2):
            lo = max(x for x in ks if x <= k)
            hi = min((x for x in ks if x >= k), default=lo)
            ms = verify_ms[lo] if hi == lo else verify_ms[lo] + (verify_ms[hi] - verify_ms[lo]) * (k - lo) / (hi - lo)
            self.rel.append(ms / verify_ms[1])
        self.reset()

    def reset(self) -> None:
        self.offered = [0.0] * self.max_depth
        self.hits = [0.0] * self.max_depth
        self.step_ms: float | None = None  # one draft step
        self.pass_ms: float | None = None  # one single-row verify pass

    def choose(self) -> int:
        if self.step_ms is None or self.pass_ms is None:
            return min(3, self.max_depth)  # nothing measured yet: a middle length
        best, best_rate, expected, reach, a = 1, 0.0, 1.0, 1.0, 0.5
        for d in range(1, self.max_depth + 1):
            a = (self.hits[d - 1] + 2 * a) / (self.offered[d - 1] + 2)  # prior: the depth above's rate
            reach *= a
            expected += reach
            rate = expected / (self.pass_ms * self.rel[d] + d * self.step_ms)
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """After a call that verified a chain of `drafted` tokens and accepted `accepted` of them."""
        if drafted <= 0:
            return
        self.offered = [x * self.decay for x in self.offered]
        self.hits = [x * self.decay for x in self.hits]
        for j in range(min(accepted + 1, drafted)):  # draft j + 1 was looked at
            self.offered[j] += 1
            self.hits[j] += j < accepted
        step, pass_ = draft_s * 1e3 / drafted, verify_s * 1e3 / self.rel[min(drafted, self.max_depth)]
        ema = 0.8
        self.step_ms = step if self.step_ms is None else ema * self.step_ms + (1 - ema) * step
        self.pass_ms = pass_ if self.pass_ms is None else ema * self.pass_ms + (1 - ema) * pass_


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int]
    scores: list[float] = field(default_factory=list)  # cumulative draft log-prob; root 0

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
    """EAGLE-2 dynamic tree (PAPER.md section 5).

    Step 1 takes the top-k children of the root; each further step expands the k frontier nodes with
    top-k children each, scores them by cumulative log-prob and keeps the best k as the new frontier.
    All candidates are then reranked and the best `total_tokens` kept. `vocab` maps the drafter's
    (possibly trimmed) vocabulary indices to target token ids.
    """
    tokens, parents, scores = [root], [-1], [0.0]
    if cfg.depth == 0 or cfg.total_tokens == 0:
        return Tree(tokens, parents, scores)

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
    for _ in range(1, cfg.depth):
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
