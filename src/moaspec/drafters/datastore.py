"""A static datastore for the suffix drafter: the target's own answers to many prompts, searched by
suffix array (in the spirit of REST, arXiv 2311.08252, with the target's own text as the store).

Why: the suffix drafter's indexes hold the current text and this session's earlier outputs, so it has
nothing to say on a first request, while a small target repeats its own phrasings across requests
("Here's a Python function that", "```python\\ndef", "Let's break it down step by step"). The store
holds the answers of the training data (`moaspec data`, contamination-checked against the benchmark
sets), a few hundred thousand tokens, as uint32 ids with a separator between answers.

A draft: the longest suffix (up to `max_match` tokens) of the text + root that occurs in the store, found
by binary search over the suffix array; up to `samples` of its occurrences, spread evenly over its
range, give the continuations, and their counts give each drafted path its empirical probability, the
same score as the suffix drafter's own drafts (`drafters.suffix.SuffixDraft`).
"""

from __future__ import annotations

import bisect
import heapq
import json
from array import array
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from moaspec.decoding.tree import TreeConfig
from moaspec.drafters.suffix import SuffixDraft
from moaspec.errors import UserError

SEP = 0xFFFFFFFF  # between answers: never a token, so no match or continuation crosses it
STORE_FILE = "datastore.npz"
CONFIG_FILE = "config.json"


def suffix_array(tokens: np.ndarray, width: int) -> np.ndarray:
    """Start positions of the non-separator suffixes of `tokens`, sorted by their first `width` tokens
    (ties in text order): enough to find every pattern of up to `width` tokens."""
    n = len(tokens)
    padded = np.concatenate([tokens, np.full(width, SEP, dtype=np.uint32)])
    keys = [padded[j:j + n] for j in reversed(range(width))]  # views; np.lexsort's last key sorts first
    order = np.lexsort(keys)
    return order[tokens[order] != SEP].astype(np.int32)


class Datastore:
    """A suffix array over sequences of token ids, for drafting their continuations."""

    def __init__(self, tokens: np.ndarray, model: str, max_match: int = 16, samples: int = 64,
                 sa: np.ndarray | None = None):
        if max_match < 2 or samples < 1:
            raise UserError(f"a datastore needs max_match >= 2 and samples >= 1, got {max_match}, {samples}")
        tokens = np.asarray(tokens, dtype=np.uint32)
        if sa is None:
            sa = suffix_array(tokens, max_match)
        self.model, self.max_match, self.samples = model, max_match, samples
        # array.array slices compare lexicographically in C: bisect over them needs no Python loop per token
        self.tokens = array("I", tokens.tobytes())
        self.sa = array("i", np.asarray(sa, dtype=np.int32).tobytes())

    @classmethod
    def from_sequences(cls, seqs: Iterable[list[int]], model: str, **kw) -> Datastore:
        parts: list[int] = []
        for s in seqs:
            if s:
                parts.extend(s)
                parts.append(SEP)
        if not parts:
            raise UserError("a datastore needs at least one non-empty sequence")
        return cls(np.array(parts, dtype=np.uint32), model, **kw)

    def __len__(self) -> int:
        return len(self.tokens)

    # ---------------------------------------------------------------- files
    def save(self, folder: str | Path, provenance: dict | None = None) -> Path:
        """Token ids only (the suffix array is rebuilt at load, under a second), and a config naming the
        target and, in `provenance`, where the answers came from."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(folder / STORE_FILE, tokens=np.frombuffer(self.tokens, dtype=np.uint32))
        (folder / CONFIG_FILE).write_text(json.dumps(
            {"kind": "datastore", "target": self.model, "tokens": len(self.tokens), "max_match": self.max_match,
             "samples": self.samples, **(provenance or {})}, indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path, model: str | None = None) -> Datastore:
        """The datastore in `folder`, checked to be for `model` when given."""
        folder = Path(folder)
        try:
            cfg = json.loads((folder / CONFIG_FILE).read_text())
            with np.load(folder / STORE_FILE) as z:
                tokens = z["tokens"]
            target, max_match, samples = cfg["target"], int(cfg["max_match"]), int(cfg["samples"])
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise UserError(f"{folder} is not a readable datastore ({e}); rebuild it with "
                            "`moaspec datastore`") from None
        if model is not None and target != model:
            raise UserError(f"the datastore in {folder} is for {target}, not {model}; build one for {model} "
                            f"with `moaspec datastore --model {model}`")
        return cls(tokens, target, max_match=max_match, samples=samples)

    # ---------------------------------------------------------------- search
    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """The suffix-array range of the suffixes that start with `pattern`."""
        m, toks = len(pattern), self.tokens
        p = array("I", pattern)

        def key(s: int) -> array:
            return toks[s:s + m]

        lo = bisect.bisect_left(self.sa, p, key=key)
        return lo, bisect.bisect_right(self.sa, p, lo=lo, key=key)

    def longest_match(self, tail: list[int]) -> tuple[int, int, int]:
        """(m, lo, hi): the longest suffix of `tail` (m tokens, at most `max_match`) that occurs, and
        its range; m = 0 when not even the last token does. Binary search on m: a suffix occurs
        wherever a longer one does."""
        tail = tail[-self.max_match:]
        best = (0, 0, 0)
        lo_m, hi_m = 1, len(tail)
        while lo_m <= hi_m:
            m = (lo_m + hi_m) // 2
            a, b = self._range(tail[-m:])
            if b > a:
                best = (m, a, b)
                lo_m = m + 1
            else:
                hi_m = m - 1
        return best

    def draft(self, tail: list[int], cfg: TreeConfig, spec_factor: float, min_prob: float) -> SuffixDraft:
        """Best-first draft below the longest match of `tail` (the text's last tokens and the root): at
        most spec_factor x match length levels, `cfg.topk` children a node, `cfg.total_tokens` nodes,
        none whose path probability is below `min_prob`."""
        m, lo, hi = self.longest_match(tail)
        depth = min(cfg.depth, int(spec_factor * m + 1e-6))
        if depth <= 0:
            return SuffixDraft([], [], [], source="store")
        n = min(self.samples, hi - lo)
        trie: dict = {}  # token -> [count, children]
        toks = self.tokens
        for j in range(n):
            s = self.sa[lo + (j * (hi - lo)) // n] + m
            node = trie
            for t in toks[s:s + depth]:
                if t == SEP:
                    break
                entry = node.setdefault(t, [0, {}])
                entry[0] += 1
                node = entry[1]
        out = SuffixDraft([], [], [], match_len=m, source="store")
        heap: list[tuple[float, int, int, int, dict, int]] = []  # (-prob, tiebreak, token, parent, children, depth)
        order = 0

        def push(children: dict, parent: int, level: int) -> None:
            nonlocal order
            if level >= depth:
                return
            for t, (count, kids) in heapq.nlargest(cfg.topk, children.items(), key=lambda kv: kv[1][0]):
                p = count / n
                if p < min_prob:
                    break
                heapq.heappush(heap, (-p, order, t, parent, kids, level + 1))
                order += 1

        push(trie, -1, 0)
        while heap and len(out.tokens) < cfg.total_tokens:
            neg, _, t, parent, kids, level = heapq.heappop(heap)
            out.tokens.append(t)
            out.parents.append(parent)
            out.probs.append(-neg)
            push(kids, len(out.tokens) - 1, level)
        return out
