"""Tree verification: a pure function of (tree, target logits, sampling params, rng or seeded noise).

It runs where the target runs, so a remote drafter never needs the target's logits.
Greedy: follow the child that equals the target's argmax. Seeded sampling likewise follows the child
that equals the exponential race's winner at that position (`TokenNoise`): the output is then plain
seeded sampling's, token for token, whatever the drafter proposed. Unseeded sampling, at each node on
the path, goes by recursive rejection sampling over its children, of one of two kinds:

- children proposed deterministically (top-k, lookup): the draft probability of a tried child is
  taken as 1 (arXiv 2410.03804, section 5): accept child x with probability p(x), else remove x from p,
  renormalise and try the next sibling in score order;
- children sampled without replacement from a stated q (`Tree.dists`; Jeon et al. 2024, "Recursive
  Speculative Decoding"): in sampling order, accept x with probability min(1, p(x) / q(x)), else
  p <- norm(max(p - q, 0)) and q <- q without x, renormalised. One child is Leviathan/Chen's
  speculative sampling. Given the rejections so far the next child is a draw from the current q, so
  each step emits its current p exactly; a rejected x had p(x) < q(x), so it leaves p with no mass.
  This needs the children to be the first n draws with n chosen before drawing them
  (`grow_sampled_tree`): a drafter that kept the likelier of its draws would bias the output.

If no child is accepted, the bonus is sampled from what is left of p. Each emitted token is then
distributed exactly as the target's p, because the tree (and q) never depends on the target's
random draws.

With a `rule` (`decoding.logit_rules`: logit bias, penalties, a grammar), p is the target's distribution after
the rule, read in the state of the node's own path; a child it gives no mass is never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moaspec.decoding.logit_rules import RowRule
from moaspec.decoding.sampling import SamplingParams, TokenNoise, sample, target_probs
from moaspec.decoding.tree import DraftDist, Tree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, starting with the root (0)
    accepted: list[int]  # accepted draft tokens (path[1:] as token ids)
    bonus: int  # the target's own next token after the path

    @property
    def new_tokens(self) -> list[int]:
        return [*self.accepted, self.bonus]


def verify(tree: Tree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           noise: TokenNoise | None = None, position: int = 0, rule: RowRule | None = None) -> Verdict:
    """logits: [len(tree), vocab], row i = the target's next-token logits after node i (rows of nodes that can
    never be accepted may be missing: only the accepted path's are read, in order). With `noise` (a seeded
    generation) the root is the token at sequence index `position`."""
    path = [0]
    node = 0
    while True:
        row = logits[node] if rule is None else rule(node, logits[node])
        if params.greedy or noise is not None:
            token = int(row.argmax()) if params.greedy else \
                noise.pick(target_probs(row, params), position + tree.depths[node] + 1)
            nxt = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
        else:
            p = target_probs(row, params)
            q = tree.dists.get(node)
            nxt, p = _try_drafted(tree, node, p, generator) if q is None else _try_sampled(tree, node, p, q, generator)
            if nxt is None:
                token = sample(p, generator)
        if nxt is None:
            return Verdict(path, [tree.tokens[i] for i in path[1:]], token)
        path.append(nxt)
        node = nxt


def _try_drafted(tree: Tree, node: int, p: torch.Tensor, generator: torch.Generator) -> tuple[int | None, torch.Tensor]:
    """Deterministic children, best score first: (the accepted child or None, the residual p)."""
    for c in sorted(tree.children[node], key=lambda c: -tree.scores[c]):
        x = tree.tokens[c]
        if float(torch.rand((), generator=generator)) < float(p[x]):
            return c, p
        p[x] = 0.0
        total = p.sum()
        if total <= 0:  # p(x) was 1 up to round-off: x is the only token left
            return c, p
        p /= total
    return None, p


def _try_sampled(tree: Tree, node: int, p: torch.Tensor, dist: DraftDist,
                 generator: torch.Generator) -> tuple[int | None, torch.Tensor]:
    """Children sampled without replacement from `dist`, in sampling order: (the accepted child or
    None, the residual p). In float64: the residuals subtract nearly equal distributions."""
    p = p.double()
    q = torch.zeros_like(p)
    q[list(dist.ids)] = torch.tensor(dist.probs, dtype=torch.float64)
    for c in tree.children[node]:
        x = tree.tokens[c]
        q /= q.sum()
        if float(torch.rand((), generator=generator)) * float(q[x]) < float(p[x]):
            return c, p
        p = (p - q).clamp_min_(0.0)
        total = p.sum()
        if total <= 0:  # p == q up to round-off: x could not have been rejected
            return c, p
        p /= total
        q[x] = 0.0
    return None, p
