"""The target side of the engine: where the big model, its KV cache and verification live.

The engine talks to it through `TargetSide`; `LocalTarget` runs the runtime in-process, and the
serving layer offers the same calls over the network. Only token ids, parents, verdicts and
per-token context for the drafter cross this seam, never logits or the target's KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moaspec.decoding.sampling import SamplingParams, sample, target_probs
from moaspec.decoding.tree import Tree
from moaspec.decoding.verify import Verdict, verify
from moaspec.errors import ContextLengthError, UserError
from moaspec.models.runtime import ForwardOut, Transformer


class ContextEncoder(Protocol):
    """Target-side part of a drafter (MoA's Layer Self-Attention + projection): turns the target's
    state for newly committed cache slots into the per-token context the drafter consumes."""

    hidden_layers: tuple[int, ...]

    def encode(self, target: Transformer, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> Any: ...


@dataclass
class Step:
    verdict: Verdict
    context: Any = None  # what the drafter needs for the newly committed tokens (None: nothing)


class TargetSide(Protocol):
    eos_token_ids: tuple[int, ...]
    max_seq_len: int
    length: int  # tokens committed in the target's cache

    def start(self, prompt: list[int], params: SamplingParams) -> Step: ...

    def verify(self, tree: Tree) -> Step: ...


class LocalTarget:
    """A target in this process: prefill, score a tree in one pass, verify, commit the path."""

    def __init__(self, model: Transformer, encoder: ContextEncoder | None = None):
        self.model = model
        self.encoder = encoder
        self.eos_token_ids = model.cfg.eos_token_ids
        self.max_seq_len = model.max_seq_len
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None

    @property
    def length(self) -> int:
        return self.model.length

    def _context(self, first_slot: int, out: ForwardOut, rows: list[int] | slice) -> Any:
        if self.encoder is None:
            return None
        slots = torch.arange(first_slot, self.model.length)
        hidden = {k: v[rows] for k, v in out.hidden.items()}
        return self.encoder.encode(self.model, slots, hidden)

    def start(self, prompt: list[int], params: SamplingParams) -> Step:
        if not prompt:
            raise UserError("the prompt is empty")
        if len(prompt) >= self.max_seq_len:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; this model's context holds {self.max_seq_len}"
            )
        self.params = params
        self.generator = None if params.greedy else params.generator()
        self.model.reset()
        hidden = self.encoder.hidden_layers if self.encoder else ()
        out = self.model.prefill(prompt, hidden_layers=hidden)
        logits = out.logits[-1]
        first = int(logits.argmax()) if params.greedy else sample(target_probs(logits, params), self.generator)
        return Step(Verdict([], [], first), self._context(0, out, slice(None)))

    def verify(self, tree: Tree) -> Step:
        start = self.model.length
        single = len(tree) == 1
        out = self.model.forward(
            torch.tensor(tree.tokens),
            positions=None if single else tree.positions(start),
            tree_mask=None if single else tree.mask(),
            hidden_layers=self.encoder.hidden_layers if self.encoder else (),
        )
        verdict = verify(tree, out.logits, self.params, self.generator)
        self.model.commit(verdict.path)
        return Step(verdict, self._context(start, out, verdict.path))
