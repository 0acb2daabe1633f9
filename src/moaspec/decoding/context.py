"""What crosses the target seam for the drafter: typed per-token payloads and their wire encoding.

A drafter's target-side encoder turns the target's state for newly verified tokens into a `Context`
(MoA: context vectors, and for TLI N > 0 the K/V of the target's last N layers; EAGLE-2: final hidden
states). In one process the object is handed over as it is; across the network it travels as
safetensors bytes, in fp32, fp16 (the default: half the bytes, drafts barely change) or int8 (a scale
per row of 32-bit floats' last dimension: a quarter of the bytes). Verification stays exact whatever
the encoding, since only the drafts depend on it.
"""

from __future__ import annotations

import json
import struct
from typing import ClassVar, Protocol, TypeVar

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from moaspec.errors import UserError

WIRE_DTYPES = ("fp32", "fp16", "int8")


class Context(Protocol):
    """A payload for n newly verified tokens."""

    kind: ClassVar[str]

    def __len__(self) -> int: ...

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its float tensors by name (what goes on the wire)."""
        ...

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Context: ...


KINDS: dict[str, type] = {}
C = TypeVar("C", bound=type)


def register(cls: C) -> C:
    """Class decorator: a context kind that `decode` can rebuild."""
    KINDS[cls.kind] = cls
    return cls


def _quantise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
    return (t / scale).round().clamp(-127, 127).to(torch.int8), scale.half()


def encode(ctx: Context, dtype: str = "fp16") -> bytes:
    """safetensors bytes of a context (`dtype` among WIRE_DTYPES)."""
    if dtype not in WIRE_DTYPES:
        raise UserError(f"unknown wire dtype {dtype!r}; choose one of {', '.join(WIRE_DTYPES)}")
    out: dict[str, torch.Tensor] = {}
    for name, t in ctx.tensors().items():
        t = t.detach().to("cpu", torch.float32)
        if dtype == "int8" and t.numel():
            out[name], out[f"{name}.scale"] = _quantise(t)
        else:
            out[name] = t.half() if dtype == "fp16" else t
        out[name] = out[name].contiguous()
    return st_save(out, metadata={"kind": ctx.kind, "dtype": dtype})


def decode(data: bytes, device: torch.device | str = "cpu") -> Context:
    """The context `encode` wrote (fp32 tensors on `device`). UserError on bytes that are not one."""
    try:
        raw, meta = st_load(data), _metadata(data)
    except Exception as e:  # safetensors raises several types on malformed bytes
        raise UserError(f"malformed context payload: {e}") from None
    cls = KINDS.get(meta.get("kind", ""))
    if cls is None:
        raise UserError(f"unknown context kind {meta.get('kind')!r} (known: {', '.join(KINDS) or 'none'})")
    tensors = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        scale = raw.get(f"{name}.scale")
        t = t.float() * scale.float() if scale is not None else t.float()
        tensors[name] = t.to(device)
    return cls.from_tensors(tensors)


def _metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of safetensors bytes (their JSON header; `load` drops it)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return header.get("__metadata__", {}) or {}
