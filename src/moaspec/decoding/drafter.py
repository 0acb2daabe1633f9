"""The one protocol every drafter implements; the engine knows nothing else about drafters."""

from __future__ import annotations

from typing import Any, Protocol

from moaspec.decoding.target import ContextEncoder
from moaspec.decoding.tree import Tree, TreeConfig


class Drafter(Protocol):
    name: str
    # Target-side half of the drafter (MoA's context encoder); None when it needs only token ids.
    encoder: ContextEncoder | None
    # True: one draft step scores every token, so siblings at a level come from the same step at no
    # extra draft cost (model drafters); False: branches are other copies (lookup, suffix), which the
    # tree shapes of `tree_for_costs` leave as a chain.
    branching: bool

    def begin(self, prompt: list[int], context: Any) -> None:
        """A new generation: `prompt` is now in the target's cache."""

    def observe(self, tokens: list[int], context: Any) -> None:
        """`tokens` (the last root + the accepted drafts) were committed to the target's cache."""

    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        """A draft tree rooted at `root`, the last emitted token. For a `SampledTreeConfig` (T > 0) a
        drafter with a distribution samples the children and states q in the tree (`grow_tree` does
        both); one without (lookup) drafts as for the plain shape."""
