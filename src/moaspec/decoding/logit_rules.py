"""What a generation does to the target's logits before it picks a token: OpenAI's `logit_bias` and presence /
frequency penalties, the repetition penalty of llama.cpp and Hugging Face, and a grammar (`decoding.grammar`).

Verification applies them to each row it reads, in the state of that row's path through the draft tree: the
penalties count the tokens generated up to that node, the grammar's matcher stands after them. So every token
of a speculative generation comes from exactly the distribution plain decoding would pick it from (the same
rules over the same history), and drafts the grammar refuses are cut from the tree before the target's pass
(`RuleState.keep`). The drafts themselves are not steered: the rules shape what is accepted, not what is
proposed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moaspec.decoding.grammar import Grammar
from moaspec.decoding.tree import Tree
from moaspec.errors import UserError

MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
MAX_PENALTY = 2.0  # presence / frequency penalties, OpenAI's range
# the repetition penalty divides positive logits by it: below ~0.01 they overflow to inf (found by schemathesis)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0

# a verification's view of one row: (tree node, its raw logits) -> the logits to pick from
RowRule = Callable[[int, torch.Tensor], torch.Tensor]


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class LogitRules:
    """OpenAI's semantics: presence and frequency penalties count the generated tokens (not the prompt's):
    logit -= frequency * count + presence * (count > 0). The repetition penalty (llama.cpp, HF) reads the
    prompt and the generated tokens: a positive logit is divided by it, a negative one multiplied."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and token >= 0 and _number(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise UserError(f"logit_bias takes token ids >= 0 with biases in [-{MAX_LOGIT_BIAS:g}, "
                                f"{MAX_LOGIT_BIAS:g}], got {token!r}: {bias!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_number(value) and abs(value) <= MAX_PENALTY):
                raise UserError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not (_number(self.repetition_penalty)
                and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise UserError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
                            f"got {self.repetition_penalty!r}")

    @property
    def active(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.grammar is not None)

    def check_vocab(self, vocab_size: int) -> None:
        if any(t >= vocab_size for t, _ in self.logit_bias):
            raise UserError(f"logit_bias names a token id past this model's vocabulary ({vocab_size} tokens)")
        if self.grammar is not None and self.grammar.vocab.size != vocab_size:
            raise UserError(f"the grammar was built for {self.grammar.vocab.size} tokens, the model has {vocab_size}")

    def follow(self, prompt: list[int]) -> RuleState:
        """A generation's state under these rules, starting after `prompt`."""
        return RuleState(self, prompt)


class RuleState:
    """The rules and the history they read at one point of a generation: the committed tokens, then, during a
    verification, the path walked so far (`walk`)."""

    def __init__(self, rules: LogitRules, prompt: list[int]):
        self.rules = rules
        self.counts: Counter[int] = Counter()  # generated tokens
        self.prompt = set(prompt) if rules.repetition_penalty != 1.0 else set()
        self.matcher = rules.grammar.matcher() if rules.grammar is not None else None
        if rules.logit_bias:
            ids, values = zip(*rules.logit_bias, strict=True)
            self._bias = (torch.tensor(ids), torch.tensor(values, dtype=torch.float32))

    def take(self, token: int) -> None:
        """`token` was generated: the rules now read it."""
        self.counts[token] += 1
        if self.matcher is not None:
            self.matcher.take(token)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits to pick the next token from, at this state (a new tensor)."""
        r = self.rules
        x = logits.float().clone()
        if r.logit_bias:
            x.index_add_(0, *self._bias)
        if self.counts and (r.presence_penalty or r.frequency_penalty):
            ids = torch.tensor(list(self.counts))
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            x.index_add_(0, ids, -(counts * r.frequency_penalty + r.presence_penalty))
        if r.repetition_penalty != 1.0 and (self.prompt or self.counts):
            ids = torch.tensor(sorted(self.prompt | self.counts.keys()))
            v = x[ids]
            x[ids] = torch.where(v > 0, v / r.repetition_penalty, v * r.repetition_penalty)
        if self.matcher is not None:
            x.masked_fill_(~self.matcher.allowed(), float("-inf"))
        return x

    def keep(self, tree: Tree) -> list[int] | None:
        """The nodes of `tree` whose tokens the grammar allows all the way from the root (in node order), or None
        when it allows every node: the others need no target row, since they can never be accepted."""
        m = self.matcher
        if m is None:
            return None
        ok = [False] * len(tree)
        ok[0] = True

        def visit(node: int) -> None:
            for c in tree.children[node]:
                if m.tries(tree.tokens[c]):
                    ok[c] = True
                    visit(c)
                    m.back()

        visit(0)
        return None if all(ok) else [i for i in range(len(tree)) if ok[i]]

    def walk(self, tree: Tree) -> RowRule:
        """The rule for one verification of `tree`, whose nodes it visits root first and then down the accepted
        path: each step down takes that node's token. Afterwards the state stands after the last accepted
        draft; the caller then `take`s the bonus token."""
        at = 0

        def rule(node: int, logits: torch.Tensor) -> torch.Tensor:
            nonlocal at
            if node != at:
                if tree.parents[node] != at:
                    raise RuntimeError(f"verification jumped from node {at} to node {node}")
                self.take(tree.tokens[node])
                at = node
            return self.apply(logits)

        return rule
