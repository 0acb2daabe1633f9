"""Grammars an output must follow (a JSON schema, any JSON object, a regex, a Lark grammar), through llguidance.

llguidance (the engine llama.cpp and vLLM offer) compiles a grammar for one vocabulary in about a millisecond
and gives the set of tokens allowed next in microseconds, with no dependencies, so a schema can come with every
request (xgrammar and outlines-core measured beside it: docs/serving.md, experiments/grammar_engines.py). A `Grammar`
is immutable and shared; each generation follows it with a `Matcher` of its own, which speculation walks down a
draft tree and back (`decoding.logit_rules`).
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np
import torch

from moaspec.errors import UserError


class Vocabulary:
    """A tokenizer's vocabulary as llguidance sees it (~1 s to build: one per tokenizer, kept), padded to the
    model's logits width, with the model's end-of-sequence tokens."""

    _kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, backend_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import llguidance

        self.size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(backend_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        # added tokens (a chat format's markers): a grammar names them by id, llguidance keeps them out of text
        self._added = {t["content"]: t["id"] for t in json.loads(backend_json).get("added_tokens", [])}

    def token_id(self, text: str) -> int | None:
        """The id of the added token spelled `text` (None if it is not one)."""
        return self._added.get(text)

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Vocabulary:
        """The vocabulary of a `models.tokenizer.Tokenizer`, built once per tokenizer object."""
        with cls._lock:
            found = cls._kept.get(tokenizer)
            if found is None or (found.size, found.eos_token_ids) != (vocab_size, tuple(eos_token_ids)):
                found = cls._kept[tokenizer] = cls(tokenizer.backend_json(), vocab_size, eos_token_ids)
            return found


class Grammar:
    """A checked grammar for one vocabulary; `matcher()` starts a generation's walk through it."""

    def __init__(self, vocab: Vocabulary, source: str, what: str):
        import llguidance

        self.vocab, self.source, self.what = vocab, source, what
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, vocab.tokenizer)
        if failed:
            raise UserError(f"the {what} cannot be compiled: {messages[0] if messages else 'invalid grammar'}")

    @classmethod
    def json_schema(cls, vocab: Vocabulary, schema: dict[str, Any]) -> Grammar:
        """Output that parses as JSON and validates against `schema` (compact: no whitespace between tokens,
        as OpenAI's strict mode writes it)."""
        import llguidance

        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise UserError(f"the JSON schema cannot be compiled: {e}") from None
        return cls(vocab, source, "JSON schema")

    @classmethod
    def json_object(cls, vocab: Vocabulary) -> Grammar:
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls.json_schema(vocab, {"type": "object"})

    @classmethod
    def gbnf(cls, vocab: Vocabulary, text: str) -> Grammar:
        """A llama.cpp GBNF grammar (its `grammar` field), or one in llguidance's Lark syntax."""
        return cls._from(vocab, "grammar", text, "grammar")

    @classmethod
    def regex(cls, vocab: Vocabulary, pattern: str) -> Grammar:
        return cls._from(vocab, "regex", pattern, "regular expression")

    @classmethod
    def choice(cls, vocab: Vocabulary, options: list[str]) -> Grammar:
        """Exactly one of `options`."""
        return cls._from(vocab, "choice", json.dumps(options), "choice")

    @classmethod
    def _from(cls, vocab: Vocabulary, kind: str, text: str, what: str) -> Grammar:
        import llguidance

        try:
            source = llguidance.grammar_from(kind, text)
        except (ValueError, TypeError, RuntimeError) as e:
            raise UserError(f"the {what} cannot be compiled: {e}") from None
        return cls(vocab, source, what)

    def matcher(self) -> Matcher:
        return Matcher(self)


class GrammarMismatch(UserError):
    """llguidance refused a token its own mask allowed (seen with characters outside the Basic Multilingual Plane
    in a regex): the output cannot follow the grammar past this point."""

    def __init__(self, token: int):
        super().__init__(f"the grammar engine cannot follow its own grammar here (it allowed token {token}, then "
                         "refused it); simplify the grammar (e.g. characters beyond U+FFFF in a pattern)")


class Matcher:
    """One generation's place in a grammar: the tokens allowed next, taking a token, trying a draft's. The end of
    sequence is taken here, not by llguidance (whose trial consumption refuses it): allowed once the grammar
    accepts, and after it only another end."""

    def __init__(self, grammar: Grammar):
        import llguidance

        self.vocab = grammar.vocab
        self._m = llguidance.LLMatcher(grammar.vocab.tokenizer, grammar.source, log_level=0)
        self._check()
        self._bits = torch.zeros((self.vocab.size + 31) // 32, dtype=torch.int32)
        self._eos = frozenset(self.vocab.eos_token_ids)
        self._ended = 0  # end-of-sequence tokens taken (or tried) after the grammar's text

    def _check(self) -> None:
        if self._m.is_error():
            raise UserError(f"the grammar failed: {self._m.get_error()}")

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens that may come next (only the end of sequence once the grammar is complete)."""
        if self._ended:
            ok = torch.zeros(self.vocab.size, dtype=torch.bool)
            ok[list(self._eos)] = True
            return ok
        self._m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        self._check()
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")[:self.vocab.size]
        if not bits.any():  # nothing can follow: the grammar cannot be satisfied from here
            raise UserError("the grammar allows no token here: it cannot be satisfied")
        return torch.from_numpy(bits.astype(bool))

    def take(self, token: int) -> None:
        """Follow a token the masked distribution gave (so it is allowed)."""
        if not self.tries(token):
            raise GrammarMismatch(token)

    def tries(self, token: int) -> bool:
        """Follow `token` if the grammar allows it here (undone with `back`); whether it did."""
        if token in self._eos or self._ended:
            if token in self._eos and (self._ended or self._m.is_accepting()):
                self._ended += 1
                return True
            return False
        return self._m.try_consume_tokens([token]) == 1

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (where only one continuation is allowed, e.g. a JSON key after its
        object's last field): a draft that verification accepts for certain, whatever the drafter."""
        return [] if self._ended else list(self._m.compute_ff_tokens())

    def back(self, n: int = 1) -> None:
        undo = min(n, self._ended)
        self._ended -= undo
        if n > undo:
            self._m.rollback(n - undo)
