"""Token Recycling (arXiv 2408.08696): the target's own next-token candidates, recycled as drafts.

Every verification pass scores each row of its draft tree, rejected branches too; the target's top-k
next tokens after a row's token, with their probabilities, go into an adjacency table keyed by that
token (the latest pass overwrites). A draft follows the table from the root, best-first by the product
of the stored probabilities: the root's likeliest successors, theirs, and so on, up to the tree shape
asked for: tokens the target itself found likely after those tokens, in some earlier context. No model
and no training; the table lives as long as the drafter (across the generations of a session).

The candidates need the target's logits, so they come from a target in this process
(`decoding.target.LocalTarget` computes them for a drafter whose `candidates` is k): a remote target
sends verdicts only, and leaves this drafter without drafts. Paired with the suffix drafter it is a
`HybridDrafter` model (`--drafter hybrid --hybrid-model recycling`): the stored probabilities are its
node probabilities, calibrated against acceptance like a model drafter's softmax.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Any

from moaspec.decoding.target import Candidates
from moaspec.decoding.tree import Tree, TreeConfig

if TYPE_CHECKING:
    from moaspec.drafters import DrafterRequest


class RecyclingDrafter:
    name = "recycling"
    encoder = None
    branching = True  # a table row holds k siblings: they cost no extra draft step

    def __init__(self, k: int = 8):
        self.candidates = k  # the top-k the target reports per row
        self.table: dict[int, tuple[list[int], list[float]]] = {}

    def begin(self, prompt: list[int], context: Any = None) -> None:
        self._learn(context)

    def observe(self, tokens: list[int], context: Any = None) -> None:
        self._learn(context)

    def _learn(self, context: Any) -> None:
        if isinstance(context, Candidates):
            for token, ids, probs in zip(context.tokens, context.ids.tolist(), context.probs.tolist(), strict=True):
                self.table[token] = (ids, probs)

    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        """Best-first over the table: the `total_tokens` nodes of highest path probability within
        `depth` levels and `topk` children a node. (At T > 0 the tree is verified as drafted, which is
        exact: the drafter states no distribution it sampled from.)"""
        tokens, parents, scores, depths = [root], [-1], [0.0], [0]
        heap: list[tuple[float, int, int, int]] = []  # (-path log-prob, order, parent node, token)
        order = 0

        def push_children(node: int) -> None:
            nonlocal order
            if depths[node] >= cfg.depth or tokens[node] not in self.table:
                return
            ids, probs = self.table[tokens[node]]
            for tok, p in list(zip(ids, probs, strict=True))[:cfg.topk]:
                heapq.heappush(heap, (-(scores[node] + math.log(max(p, 1e-30))), order, node, tok))
                order += 1

        push_children(0)
        while heap and len(tokens) <= cfg.total_tokens:
            neg, _, parent, tok = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
            depths.append(depths[parent] + 1)
            push_children(len(tokens) - 1)
        return Tree(tokens, parents, scores)


def build(request: DrafterRequest) -> RecyclingDrafter:
    return RecyclingDrafter()
