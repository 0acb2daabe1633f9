"""Classic speculative decoding: a smaller LM with the same tokenizer drafts the tree.

The draft model keeps its own KV cache of the committed context. Each proposal runs the tokens
committed since the last round plus the root in one pass, then expands the EAGLE-2 tree one level
per pass with a tree mask over the tentative nodes, and finally drops them again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from moaspec.decoding.tree import Tree, TreeConfig, grow_tree
from moaspec.drafters.trained import place_frontier
from moaspec.errors import UserError
from moaspec.models.runtime import Transformer

if TYPE_CHECKING:
    from moaspec.drafters import DrafterRequest


class DraftModelDrafter:
    name = "model"
    encoder = None
    branching = True

    def __init__(self, model: Transformer):
        self.model = model
        self.context: list[int] = []

    def begin(self, prompt: list[int], context: Any = None) -> None:
        self.model.reset()
        self.context = list(prompt)

    def observe(self, tokens: list[int], context: Any = None) -> None:
        self.context.extend(tokens)

    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        m = self.model
        m.truncate(min(m.length, len(self.context)))  # the same root again: its verification never came back
        pending = self.context[m.length:]
        if m.length + len(pending) + 1 + cfg.depth * cfg.topk > m.max_seq_len:
            return Tree.chain(root)
        out = m.forward(torch.tensor([*pending, root]), logits_rows=slice(-1, None))
        m.advance(len(pending) + 1)
        base = m.length  # the root is committed in the draft cache; it will be in the target's too
        # tree node -> cache slot - base: the forward's tree mask covers only the tentative slots [base, length)
        slot_of = {0: -1}

        def expand(tree: Tree, frontier: list[int]) -> torch.Tensor:
            # rows = frontier nodes; columns = tentative slots [base, length) + the new rows
            _, mask = place_frontier(tree, frontier, slot_of, 0)  # the first of them is m.length - base
            positions = torch.tensor([base - 1 + tree.depths[n] for n in frontier])
            o = m.forward(torch.tensor([tree.tokens[n] for n in frontier]), positions=positions, tree_mask=mask)
            m.advance(len(frontier))
            return torch.log_softmax(o.logits, dim=-1)

        try:
            return grow_tree(root, torch.log_softmax(out.logits[-1], -1), expand, cfg)
        finally:
            m.truncate(base)


def build(request: DrafterRequest) -> DraftModelDrafter:
    """A same-tokenizer model (`request.draft_model`, else the target's `DEFAULT_DRAFT_MODEL`) in the target's
    weight mode."""
    from moaspec.drafters import DEFAULT_DRAFT_MODEL
    from moaspec.models.store import load_tokenizer, resolve

    name = request.draft_model or DEFAULT_DRAFT_MODEL.get(request.model)
    if name is None:
        raise UserError(f"--drafter model needs --draft-model NAME for target {request.model!r}")
    folder = resolve(name)
    if name != request.model and \
            load_tokenizer(folder).get_vocab() != load_tokenizer(resolve(request.model)).get_vocab():
        raise UserError(f"draft model {name!r} does not share the target's tokenizer")
    t = request.target
    return DraftModelDrafter(Transformer(folder, weights=t.weights, device=t.device, max_seq_len=t.max_seq_len))
