"""The speculative decoding loop: propose, verify, observe; plain decoding is the empty drafter.

The engine does not know which drafter runs or whether the target is remote. At T > 0 it asks the
drafter for sampled children (`SampledTreeConfig`), seeded per call from a random stream of the
generation's own, apart from the target's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from moaspec.decoding.drafter import Drafter
from moaspec.decoding.logit_rules import LogitRules
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.target import MAX_TOP_LOGPROBS, TargetSide, TargetUnavailable, TokenLogprob
from moaspec.decoding.tree import AdaptiveChain, DraftSampling, Tree, TreeConfig
from moaspec.errors import ContextLengthError, UserError

DRAFT_STREAM = 1  # SamplingParams.generator stream of the drafts' seeds
RESYNC_POLICIES = ("correct", "keep")
RESYNC_CHAIN = 16  # unverified tokens re-verified per target call after a reconnection
MAX_RESYNC_FAILURES = 4  # reconnections in a row that fail again before re-verifying: then the generation ends


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # At T > 0, sample draft children from the drafter's distribution (accepted up to 1 - TV(p, q) per
    # draft) rather than take its top-k (accepted with p(x)); both are exact. No effect at T = 0.
    sampled_drafts: bool = True
    # A remote target that stops answering: keep writing with the drafter alone (tokens marked
    # unverified) while it reconnects in the background, then re-verify them in a new session and
    # "correct" them where the target disagrees, or "keep" them as context. False: raise.
    offline: bool = True
    resync: str = "correct"
    reconnect_timeout_s: float = 30.0  # how long to wait for the target once nothing more can be drafted
    # each new token's log-probability under the target (its raw distribution, as verification scored it),
    # with that many likeliest alternatives (0: the token's own only); None: none
    logprobs: int | None = None
    # what verification does to the target's logits before it picks: bias, penalties, a grammar
    rules: LogitRules | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
        if self.resync not in RESYNC_POLICIES:
            raise UserError(f"resync must be one of {', '.join(RESYNC_POLICIES)}, got {self.resync!r}")
        if not (isinstance(self.reconnect_timeout_s, (int, float)) and not isinstance(self.reconnect_timeout_s, bool)
                and self.reconnect_timeout_s >= 0):
            raise UserError(f"reconnect_timeout_s must be >= 0, got {self.reconnect_timeout_s}")
        if self.logprobs is not None and not (type(self.logprobs) is int and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise UserError(f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS} (alternatives per token), "
                            f"got {self.logprobs!r}")


@dataclass
class Metrics:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in a kept KV cache (not prefilled again)
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1, per target call
    drafted_tokens: int = 0  # draft nodes sent to verification
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    unverified_tokens: int = 0  # written by the drafter alone while the target was away
    corrected_tokens: int = 0  # of those, dropped on re-verification (the target disagreed)
    reconnects: int = 0
    unverified_in_output: int = 0  # tokens of the final text that the target never verified (it stayed away)

    @property
    def target_calls(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: new tokens over the time after prefill."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "drafted_tokens": self.drafted_tokens,
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "total_s": round(self.total_s, 4),
            **({"unverified_tokens": self.unverified_tokens, "corrected_tokens": self.corrected_tokens,
                "reconnects": self.reconnects} if self.reconnects or self.unverified_tokens else {}),
        }


@dataclass
class Chunk:
    tokens: list[int]  # token ids emitted by this round (after stop handling)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or None while running
    verified: bool = True  # False: written by the drafter alone while the target was away
    rollback: int = 0  # drop this many earlier unverified tokens before appending `tokens` (a correction)
    # per token, who wrote it: the drafter whose draft the target accepted (its name, or a hybrid's part),
    # or TARGET for the target's own token (the first of a generation, and each round's bonus)
    origins: list[str] = field(default_factory=list)
    # per token, with `GenerationConfig.logprobs`: (its log-probability, [(id, log-probability)] alternatives)
    logprobs: list[TokenLogprob] | None = None


TARGET = "target"
GRAMMAR = "grammar"  # a token the output's grammar forced, drafted by the engine itself


class Engine:
    def __init__(self, target: TargetSide, drafter: Drafter | None = None, tree: TreeConfig | None = None,
                 adapt: AdaptiveChain | None = None):
        self.target = target
        self.drafter = drafter
        self.tree = tree or TreeConfig()
        self.adapt = adapt  # with an adaptive tree: picks each call's number of levels
        if self.tree.adaptive and (adapt is None or adapt.width != self.tree.topk):
            raise ValueError("an adaptive tree needs its AdaptiveChain (verify costs of this machine), as wide "
                             "as the tree's levels")
        self.metrics = Metrics()
        self._guide = None  # a generation's grammar matcher (`_stream`), for the tokens it forces

    def check(self, prompt: list[int], cfg: GenerationConfig) -> None:
        if not prompt:
            raise UserError("the prompt is empty")
        limit = self.target.max_seq_len
        if len(prompt) >= limit:
            raise ContextLengthError(f"the prompt has {len(prompt)} tokens; the context holds {limit}: shorten it")
        if len(prompt) + cfg.max_new_tokens > limit:
            raise ContextLengthError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the context of "
                f"{limit} tokens; shorten the prompt or lower --max-new-tokens to {max(0, limit - len(prompt))}"
            )

    def stream(self, prompt: list[int], cfg: GenerationConfig) -> Iterator[Chunk]:
        """Yield the tokens of each round as they are verified. Stop strings are the caller's job
        (they need text); EOS and max_new_tokens are handled here. `self.metrics` fills as it runs.
        However it ends (finished, or the caller stops iterating), the target is told (`release`)."""
        self.check(prompt, cfg)
        try:
            yield from self._stream(prompt, cfg)
        finally:
            self.target.release()

    def _stream(self, prompt: list[int], cfg: GenerationConfig) -> Iterator[Chunk]:
        m = self.metrics = Metrics(prompt_tokens=len(prompt))
        eos = () if cfg.ignore_eos else self.target.eos_token_ids
        t0 = time.perf_counter()
        step = self.target.start(prompt, cfg.sampling, cfg.max_new_tokens, logprobs=cfg.logprobs, rules=cfg.rules)
        length = step.length
        m.prefill_s = time.perf_counter() - t0
        m.cached_tokens = step.cached
        if self.drafter is not None:
            self.drafter.begin(prompt, step.context)
        if self.adapt is not None:
            self.adapt.reset()
        drafts = cfg.sampling.generator(DRAFT_STREAM) if cfg.sampled_drafts and not cfg.sampling.greedy else None
        self._drafts, self._t0 = drafts, t0
        # the grammar's own place, on the drafting side: the tokens it forces are drafted for the drafter
        self._guide = cfg.rules.grammar.matcher() if cfg.rules is not None and cfg.rules.grammar is not None else None
        new = step.verdict.new_tokens
        origins = [TARGET] * len(new)
        lps = step.logprobs
        root = new[-1]
        out: list[int] = []  # verified new tokens so far
        rollback = 0
        while True:
            room = cfg.max_new_tokens - m.new_tokens
            cut = next((i for i, t in enumerate(new) if t in eos), None)
            if cut is not None or len(new) >= room:
                n = min(room, len(new) if cut is None else cut)
                m.new_tokens += n
                m.total_s = time.perf_counter() - t0
                yield Chunk(new[:n], "stop" if cut is not None and cut < room else "length", rollback=rollback,
                            origins=origins[:n], logprobs=lps[:n] if lps is not None else None)
                return
            m.new_tokens += len(new)
            m.total_s = time.perf_counter() - t0
            out += new
            yield Chunk(new, rollback=rollback, origins=origins, logprobs=lps)
            rollback = 0
            if self._guide is not None:
                for t in new:
                    self._guide.take(t)

            t1 = time.perf_counter()
            tree = self._propose(root, cfg.max_new_tokens - m.new_tokens, length, self._draft_sampling(cfg, length))
            t2 = time.perf_counter()
            try:
                step = self.target.verify(tree)
            except TargetUnavailable:
                if not cfg.offline:
                    raise
                resumed = yield from self._offline(prompt, out, root, cfg, eos)
                if resumed is None:
                    return
                new, origins, length, rollback = resumed
                lps = None
                root = new[-1]
                continue
            t3 = time.perf_counter()
            v, length = step.verdict, step.length
            if self.drafter is not None:
                self.drafter.observe([root, *v.accepted], step.context)
            draft_s = t2 - t1 + time.perf_counter() - t3
            forced = tree.origins.get(1) == GRAMMAR
            if self.adapt is not None and not forced:
                self.adapt.update(max(tree.depths), len(v.accepted), draft_s, t3 - t2, step.target_ms / 1e3,
                                  rows=len(tree) - 1, pass_rows=step.pass_rows or None)
            m.draft_s += draft_s
            m.verify_s += t3 - t2
            m.accept_lengths.append(len(v.accepted) + 1)
            m.drafted_tokens += len(tree) - 1
            new = v.new_tokens
            origins = [tree.origins.get(i, self.drafter.name if self.drafter is not None else TARGET)
                       for i in v.path[1:]] + [TARGET]
            lps = step.logprobs
            root = v.bonus

    def _draft_sampling(self, cfg: GenerationConfig, root_index: int) -> DraftSampling | None:
        """How this call's drafts are sampled; `root_index`: the sequence index of the root token (a
        seeded generation's drafts then draw with the target's own race noise)."""
        if self._drafts is None:
            return None
        seed = int(torch.randint(2**62, (), generator=self._drafts))
        return DraftSampling(cfg.sampling, seed, position=None if cfg.sampling.seed is None else root_index)

    # ------------------------------------------------------------------ a target that went away
    def _offline(self, prompt: list[int], out: list[int], root: int, cfg: GenerationConfig,
                 eos: tuple[int, ...]) -> Iterator[Chunk]:
        """The target stopped answering after `out` (its last token `root` verified but not yet in the
        target's cache). Draft alone, one token at a time, marked unverified, while the target reconnects
        in the background; once it is back, re-verify (`_resync`). Returns what the main loop goes on
        with, (new tokens, their origins, cache length, rollback), or None if the generation ended unverified."""
        m = self.metrics
        unverified: list[int] = []
        alone = self.drafter is not None
        ended = False
        failed = 0  # re-verifications that lost the target again
        while True:
            self.target.reconnect_in_background()
            waited_from = None
            while not self.target.available():
                room = cfg.max_new_tokens - len(out) - len(unverified)
                if alone and not ended and room > 0:
                    sampling = self._draft_sampling(cfg, len(prompt) + len(out) + len(unverified) - 1)
                    shape = TreeConfig(1, 1, 1)
                    tree = self.drafter.propose(root, shape if sampling is None else shape.sampled(sampling))
                    if len(tree) > 1:
                        self.drafter.observe([root], None)
                        root = tree.tokens[1]
                        if root in eos:  # the end, as the drafter sees it: the target will say
                            ended = True
                            continue
                        unverified.append(root)
                        m.unverified_tokens += 1
                        m.total_s = time.perf_counter() - self._t0
                        yield Chunk([root], verified=False, origins=[self.drafter.name])
                        continue
                    alone = False  # a drafter that needs the target's state (or found nothing): wait
                waited_from = waited_from or time.perf_counter()
                if time.perf_counter() - waited_from > cfg.reconnect_timeout_s:
                    if not unverified:
                        raise TargetUnavailable(f"the target server did not come back within "
                                                f"{cfg.reconnect_timeout_s:.0f} s and the drafter cannot write alone")
                    m.total_s = time.perf_counter() - self._t0
                    yield Chunk([], "stop" if ended else "length", verified=False)
                    return None
                time.sleep(0.02)
            try:
                return self._resync(prompt, out, unverified, cfg)
            except TargetUnavailable:
                alone = False  # the drafter's state went with the failed session: wait for the next one
                failed += 1
                if failed >= MAX_RESYNC_FAILURES:  # a server that answers but never holds a session: give up
                    if not unverified:
                        raise
                    m.total_s = time.perf_counter() - self._t0
                    yield Chunk([], "stop" if ended else "length", verified=False)
                    return None

    def _resync(self, prompt: list[int], out: list[int], unverified: list[int],
                cfg: GenerationConfig) -> tuple[list[int], list[str], int, int]:
        """A new session from the verified text; then each unverified token is verified as a draft (chains
        of RESYNC_CHAIN), which keeps the output exact: the first one the target rejects, and all after
        it, are replaced by the target's own token ("correct"); or the unverified tokens are kept as
        context ("keep")."""
        m = self.metrics
        m.reconnects += 1
        base = prompt + out
        keep = cfg.resync == "keep"
        step = self.target.start(base + unverified if keep else base, cfg.sampling,
                                 cfg.max_new_tokens - len(out), resume=True)
        if self.drafter is not None:
            self.drafter.begin(base + unverified if keep else base, step.context)
        if keep:
            out += unverified
            m.new_tokens += len(unverified)
            return step.verdict.new_tokens, [TARGET], step.length, 0
        bonus, i = step.verdict.bonus, 0
        while i < len(unverified) and bonus == unverified[i]:
            tree = Tree.chain(unverified[i], unverified[i + 1:i + RESYNC_CHAIN])
            step = self.target.verify(tree)
            if self.drafter is not None:
                self.drafter.observe([unverified[i], *step.verdict.accepted], step.context)
            i += 1 + len(step.verdict.accepted)
            bonus = step.verdict.bonus
        m.corrected_tokens += len(unverified) - i
        drafter = self.drafter.name if self.drafter is not None else TARGET
        return unverified[:i] + [bonus], [drafter] * i + [TARGET], step.length, len(unverified)

    def _propose(self, root: int, remaining: int, length: int, sampling: DraftSampling | None) -> Tree:
        # A draft deeper than the tokens still wanted, or than the cache holds (`length` committed), is
        # wasted work.
        room = min(remaining - 1, self.target.max_seq_len - length - 1)
        forced = self._guide.forced()[:max(room, 0)] if self._guide is not None else []
        if forced:  # the grammar allows one continuation: it is the draft (the drafter's could only be pruned)
            tree = Tree.chain(root, forced)
            tree.origins.update({i: GRAMMAR for i in range(1, len(tree))})
            return tree
        if self.drafter is None or room <= 0:
            return Tree.chain(root)
        cfg = self.tree
        if self.adapt is not None:
            d = self.adapt.choose()
            if d == 0:  # drafts are not paying here now: a plain step
                return Tree.chain(root)
            cfg = replace(cfg, depth=d, total_tokens=d * cfg.topk, adaptive=False)
        if room < cfg.total_tokens or room < cfg.depth:
            cfg = replace(cfg, depth=min(cfg.depth, room), total_tokens=min(cfg.total_tokens, room))
        return self.drafter.propose(root, cfg if sampling is None else cfg.sampled(sampling))
