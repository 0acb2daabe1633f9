"""Sampling parameters and the target distribution they define (temperature, top-k, top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moaspec.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1 disable those filters (applied in HF order:
    temperature, then top-k, then top-p)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be an integer >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, stream: int = 0) -> torch.Generator:
        """A generator seeded from `seed` (at random without one). Stream 0 is the target's draws;
        another stream gives the drafter a sequence of its own from the same seed, so that a seeded
        generation is reproducible and drafts never reuse the target's random numbers."""
        g = torch.Generator()
        if self.seed is None:
            g.manual_seed(torch.seed())
        elif stream == 0:
            g.manual_seed(self.seed)
        else:  # odd constants: the low 32 bits (all that MT19937 uses) never equal stream 0's for any seed
            g.manual_seed((self.seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9) % 2**64)
        return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution that sampling must reproduce exactly, over the last dim of `logits`."""
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = x.sort(dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())
