"""Where a model's tensors come from, one tensor at a time: a GGUF file (memory-mapped, each tensor in the
file's own block format) or a folder of safetensors. The runtime builds its kernels tensor by tensor from
a source, so no whole-model float copy exists at any moment; a GGUF tensor's mapped pages are given back
once its kernel holds its own copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from moaspec.errors import UserError
from moaspec.models.gguf_file import FLOAT_TYPES, GGUFFile, hf_name, unpermute_rows

GGUF_POINTER = "gguf.json"  # in a model folder: the GGUF file whose tensors the folder describes


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor in float32 (de-quantised where the file holds blocks)."""

    def blocks(self, name: str) -> tuple[str, np.ndarray, int] | None:
        """(format, bytes [rows, bytes per row], row length) where the file holds the tensor quantised, else
        None."""

    def release(self, name: str) -> None:
        """The caller holds what it needs of the tensor: its file pages may go."""


class SafetensorsWeights:
    """The `*.safetensors` files of a Hugging Face folder, read tensor by tensor (any float dtype)."""

    def __init__(self, folder: Path, device: torch.device):
        from safetensors import safe_open

        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise UserError(f"no *.safetensors (and no {GGUF_POINTER}) in {folder}: not a model folder")
        self.device = device
        self._where = {}
        self._handles = [safe_open(str(f), framework="pt", device=str(device)) for f in files]
        for h in self._handles:
            for key in h.keys():
                self._where[key] = h

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UserError(f"the model has no tensor {name!r}")
        return self._where[name].get_tensor(name)

    def blocks(self, name: str) -> None:
        return None

    def release(self, name: str) -> None:
        pass


class GGUFWeights:
    """A GGUF file's tensors under their Hugging Face names, q and k of llama files in transformers' row order."""

    def __init__(self, gguf: GGUFFile, heads: int, kv_heads: int):
        self.gguf = gguf
        self._names = {hf: g for g in gguf.tensors if (hf := hf_name(gguf, g)) is not None}
        self._heads = (heads, kv_heads)

    def _gguf_name(self, name: str) -> str:
        if name not in self._names:
            raise UserError(f"{self.gguf.path.name} has no tensor for {name!r}")
        return self._names[name]

    def has(self, name: str) -> bool:
        return name in self._names

    def _order(self, g: str) -> np.ndarray | None:
        return unpermute_rows(self.gguf, g, *self._heads)

    def tensor(self, name: str) -> torch.Tensor:
        g = self._gguf_name(name)
        t = self.gguf.dequantize(g, self._order(g))
        info = self.gguf.tensors[g]
        return t.reshape(-1) if len(info.shape) == 1 else t

    def blocks(self, name: str) -> tuple[str, np.ndarray, int] | None:
        g = self._gguf_name(name)
        info = self.gguf.tensors[g]
        if info.type in FLOAT_TYPES or len(info.shape) != 2:
            return None
        raw = self.gguf.raw(g)
        order = self._order(g)
        return info.type.name, (raw if order is None else raw[order]), info.shape[0]

    def release(self, name: str) -> None:
        if name in self._names:
            self.gguf.release(self._names[name])


def gguf_path(folder: str | Path) -> Path | None:
    """The GGUF file a model folder stands for (None for a folder of safetensors)."""
    pointer = Path(folder) / GGUF_POINTER
    if not pointer.is_file():
        return None
    try:
        return Path(json.loads(pointer.read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{pointer} is damaged ({e}); delete {folder} and run again to rebuild it") from e


def open_weights(folder: str | Path, heads: int, kv_heads: int, device: torch.device,
                 fused: dict[str, list[tuple[str, int]]] | None = None) -> WeightSource:
    """The tensors of a model folder: its GGUF file's where it names one, else its safetensors. `fused`: a
    family's stacked tensors (module path -> the module paths and row counts they stack), served as their
    pieces (`Unfused`)."""
    path = gguf_path(folder)
    if path is None:
        src: WeightSource = SafetensorsWeights(Path(folder), device)
    elif not path.is_file():
        raise UserError(f"{folder} describes {path}, which is gone; reinstall the model or pass the file again")
    else:
        src = GGUFWeights(GGUFFile(path), heads, kv_heads)
    return Unfused(src, fused) if fused else src


class Unfused:
    """A source whose family stacks tensors by rows (Phi-3's qkv_proj and gate_up_proj), answering for the
    pieces they stack: the runtime asks every family for q, k, v, gate and up alike. A block-format tensor's
    rows are independent, so a slice of its rows is a block tensor too."""

    def __init__(self, src: WeightSource, fused: dict[str, list[tuple[str, int]]]):
        self.src = src
        self.gguf = getattr(src, "gguf", None)
        self._pieces: dict[str, tuple[str, int, int]] = {}
        self._left: dict[str, int] = {}
        for whole, pieces in fused.items():
            row = 0
            for piece, rows in pieces:
                self._pieces[piece] = (whole, row, row + rows)
                row += rows
            self._left[whole] = len(pieces)

    def has(self, name: str) -> bool:
        return name in self._pieces or self.src.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._pieces:
            return self.src.tensor(name)
        whole, a, b = self._pieces[name]
        return self.src.tensor(whole)[a:b]

    def blocks(self, name: str) -> tuple[str, np.ndarray, int] | None:
        if name not in self._pieces:
            return self.src.blocks(name)
        whole, a, b = self._pieces[name]
        found = self.src.blocks(whole)
        return None if found is None else (found[0], found[1][a:b], found[2])

    def release(self, name: str) -> None:
        if name not in self._pieces:
            self.src.release(name)
            return
        whole = self._pieces[name][0]
        self._left[whole] -= 1
        if self._left[whole] == 0:
            self.src.release(whole)

    def _gguf_name(self, name: str) -> str:
        return self.src._gguf_name(name)  # type: ignore[attr-defined]


class RowTable:
    """An embedding table [V, D] kept in the file's block format (a Q4_K table of Qwen 1.5B: 131 MB, not
    the 933 MB of its float32 copy) and de-quantised a few rows at a time by gguf's reference code, which
    treats each row alone: a row's values never depend on the other rows asked for."""

    def __init__(self, source: GGUFWeights, name: str):
        found = source.blocks(name)
        assert found is not None
        self.fmt, raw, _ = found
        from gguf import GGMLQuantizationType

        self.qtype = GGMLQuantizationType[self.fmt]
        self.raw = np.ascontiguousarray(raw)  # its own copy: the mapped pages go back
        source.release(name)
        info = source.gguf.tensors[source._gguf_name(name)]
        self.shape = (info.shape[1], info.shape[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        picked = self.raw[ids.reshape(-1).cpu().numpy()]
        return torch.from_numpy(dequantize(picked, self.qtype).reshape(-1, self.shape[1]).astype(np.float32))

    def full(self) -> torch.Tensor:
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(self.raw, self.qtype).reshape(self.shape).astype(np.float32))

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes
