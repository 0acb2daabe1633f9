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
import os
import zipfile
import zlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moaspec.decoding.tree import TreeConfig
from moaspec.errors import UserError

SEP = 0xFFFFFFFF  # between answers: never a token, so no match or continuation crosses it
STORE_FILE = "datastore.npz"
CONFIG_FILE = "config.json"
MAX_MATCH = 64  # the suffix array sorts by this many tokens at the most (one key array each)


def suffix_array(tokens: np.ndarray, width: int) -> np.ndarray:
    """Start positions of the non-separator suffixes of `tokens`, sorted by their first `width` tokens
    (ties in text order): enough to find every pattern of up to `width` tokens."""
    n = len(tokens)
    padded = np.concatenate([tokens, np.full(width, SEP, dtype=np.uint32)])
    keys = [padded[j:j + n] for j in reversed(range(width))]  # views; np.lexsort's last key sorts first
    order = np.lexsort(keys)
    return order[tokens[order] != SEP].astype(np.int32)


@dataclass
class SuffixDraft:
    """A draft of the suffix drafter or its datastore, with each node's empirical path probability."""

    tokens: list[int]
    parents: list[int]  # index into tokens, -1 for a child of the root
    probs: list[float]  # empirical probability of the path to each node, in (0, 1], falling along a path
    match_len: int = 0
    source: str = "text"  # what it continues: the current "text", the "history" of outputs, or the "store"

    @property
    def score(self) -> float:
        """Expected accepted length if the probabilities were exact: the sum of the path probabilities."""
        return sum(self.probs)


class Datastore:
    """A suffix array over sequences of token ids, for drafting their continuations."""

    def __init__(self, tokens: np.ndarray, model: str, max_match: int = 16, samples: int = 64,
                 sa: np.ndarray | None = None):
        if not 2 <= max_match <= MAX_MATCH or samples < 1:
            raise UserError(f"a datastore needs max_match in [2, {MAX_MATCH}] and samples >= 1, "
                            f"got {max_match}, {samples}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or (len(tokens) and (int(tokens.min()) < 0 or
                                                                                  int(tokens.max()) > SEP)):
            raise UserError("a datastore's tokens are one row of ids in [0, 2**32 - 1]")
        tokens = tokens.astype(np.uint32)
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

    @property
    def max_token(self) -> int:
        """The largest token id held (-1 for none): it must be below the target's vocabulary size."""
        ids = np.frombuffer(self.tokens, dtype=np.uint32)
        ids = ids[ids != SEP]
        return int(ids.max()) if len(ids) else -1

    # ---------------------------------------------------------------- files
    def save(self, folder: str | Path, provenance: dict | None = None) -> Path:
        """Token ids only (the suffix array is rebuilt at load, under a second), and a config naming the
        target and, in `provenance`, where the answers came from. Each file is written aside and moved
        into place, the config last; a store left half-written is refused at load (token count)."""
        folder = Path(folder).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{STORE_FILE}.tmp.npz"
            np.savez_compressed(tmp, tokens=np.frombuffer(self.tokens, dtype=np.uint32))
            os.replace(tmp, folder / STORE_FILE)
            cfg = {"kind": "datastore", "target": self.model, "tokens": len(self.tokens), "max_match": self.max_match,
                   "samples": self.samples, **(provenance or {})}
            (folder / f".{CONFIG_FILE}.tmp").write_text(json.dumps(cfg, indent=1) + "\n")
            os.replace(folder / f".{CONFIG_FILE}.tmp", folder / CONFIG_FILE)
        except OSError as e:
            raise UserError(f"cannot write the datastore to {folder} ({e}); pass --to DIR, a folder you can write") \
                from None
        return folder

    @classmethod
    def load(cls, folder: str | Path, model: str | None = None) -> Datastore:
        """The datastore in `folder`, checked to be for `model` when given."""
        folder = Path(folder).expanduser()
        try:
            cfg = json.loads((folder / CONFIG_FILE).read_text())
            with np.load(folder / STORE_FILE) as z:
                tokens = z["tokens"]
            if cfg["kind"] != "datastore" or int(cfg["tokens"]) != len(tokens):
                raise ValueError(f"config.json says {cfg['kind']!r} of {cfg['tokens']} tokens, "
                                 f"{STORE_FILE} holds {len(tokens)}")
            target, max_match, samples = str(cfg["target"]), int(cfg["max_match"]), int(cfg["samples"])
        except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile, zlib.error) as e:
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
        trie: dict = {}  # token -> [count, children]
        while m > 0:
            depth = min(cfg.depth, int(spec_factor * m + 1e-6))
            if depth <= 0:
                break
            n = min(self.samples, hi - lo)
            self._count(trie, lo, hi, n, m, depth)
            if trie:
                break
            m -= 1  # every occurrence ends its answer here: a shorter match may continue
            lo, hi = self._range(tail[len(tail) - m:]) if m else (0, 0)
        if not trie:
            return SuffixDraft([], [], [], source="store")
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

    def _count(self, trie: dict, lo: int, hi: int, n: int, m: int, depth: int) -> None:
        """Count into `trie` the next `depth` tokens after n occurrences spread evenly over [lo, hi) of
        an m-token match, each cut at the end of its answer."""
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
