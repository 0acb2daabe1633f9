"""The target side of the engine: where the big model, its KV cache and verification live.

The engine talks to it through `TargetSide`; `LocalTarget` runs the runtime in-process, and
`link.remote.RemoteTarget` makes the same calls over the network. Only token ids, parents,
verdicts and per-token context for the drafter (`decoding.context`) cross this seam, never logits or
the target's KV cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from moaspec.decoding.context import Context
from moaspec.decoding.grammar import GrammarMismatch
from moaspec.decoding.logit_rules import LogitRules, RuleState
from moaspec.decoding.prefix_cache import PrefixCache, common_prefix
from moaspec.decoding.sampling import SamplingParams, TokenNoise
from moaspec.decoding.tree import Tree
from moaspec.decoding.verify import Verdict, verify
from moaspec.errors import ContextLengthError, UserError
from moaspec.models.linear import QUANTISED
from moaspec.models.runtime import PREFILL_CHUNK, ForwardOut, KVCache, Rows, Transformer

if TYPE_CHECKING:
    from moaspec.decoding.scheduler import Scheduler


class TargetUnavailable(UserError):
    """The target cannot be reached, or stopped answering (a remote target's network or server)."""


class ContextEncoder(Protocol):
    """Target-side part of a drafter (MoA's Layer Self-Attention + projection): turns the target's
    state for newly committed cache slots into the per-token context the drafter consumes."""

    hidden_layers: tuple[int, ...]  # layers whose input states `encode` reads (num_layers: the final state)

    def encode(self, cache: KVCache, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> Context: ...


@dataclass
class DeferredContext:
    """A context not encoded yet: committed slots [start, end) of a local target's cache (and the rows of
    the hidden states its encoder reads), which a drafter encodes when it next drafts (`resolve`), several
    rounds' slots in one call. In one process only, for drafters that take it (`catch_up`): a hybrid
    drafter whose model drafts in few rounds then pays its encoder only for those, and in batches
    (cheaper per token)."""

    encoder: ContextEncoder
    cache: KVCache
    start: int
    end: int
    epoch: int
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # {layer: [end - start, D]}

    def __len__(self) -> int:
        return self.end - self.start

    def follows(self, other: DeferredContext) -> bool:
        return self.encoder is other.encoder and self.cache is other.cache and \
            (self.epoch, self.start) == (other.epoch, other.end)

    def resolve(self) -> Context:
        if self.cache.epoch != self.epoch or self.end > self.cache.length:
            raise RuntimeError("a deferred context outlived its cache slots (the cache was reset or truncated)")
        return self.encoder.encode(self.cache, torch.arange(self.start, self.end), self.hidden)


def resolve_contexts(pending: list[DeferredContext]) -> list[Context]:
    """Encode deferred contexts, adjacent slot ranges in one call each."""
    runs: list[DeferredContext] = []
    for c in pending:
        if runs and c.follows(runs[-1]):
            prev = runs[-1]
            runs[-1] = DeferredContext(c.encoder, c.cache, prev.start, c.end, c.epoch,
                                       {k: torch.cat([prev.hidden[k], h]) for k, h in c.hidden.items()})
        else:
            runs.append(c)
    return [r.resolve() for r in runs if len(r)]


@dataclass(frozen=True)
class Candidates:
    """The target's top-k next tokens after each row of a pass, with their probabilities: the context a
    drafter that recycles them takes (`drafters.recycling`), in place of an encoder's."""

    tokens: list[int]  # the rows' tokens
    ids: torch.Tensor  # [rows, k] int64
    probs: torch.Tensor  # [rows, k] float32


def top_candidates(tokens: list[int], logits: torch.Tensor, k: int) -> Candidates:
    probs, ids = torch.softmax(logits.float(), -1).topk(k, -1)
    return Candidates(list(tokens), ids, probs)


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
# a token's log-probability and its likeliest alternatives [(id, log-probability)]
TokenLogprob = tuple[float, list[tuple[int, float]]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under its row of `logits` [n, V] (the target's raw distribution), with the
    `top` likeliest ids of that row."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top == 0:
        return [(c, []) for c in chosen]
    vals, ids = logp.topk(top, -1)
    return [(c, list(zip(i, v, strict=True))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist(), strict=True)]


@dataclass
class Step:
    verdict: Verdict
    context: Context | None = None  # what the drafter needs for the newly committed tokens
    length: int = 0  # tokens committed in the target's cache after this step
    target_ms: float = 0.0  # the target's own time for the step (a remote caller's rest is the network)
    cached: int = 0  # a start's prompt tokens found in a kept KV cache (not prefilled)
    logprobs: list[TokenLogprob] | None = None  # per new token (verdict.new_tokens), when the start asked
    pass_rows: int = 0  # rows of the target pass this step rode in, other sequences' included (0: unknown)


class TargetSide(Protocol):
    eos_token_ids: tuple[int, ...]
    max_seq_len: int

    def start(self, prompt: list[int], params: SamplingParams, max_new_tokens: int | None = None,
              resume: bool = False, logprobs: int | None = None, rules: LogitRules | None = None) -> Step:
        """Prefill a prompt and give the first token; `max_new_tokens`: at most how many tokens follow (a
        server sizes the generation's memory by it); `resume`: the prompt is a generation's prompt and
        verified output, started again after the target went away (a server then takes it up to its
        whole context, not only its longest new prompt); `logprobs`: every step of this generation
        reports its tokens' log-probabilities with that many alternatives (`Step.logprobs`); `rules`:
        what verification does to the logits before it picks (bias, penalties, a grammar)."""
        ...

    def verify(self, tree: Tree) -> Step: ...

    def pass_costs(self) -> dict[int, float]:
        """ms of one target pass per row count (what a k-row tree costs the target itself)."""
        ...

    def reconnect_in_background(self) -> None:
        """After a TargetUnavailable: start getting a new session ready, without blocking."""
        ...

    def available(self) -> bool:
        """Whether calls can go through (a remote target: a session is open or has been reopened)."""
        ...

    def release(self) -> None:
        """The generation ended: free what it holds on the target side (a server's memory, a batched
        pass's wait for it). The next `start` begins afresh."""
        ...


class LocalTarget:
    """A target in this process: prefill, score a tree in one pass, verify, commit the path. It works
    on its own `KVCache` (default: the model's), so several can share one model's weights; with a
    `Scheduler` its passes join those of the other sequences of the model (continuous batching)."""

    def __init__(self, model: Transformer, encoder: ContextEncoder | None = None, cache: KVCache | None = None,
                 costs: dict[int, float] | None = None, defer_context: bool = False,
                 scheduler: Scheduler | None = None, candidates: int = 0, prefix: PrefixCache | None = None):
        """`prefix`: finished sessions' caches a start may copy its prompt's longest cached prefix from
        (besides this target's own cache, which keeps the last generation's tokens until the next start)."""
        self.model = model
        self.prefix = prefix
        # a drafter without an encoder that recycles the target's top-k: its context is `Candidates`
        self.candidates = candidates if encoder is None else 0
        self.scheduler = scheduler
        self.encoder = encoder
        # hand out `DeferredContext`s (to a drafter that asks for them and takes them)
        self.defer_context = defer_context and encoder is not None
        self.cache = model.cache if cache is None else cache
        self.eos_token_ids = model.cfg.eos_token_ids
        self.max_seq_len = self.cache.size
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None  # unseeded sampling's draws
        self.noise: TokenNoise | None = None  # seeded sampling's race
        self.costs = costs
        self.logprobs: int | None = None  # the generation's `start(logprobs=...)`
        self.rules: RuleState | None = None  # the generation's `start(rules=...)`, following its tokens

    @property
    def length(self) -> int:
        return self.cache.length

    def pass_costs(self) -> dict[int, float]:
        if self.costs is None:
            self.costs = self.model.pass_costs()
        return self.costs

    def reconnect_in_background(self) -> None:  # in this process it never goes away
        pass

    def available(self) -> bool:
        return True

    def release(self) -> None:
        if self.scheduler is not None:
            self.scheduler.leave(self)

    def _pass(self, rows: Rows) -> ForwardOut:
        if self.scheduler is not None:
            return self.scheduler.run(rows, self, self.model)
        return self.model.forward_batch([rows])[0]

    def _context(self, first_slot: int, out: ForwardOut, rows: list[int] | slice) -> Context | None:
        if self.encoder is None:
            return None
        hidden = {k: v[rows] for k, v in out.hidden.items()}
        if self.defer_context:
            return DeferredContext(self.encoder, self.cache, first_slot, self.cache.length, self.cache.epoch, hidden)
        slots = torch.arange(first_slot, self.cache.length)
        return self.encoder.encode(self.cache, slots, hidden)

    def _step(self, verdict: Verdict, context: Context | None, t0: float, cached: int = 0) -> Step:
        return Step(verdict, context, self.cache.length, (time.perf_counter() - t0) * 1e3, cached)

    @property
    def row_invariant(self) -> bool:
        """Whether a slot's K/V are the same bits however rows are grouped into passes (the quantised modes'
        kernels): then any kept prefix is as good as a cold prefill."""
        m = self.model
        return m.kernels is not None and m.weights in QUANTISED and m.row_invariant

    def _usable(self, cache: KVCache, common: int, prompt: list[int]) -> int:
        """How much of `cache`'s `common` leading slots a start of `prompt` may keep and stay lossless: at
        least the last prompt token is run (its logits give the first token); where passes are not
        row-invariant, only whole prefill chunks that a cold prefill computes alike."""
        n = min(common, len(prompt) - 1)
        if not self.row_invariant:
            n = min(n, cache.exact) // PREFILL_CHUNK * PREFILL_CHUNK
        return max(n, 0)

    def _reuse(self, prompt: list[int]) -> int:
        """Keep the longest usable cached prefix of `prompt` in this target's cache (its own tokens, or a
        copy from the prefix cache); the slots kept. A drafter with a context encoder reads every prompt
        slot's hidden state, which no cache keeps: its starts prefill all."""
        if self.encoder is not None:
            self.cache.reset()
            return 0
        own = self._usable(self.cache, common_prefix(self.cache.ids[:self.cache.known], prompt), prompt)
        got = 0 if self.prefix is None else self.prefix.copy_best(
            self.model, prompt, self.cache, lambda c, n: self._usable(c, n, prompt), at_least=own + 1)
        if not got:
            self.cache.truncate(own) if own else self.cache.reset()
        if self.prefix is not None:
            self.prefix.count(got or own)
        return got or own

    def start(self, prompt: list[int], params: SamplingParams, max_new_tokens: int | None = None,
              resume: bool = False, logprobs: int | None = None, rules: LogitRules | None = None) -> Step:
        t0 = time.perf_counter()
        self.logprobs = logprobs
        if not prompt:
            raise UserError("the prompt is empty")
        if len(prompt) >= self.max_seq_len:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; this model's context holds {self.max_seq_len}"
            )
        if rules is not None and rules.active:
            rules.check_vocab(self.model.cfg.vocab_size)
            self.rules = rules.follow(prompt)
        else:
            self.rules = None
        self.params = params
        self.noise = None if params.greedy else params.noise()
        self.generator = None if params.greedy or self.noise is not None else params.generator()
        kept = self._reuse(prompt)
        hidden = self.encoder.hidden_layers if self.encoder else ()
        out = self.model.prefill(prompt[kept:], hidden_layers=hidden, cache=self.cache, run=self._pass)
        self.cache.ids = list(prompt)
        self.cache.exact = len(prompt) if self.row_invariant else len(prompt) // PREFILL_CHUNK * PREFILL_CHUNK
        # the first token is the bonus of verifying an empty draft after the prompt's last token
        root = Tree.chain(prompt[-1])
        first = verify(root, out.logits[-1:], params, self.generator, self.noise, len(prompt) - 1,
                       self.rules.walk(root) if self.rules is not None else None).bonus
        if self.rules is not None:
            self.rules.take(first)
        if self.candidates:
            step = self._step(Verdict([], [], first), top_candidates(prompt[-1:], out.logits[-1:], self.candidates),
                              t0, kept)
        else:
            step = self._step(Verdict([], [], first), self._context(0, out, slice(None)), t0, kept)
        if self.logprobs is not None:
            step.logprobs = token_logprobs(out.logits[-1:], [first], self.logprobs)
        return step

    def verify(self, tree: Tree) -> Step:
        t0 = time.perf_counter()
        start = self.cache.length
        # drafts the grammar refuses are never accepted: the pass scores only the others
        keep = self.rules.keep(tree) if self.rules is not None else None
        scored, index = tree.restrict(keep) if keep is not None else (tree, None)
        single = len(scored) == 1
        out = self._pass(Rows(
            torch.tensor(scored.tokens), self.cache,
            positions=None if single else scored.positions(start),
            tree_mask=None if single else scored.mask(),
            hidden_layers=self.encoder.hidden_layers if self.encoder else (),
        ))
        rows = out.logits if index is None else _Rows(out.logits, index, tree.tokens)
        verdict = verify(tree, rows, self.params, self.generator, self.noise, start,
                         self.rules.walk(tree) if self.rules is not None else None)
        if self.rules is not None:
            self.rules.take(verdict.bonus)
        path = verdict.path if index is None else [index[i] for i in verdict.path]  # rows of the pass
        self.cache.commit(path)
        if len(self.cache.ids) == start:  # the committed slots' ids, for a later start's prefix
            self.cache.ids.extend(scored.tokens[i] for i in path)
            if self.row_invariant:
                self.cache.exact = self.cache.length
        if self.candidates:
            step = self._step(verdict, top_candidates(scored.tokens, out.logits, self.candidates), t0)
        else:
            step = self._step(verdict, self._context(start, out, path), t0)
        if self.logprobs is not None:  # token k was scored by the row of the path node before it
            step.logprobs = token_logprobs(out.logits[path], verdict.new_tokens, self.logprobs)
        step.pass_rows = out.pass_rows or len(scored)
        return step


class _Rows:
    """The logits of a pass over part of a tree, read by the whole tree's node indices."""

    def __init__(self, logits: torch.Tensor, index: dict[int, int], tokens: list[int]):
        self.logits, self.index, self.tokens = logits, index, tokens

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.index:  # accepted although pruned: the grammar's mask allowed what it refuses
            raise GrammarMismatch(self.tokens[node])
        return self.logits[self.index[node]]
