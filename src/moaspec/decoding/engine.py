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

from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.target import TargetSide
from moaspec.decoding.tree import AdaptiveChain, DraftSampling, Tree, TreeConfig
from moaspec.drafters.base import Drafter
from moaspec.errors import ContextLengthError, UserError

DRAFT_STREAM = 1  # SamplingParams.generator stream of the drafts' seeds


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # At T > 0, sample draft children from the drafter's distribution (accepted up to 1 - TV(p, q) per
    # draft) rather than take its top-k (accepted with p(x)); both are exact. No effect at T = 0.
    sampled_drafts: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")


@dataclass
class Metrics:
    prompt_tokens: int = 0
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1, per target call
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

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
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "total_s": round(self.total_s, 4),
        }


@dataclass
class Chunk:
    tokens: list[int]  # token ids emitted by this round (after stop handling)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or None while running


class Engine:
    def __init__(self, target: TargetSide, drafter: Drafter | None = None, tree: TreeConfig | None = None,
                 adapt: AdaptiveChain | None = None):
        self.target = target
        self.drafter = drafter
        self.tree = tree or TreeConfig()
        self.adapt = adapt  # with an adaptive tree: picks each call's chain length
        if self.tree.adaptive and adapt is None:
            raise ValueError("an adaptive tree needs its AdaptiveChain (verify costs of this machine)")
        self.metrics = Metrics()

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
        (they need text); EOS and max_new_tokens are handled here. `self.metrics` fills as it runs."""
        self.check(prompt, cfg)
        m = self.metrics = Metrics(prompt_tokens=len(prompt))
        eos = () if cfg.ignore_eos else self.target.eos_token_ids
        t0 = time.perf_counter()
        step = self.target.start(prompt, cfg.sampling)
        length = step.length
        m.prefill_s = time.perf_counter() - t0
        if self.drafter is not None:
            self.drafter.begin(prompt, step.context)
        if self.adapt is not None:
            self.adapt.reset()
        drafts = cfg.sampling.generator(DRAFT_STREAM) if cfg.sampled_drafts and not cfg.sampling.greedy else None
        new = step.verdict.new_tokens
        root = new[-1]
        while True:
            room = cfg.max_new_tokens - m.new_tokens
            cut = next((i for i, t in enumerate(new) if t in eos), None)
            if cut is not None or len(new) >= room:
                n = min(room, len(new) if cut is None else cut)
                m.new_tokens += n
                m.total_s = time.perf_counter() - t0
                yield Chunk(new[:n], "stop" if cut is not None and cut < room else "length")
                return
            m.new_tokens += len(new)
            m.total_s = time.perf_counter() - t0
            yield Chunk(new)

            t1 = time.perf_counter()
            sampling = None if drafts is None else \
                DraftSampling(cfg.sampling, int(torch.randint(2**62, (), generator=drafts)))
            tree = self._propose(root, cfg.max_new_tokens - m.new_tokens, length, sampling)
            t2 = time.perf_counter()
            step = self.target.verify(tree)
            t3 = time.perf_counter()
            v, length = step.verdict, step.length
            if self.drafter is not None:
                self.drafter.observe([root, *v.accepted], step.context)
            draft_s = t2 - t1 + time.perf_counter() - t3
            if self.adapt is not None:
                self.adapt.update(len(tree) - 1, len(v.accepted), draft_s, t3 - t2, step.target_ms / 1e3)
            m.draft_s += draft_s
            m.verify_s += t3 - t2
            m.accept_lengths.append(len(v.accepted) + 1)
            new = v.new_tokens
            root = v.bonus

    def _propose(self, root: int, remaining: int, length: int, sampling: DraftSampling | None) -> Tree:
        # A draft deeper than the tokens still wanted, or than the cache holds (`length` committed), is
        # wasted work.
        room = min(remaining - 1, self.target.max_seq_len - length - 1)
        if self.drafter is None or room <= 0:
            return Tree.chain(root)
        cfg = self.tree
        if self.adapt is not None:
            d = self.adapt.choose()
            cfg = TreeConfig(d, 1, d)
        if room < cfg.total_tokens or room < cfg.depth:
            cfg = replace(cfg, depth=min(cfg.depth, room), total_tokens=min(cfg.total_tokens, room))
        return self.drafter.propose(root, cfg if sampling is None else cfg.sampled(sampling))
