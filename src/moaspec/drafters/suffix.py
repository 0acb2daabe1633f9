"""Suffix drafting (in the spirit of ArcticInference's suffix decoding, arXiv 2411.04975): continue
the longest suffixes of the text the way they continued before, weighted by how often they did.

Two indexes, both `SuffixIndex`: one over the current prompt + output (rebuilt at `begin`, extended
in `observe`), and a bounded global one over this drafter's earlier outputs (FIFO by tokens), so a
chat session or a rerun of similar tasks drafts the model's own habits; and optionally a static
`drafters.datastore.Datastore` of the target's answers to other prompts, for the habits a session has
not shown yet. The best-scoring of the three drafts is proposed. Every draft node carries the
empirical probability of its path, child count / parent count along the index, and the expected
accepted length of a draft is the sum of those path probabilities: what a hybrid compares against
a model drafter (`drafters.hybrid`). No model at all: tens of microseconds per round.

`SuffixIndex` is a suffix trie over substrings of up to `max_depth` tokens with occurrence counts,
path-compressed where it matters in Python: a substring seen once is not materialised below its
first unique node (a leaf), which keeps its one occurrence's position and reads its continuation
from the token list. Appending a token touches only the suffixes of the text that occurred before
(the "active" nodes, as many as the longest repeated suffix is long), so a round costs O(new
tokens x repeated suffix length) and the index holds O(text) nodes.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from moaspec.decoding.tree import Tree, TreeConfig
from moaspec.drafters import shipped_checkpoint
from moaspec.drafters.datastore import Datastore, SuffixDraft
from moaspec.errors import UserError

if TYPE_CHECKING:
    from moaspec.drafters import DrafterRequest


class _Node:
    """The substring spelled by the path from the root. `children` is None for a leaf: a substring
    whose occurrences below it are not materialised (one occurrence, or `max_depth` reached); it then
    continues like its latest occurrence, `seq[pos + 1:]`."""

    __slots__ = ("token", "depth", "count", "total", "children", "best", "seq", "pos")

    def __init__(self, token: int, depth: int, seq: list[int], pos: int):
        self.token = token
        self.depth = depth
        self.count = 1  # occurrences of the substring
        self.total = 0  # occurrences followed by a materialised child (= sum of the children's counts)
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None  # the child with the highest count (latest on ties); None: look it up
        self.seq, self.pos = seq, pos  # latest occurrence: its token list and the index of its last token

    def top_child(self) -> _Node | None:
        if self.best is None and self.children:
            for c in self.children.values():  # the latest child wins ties, as in `SuffixIndex.extend`
                if self.best is None or c.count >= self.best.count:
                    self.best = c
        return self.best


# A position in the index: a node and how many tokens of its leaf continuation follow it (0: the node).
Match = tuple[_Node, int]


class SuffixIndex:
    """Occurrence counts of every substring of up to `max_depth` tokens of the sequences added."""

    def __init__(self, max_depth: int = 32):
        if max_depth < 2:
            raise UserError(f"a suffix index needs max_depth >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(-1, 0, [], -1)
        self.root.children = {}

    def extend(self, seq: list[int], active: list[_Node], tokens: list[int]) -> list[_Node]:
        """Append `tokens` to `seq` (a sequence added with `active` = [] when empty) and index them.
        `active` holds the nodes of the suffixes of `seq` that occurred before, shortest first (the root
        first); the updated list is returned. Suffixes seen once need no work: they stay leaves."""
        root, D = self.root, self.max_depth
        for t in tokens:
            e = len(seq)
            seq.append(t)
            nxt = []
            for node in active or [root]:
                node.total += 1
                child = node.children.get(t)
                if child is None:  # first occurrence of this substring: a leaf, nothing further to track
                    child = node.children[t] = _Node(t, node.depth + 1, seq, e)
                else:
                    child.count += 1
                    if child.children is None and child.depth < D:
                        self._materialise(child)
                    child.seq, child.pos = seq, e
                best = node.best
                if best is None:  # no child yet, or unknown after a removal: `top_child` finds it
                    if len(node.children) == 1:
                        node.best = child
                elif child.count >= best.count:
                    node.best = child
                if child.count > 1 and child.depth < D:
                    nxt.append(child)
            active = [root, *nxt]
        return active

    @staticmethod
    def _materialise(leaf: _Node) -> None:
        """A leaf's substring occurs a second time: give its first occurrence's next token a node."""
        leaf.children = {}
        p = leaf.pos + 1
        if p < len(leaf.seq):
            t = leaf.seq[p]
            leaf.children[t] = leaf.best = _Node(t, leaf.depth + 1, leaf.seq, p)
            leaf.total = 1

    def remove(self, seq: list[int]) -> None:
        """Forget every occurrence in `seq` (a sequence added before and not extended since)."""
        D = self.max_depth
        for j in range(len(seq)):
            node = self.root
            for k in range(j, min(j + D, len(seq))):
                child = node.children[seq[k]]
                node.total -= 1
                child.count -= 1
                if node.best is child:
                    node.best = None
                if child.count == 0:
                    del node.children[seq[k]]
                    break
                if child.seq is seq:  # its latest occurrence is going: keep any surviving one's position
                    child.seq, child.pos = [], -1
                if child.children is None:
                    break
                node = child

    # ------------------------------------------------------------------ reading
    def follow(self, matches: list[Match], token: int) -> list[Match]:
        """The index positions of the suffixes of (text + `token`), from those of the text's suffixes
        (shortest first; [] for an empty text): the suffixes that occurred in the index, the 1-token
        one first. A longer suffix can only occur where the shorter one did, so the walk stops at the
        first miss."""
        out: list[Match] = []
        for node, k in [(self.root, 0), *matches]:
            if node.depth + k >= self.max_depth:
                break
            if k == 0 and node.children is not None:
                child = node.children.get(token)
                if child is None:
                    break
                out.append((child, 0))
            else:
                p = node.pos + k + 1
                if p >= len(node.seq) or node.seq[p] != token:
                    break
                out.append((node, k + 1))
        return out


def draft_from(match: Match, max_depth: int, topk: int, total: int, min_prob: float) -> SuffixDraft:
    """Best-first expansion below an index position: the `total` most probable nodes, at most `topk`
    children per node, `max_depth` levels, none whose path probability falls below `min_prob`."""
    out = SuffixDraft([], [], [])
    if max_depth <= 0 or total <= 0:
        return out
    heap: list[tuple[float, int, int, int, _Node, int, int]] = []  # (-prob, tiebreak, token, parent, node, k, depth)
    n = 0

    def push(node: _Node, k: int, prob: float, parent: int, depth: int) -> None:
        nonlocal n
        if depth >= max_depth:
            return
        if k == 0 and node.children is not None:
            if node.total == 0:
                return
            kids = [node.top_child()] if topk == 1 else heapq.nlargest(topk, node.children.values(),
                                                                       key=lambda c: c.count)
            for c in kids:
                p = prob * c.count / node.total
                if p < min_prob:
                    break
                heapq.heappush(heap, (-p, n, c.token, parent, c, 0, depth + 1))
                n += 1
        else:
            i = node.pos + k + 1
            if i < len(node.seq):
                heapq.heappush(heap, (-prob, n, node.seq[i], parent, node, k + 1, depth + 1))
                n += 1

    push(match[0], match[1], 1.0, -1, 0)
    while heap and len(out.tokens) < total:
        neg, _, tok, parent, node, k, depth = heapq.heappop(heap)
        out.tokens.append(tok)
        out.parents.append(parent)
        out.probs.append(-neg)
        push(node, k, -neg, len(out.tokens) - 1, depth)
    return out


def best_draft(matches: list[Match], cfg: TreeConfig, spec_factor: float, min_prob: float) -> SuffixDraft:
    """The best-scoring draft over the matched suffixes (shortest first). A match of m tokens drafts at
    most spec_factor * m tokens (short matches are weak evidence). Suffixes with the same count occur
    at the same places, so they continue alike: each such run is drafted once, from its shortest node
    (the most index depth left) with the length allowance of its longest."""
    best = SuffixDraft([], [], [])
    i = 0
    while i < len(matches):
        j = i
        count = matches[i][0].count
        while j + 1 < len(matches) and matches[j + 1][0].count == count:
            j += 1
        node, k = matches[j]
        depth = min(cfg.depth, int(spec_factor * (node.depth + k) + 1e-6))
        d = draft_from(matches[i], depth, cfg.topk, cfg.total_tokens, min_prob)
        if d.tokens and d.score >= best.score:
            d.match_len = node.depth + k
            best = d
        i = j + 1
    return best


class SuffixDrafter:
    """Suffix drafting over the current text and this drafter's earlier outputs (see the module doc)."""

    name = "suffix"
    encoder = None
    branching = False

    def __init__(self, max_depth: int = 32, spec_factor: float = 1.0, min_prob: float = 0.1,
                 cache_tokens: int = 65536, store: Datastore | None = None):
        if spec_factor <= 0 or not 0 <= min_prob <= 1 or cache_tokens < 0:
            raise UserError("suffix drafter: spec_factor > 0, min_prob in [0, 1] and cache_tokens >= 0 required")
        self.max_depth, self.spec_factor, self.min_prob = max_depth, spec_factor, min_prob
        self.cache_tokens = cache_tokens
        self.history = SuffixIndex(max_depth)  # earlier outputs of this drafter
        self.outputs: deque[list[int]] = deque()
        self.cached = 0  # tokens in self.outputs
        self.local = SuffixIndex(max_depth)
        self.context: list[int] = []
        self.prompt_len = 0
        self.active: list[_Node] = []  # local index: repeated suffixes of the context
        self.recalled: list[Match] = []  # history index: suffixes of the context seen in earlier outputs
        self.last = SuffixDraft([], [], [])
        self.store = store  # the target's answers to other prompts (`drafters.datastore`), searched last

    def begin(self, prompt: list[int], context: Any = None) -> None:
        self._remember(self.context[self.prompt_len:])
        self.local = SuffixIndex(self.max_depth)
        self.context, self.prompt_len = [], len(prompt)
        self.active = self.local.extend(self.context, [], prompt)
        self.recalled = []
        for t in prompt[-self.max_depth:]:
            self.recalled = self.history.follow(self.recalled, t)

    def _remember(self, output: list[int]) -> None:
        """File the last generation's output in the history index, oldest outputs out past the budget."""
        if not output or self.cache_tokens == 0:
            return
        seq: list[int] = []
        self.history.extend(seq, [], output)
        self.outputs.append(seq)
        self.cached += len(seq)
        while self.cached > self.cache_tokens:
            old = self.outputs.popleft()
            self.history.remove(old)
            self.cached -= len(old)

    def observe(self, tokens: list[int], context: Any = None) -> None:
        self.active = self.local.extend(self.context, self.active, tokens)
        for t in tokens:
            self.recalled = self.history.follow(self.recalled, t)

    def draft(self, root: int, cfg: TreeConfig) -> SuffixDraft:
        """The best-scoring draft of the indexes and the store for the text + `root` (the current text
        wins ties, then this session's outputs)."""
        here = self.local.follow([(n, 0) for n in self.active[1:]], root)
        floor = max(self.min_prob, cfg.min_prob)
        d = best_draft(here, cfg, self.spec_factor, floor)
        if self.outputs:
            h = best_draft(self.history.follow(self.recalled, root), cfg, self.spec_factor, floor)
            h.source = "history"
            if h.score > d.score:
                d = h
        if self.store is not None:
            s = self.store.draft([*self.context[1 - self.store.max_match:], root], cfg, self.spec_factor, floor)
            if s.score > d.score:
                d = s
        return d

    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        self.last = d = self.draft(root, cfg)
        return Tree([root, *d.tokens], [-1, *(p + 1 for p in d.parents)],
                    [0.0, *(math.log(p) for p in d.probs)])


@lru_cache(maxsize=4)
def load_datastore(model: str, datastore: str | None = None) -> Datastore | None:
    """The datastore (`drafters.datastore`): the one shipped for the target when `datastore` is None (none
    shipped: no store), none for "none", else the folder given. Read-only once built, so one copy serves every
    drafter of the process (a folder is read once per process)."""
    if datastore == "none":
        return None
    if datastore is None:
        folder = shipped_checkpoint("datastore", model)
        return Datastore.load(folder, model) if folder.exists() else None
    return Datastore.load(datastore, model)


def store_for(request: DrafterRequest) -> Datastore | None:
    """The datastore a request names, checked against its target's vocabulary."""
    store = load_datastore(request.model, request.datastore)
    if store is not None and store.max_token >= request.target.cfg.vocab_size:
        raise UserError(f"the datastore {request.datastore or '(shipped)'} holds token {store.max_token}, past "
                        f"{request.model}'s vocabulary of {request.target.cfg.vocab_size}: rebuild it with "
                        f"`moaspec datastore --model {request.model}`")
    return store


def build(request: DrafterRequest) -> SuffixDrafter:
    return SuffixDrafter(store=store_for(request))
