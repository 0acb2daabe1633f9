"""Tree verification: a pure function of (tree, target logits, sampling params, rng).

It runs where the target runs, so a remote drafter never needs the target's logits.
Greedy: follow the child that equals the target's argmax. Sampling: recursive rejection sampling
over each node's children with the draft probability of a tried child taken as 1 (PAPER.md
section 5): accept child x with probability p(x), else remove x from p, renormalise and try the next
sibling; if none is accepted, sample the bonus from the residual. Each emitted token is then
distributed exactly as the target's p, whatever the tree, because the tree never depends on the
target's random draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moaspec.decoding.sampling import SamplingParams, sample, target_probs
from moaspec.decoding.tree import Tree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, starting with the root (0)
    accepted: list[int]  # accepted draft tokens (path[1:] as token ids)
    bonus: int  # the target's own next token after the path

    @property
    def new_tokens(self) -> list[int]:
        return [*self.accepted, self.bonus]


def verify(tree: Tree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
    """logits: [len(tree), vocab], row i = the target's next-token logits after node i."""
    path = [0]
    node = 0
    while True:
        if params.greedy:
            token = int(logits[node].argmax())
            nxt = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
        else:
            p = target_probs(logits[node], params)
            nxt = None
            for c in sorted(tree.children[node], key=lambda c: -tree.scores[c]):
                x = tree.tokens[c]
                if float(torch.rand((), generator=generator)) < float(p[x]):
                    nxt = c
                    break
                p[x] = 0.0
                total = p.sum()
                if total <= 0:  # p(x) was 1 up to round-off: x is the only token left
                    nxt = c
                    break
                p /= total
            if nxt is None:
                token = sample(p, generator)
        if nxt is None:
            return Verdict(path, [tree.tokens[i] for i in path[1:]], token)
        path.append(nxt)
        node = nxt
