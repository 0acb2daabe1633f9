"""Sampling parameters and the target distribution they define (temperature, top-k, top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from moaspec.errors import UserError

RACE_HEAD = 64  # tokens of p raced one by one; the rest of p races as one (`TokenNoise.pick`)
# below this a temperature is greedy (as vLLM does): logits / 1e-300 overflow to inf, and the distribution at
# such a temperature is the argmax to every digit a float holds
MIN_TEMPERATURE = 1e-5


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0, top_p 1 and min_p 0 disable those filters (applied in HF order:
    temperature, then top-k, then top-p, then min-p: tokens under min_p times the likeliest's probability)."""

    temperature: float = 0.0  # below MIN_TEMPERATURE: 0 (greedy)
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (_number(self.temperature) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not (_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)):
            raise UserError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise UserError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")

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

    def noise(self) -> TokenNoise | None:
        """The seeded race's noise (None without a seed: then sampling draws from `generator`)."""
        return None if self.seed is None else TokenNoise(self.seed)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uint64 -> well-mixed uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class TokenNoise:
    """Exp(1) noise E(position, token), a pure function of (seed, position, token id).

    Seeded sampling is the exponential race: the token at sequence position t is argmax_x p(x) / E(t, x),
    which is distributed exactly as p (the Gumbel-max trick) and depends on nothing but the seed and the
    target's own distributions. So a seeded generation is the same with every drafter, and a drafter that
    draws its children with the same noise (argmax q / E) proposes the token the target will pick
    whenever q and p agree (verification then just follows that token, as at T = 0)."""

    _TAIL, _PICK = -1, -2  # ids of the tail's one racer and of its inverse-CDF uniform

    def __init__(self, seed: int):
        self.seed = seed

    def _uniform(self, position: int, ids: np.ndarray) -> np.ndarray:
        key = _mix(np.array([self.seed % 2**64], dtype=np.uint64))
        key = _mix(key ^ np.array([position % 2**64], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        bits = _mix(key + (ids.astype(np.int64) + 2).astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93))
        return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53  # in (0, 1)

    def exp(self, position: int, ids: torch.Tensor) -> torch.Tensor:
        """E(position, id) for each target token id in `ids` (float64)."""
        return torch.from_numpy(-np.log(self._uniform(position, ids.numpy()))).reshape(ids.shape)

    def pick(self, probs: torch.Tensor, position: int) -> int:
        """The race's winner under p = `probs` [V]. Exact and cheap: the RACE_HEAD likeliest tokens race with
        their own noise, the rest as one racer of their total mass (the minimum of independent Exp(p(x))
        times is Exp of their sum); if that one wins, its token is drawn from the tail by inverse CDF."""
        p = probs.double()
        head = p.topk(min(RACE_HEAD, p.numel()))
        race = head.values / self.exp(position, head.indices)
        best = int(race.argmax())
        tail_mass = float(p.sum() - head.values.sum())
        if tail_mass <= 0 or tail_mass / float(self.exp(position, torch.tensor([self._TAIL]))) <= float(race[best]):
            return int(head.indices[best])
        rest = p.clone()
        rest[head.indices] = 0.0
        cdf = rest.cumsum(0)
        u = float(self._uniform(position, np.array([self._PICK]))[0]) * float(cdf[-1])
        return min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64))), p.numel() - 1)


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
        drop[..., 0] = False  # and always the top token (a top_p under fp32's least value drops none else)
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    if params.min_p > 0.0:  # p(x) < min_p * max p  <=>  logit(x) < max logit + log(min_p)
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + math.log(params.min_p), float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())
