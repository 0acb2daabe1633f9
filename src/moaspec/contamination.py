"""Word 8-gram overlap between training text and the benchmark sets: the one check both sides use, so
that neither training nor the benchmark imports the other."""

from __future__ import annotations

import re
from collections.abc import Iterable

_WORD = re.compile(r"\w+")


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class Contamination:
    """`check(text)` is True when `text` equals one of the reference texts (up to case and spacing) or
    shares a word n-gram with one of them."""

    def __init__(self, texts: Iterable[str], n: int = 8):
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.exact: set[str] = set()
        for t in texts:
            self.grams |= ngrams(t, n)
            self.exact.add(" ".join(t.lower().split()))

    def __call__(self, text: str) -> bool:
        return " ".join(text.lower().split()) in self.exact or not self.grams.isdisjoint(ngrams(text, self.n))
