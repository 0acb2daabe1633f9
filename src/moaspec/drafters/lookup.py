"""Prompt lookup (n-gram) drafting: continue the current suffix the way it continued before.

No model at all, so it costs microseconds; it shines on code editing, summarisation and
anything that copies from its context. Several earlier matches become sibling branches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moaspec.decoding.tree import Tree, TreeConfig

if TYPE_CHECKING:
    from moaspec.drafters import DrafterRequest


class LookupDrafter:
    name = "lookup"
    encoder = None
    branching = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.context: list[int] = []

    def begin(self, prompt: list[int], context: Any = None) -> None:
        self.context = list(prompt)

    def observe(self, tokens: list[int], context: Any = None) -> None:
        self.context.extend(tokens)

    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        seq = [*self.context, root]
        tokens, parents = [root], [-1]
        trie: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            suffix = seq[-n:]
            branches = 0
            # most recent matches first; a match must leave at least one token to copy
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] != suffix:
                    continue
                node = 0
                for tok in seq[start + n:start + n + cfg.depth]:
                    if (node, tok) not in trie:
                        if len(tokens) > cfg.total_tokens:
                            break
                        trie[(node, tok)] = len(tokens)
                        tokens.append(tok)
                        parents.append(node)
                    node = trie[(node, tok)]
                branches += 1
                if branches >= cfg.topk or len(tokens) > cfg.total_tokens:
                    break
            if len(tokens) > 1:
                break  # the longest matching n-gram wins
        return Tree(tokens, parents)


def build(request: DrafterRequest) -> LookupDrafter:
    return LookupDrafter()
