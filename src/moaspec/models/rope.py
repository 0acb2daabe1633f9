"""Rotary position tables: the plain rotation and the scalings that model families use to run past the
context they were trained on (linear, Llama 3's, YaRN, LongRoPE, or per-frequency factors stored in a GGUF).

A scaling is the Hugging Face `rope_parameters`/`rope_scaling` dict of a model's config (`rope_type` and its
numbers); a GGUF file's are turned into the same dict by its family (`families`). Tables hold
`cat(freqs, freqs)` (transformers' rotate-half layout), scaled by the attention factor where the scaling
has one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from moaspec.errors import UserError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def inv_freq(theta: float, dim: int, scaling: Mapping | None = None, max_len: int = 0,
             factors: Sequence[float] | torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] of a rotation over `dim` features, and the factor that scales its
    tables. `factors`: per-frequency divisors stored with the weights (a GGUF's `rope_freqs`, Llama 3's
    scaling precomputed). `max_len`: the context this model runs with (LongRoPE picks its long factors
    past the original context, as llama.cpp does by context size)."""
    base = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # float32, as transformers
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    s = scaling or {}
    attn = 1.0
    if kind == "default":
        inv = base
    elif kind == "linear":
        inv = base / float(s["factor"])
    elif kind == "llama3":
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > old / low, base / factor, base)
        smooth = (old / wavelen - low) / (high - low)
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "yarn":
        inv, attn = _yarn(theta, dim, s, base)
    elif kind == "longrope":
        old = int(s["original_max_position_embeddings"])
        factor = float(s.get("factor") or 1.0)
        attn = s.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
        ext = s["long_factor"] if max_len > old else s["short_factor"]
        inv = base / torch.tensor(ext, dtype=torch.float32)
    else:
        raise UserError(f"unsupported RoPE scaling {kind!r}; this runtime runs {', '.join(ROPE_TYPES)}")
    if factors is not None:
        inv = inv / torch.as_tensor(factors, dtype=torch.float32).reshape(-1)
    if inv.shape[0] != dim // 2:
        raise UserError(f"RoPE scaling gives {inv.shape[0]} frequencies for a rotation over {dim} features")
    return inv.float(), float(attn)


def _yarn(theta: float, dim: int, s: Mapping, base: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: interpolate the low frequencies, keep the high."""
    factor = float(s["factor"])
    old = float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        ms, ms_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)

    def correction(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return base / factor * (1 - keep) + base * keep, float(attn)


def tables(theta: float, head_dim: int, length: int, device: torch.device | str = "cpu",
           scaling: Mapping | None = None, factors: Sequence[float] | torch.Tensor | None = None,
           max_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, head_dim] of positions 0..length-1 (transformers' rotate-half layout)."""
    inv, attn = inv_freq(theta, head_dim, scaling, max_len or length, factors)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attn != 1.0:
        cos, sin = cos * attn, sin * attn
    return cos.to(device), sin.to(device)
