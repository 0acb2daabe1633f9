"""The frozen target's features of every training token, computed once and kept on disk.

The target's pass is most of a training step's cost (51-76% measured), and it never changes, so a
token's features are computed the first time an example is used and read back from then on: the
second epoch, every further drafter trained on the same data and the points of a learning curve cost
only the drafters' own passes. Stored as fp16 memory-mapped .npy files (sparse until written) under
the model cache, keyed by the target's weights, the layers kept and the examples' token ids; a
per-example flag records what is written, so a stopped job keeps what it computed. A cache over the
same tokens that keeps more layers (written for other drafters, e.g. MoA N=1 beside N=0) serves a
run that needs fewer: each folder's meta.json says what it holds. Nothing here
goes into git: the committed token ids rebuild it.

The data job can store the features beside the answers it writes (`moaspec data --engine moaspec
--features`): `Recorder` keeps the target's state from the very passes that wrote an answer, so
self-distillation data costs one target pass per token instead of two, and `AnswerFeatures` holds them
by sequence id for `FeatureCache` to read instead of computing. They come from the weight mode that
wrote the answers (the target the drafter will serve), so a run reads them only when it trains on that
mode (`moaspec train --target-weights MODE`).

Per token: every layer's K and V (MoA's Layer Self-Attention reads them all) and the input of the
chosen layers (the final normed state for the regression loss and the soft labels, the input of
layer L-N for Target Layer Inference); for validation examples also the full-vocabulary argmax.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numpy.lib.format import open_memmap

from moaspec.files import atomic_write
from moaspec.models.runtime import Transformer
from moaspec.models.store import cache_dir

FEATURES_VERSION = 1
RECORDED_TLI = (0, 1, 3)  # the data job keeps the input of layers L - N for these MoA N (0: the final state)


@dataclass
class Features:
    """One sequence's target features: K, V [L, Hkv, T, d]; hidden {layer: [T, D]} (layer L = final
    normed state); argmax [T] or None."""

    K: torch.Tensor
    V: torch.Tensor
    hidden: dict[int, torch.Tensor]
    argmax: torch.Tensor | None = None

    def to(self, device: torch.device) -> Features:
        return Features(self.K.to(device), self.V.to(device), {k: h.to(device) for k, h in self.hidden.items()},
                        None if self.argmax is None else self.argmax.to(device))


def compute(target: Transformer, ids: list[int], layers: tuple[int, ...], greedy: bool) -> Features:
    """One target pass (no autograd) over a whole sequence."""
    t = target
    t.reset()
    out = t.forward(torch.tensor(ids, device=t.device), logits_rows=slice(0, 0), hidden_layers=layers)
    K, V = (x.clone() for x in t.kv(slice(0, len(ids))))
    hidden = {i: h.clone() for i, h in out.hidden.items()}
    argmax = None
    if greedy:
        with torch.inference_mode():
            argmax = t.lm_head(hidden[t.cfg.num_layers]).argmax(-1).clone()
    return Features(K, V, hidden, argmax)


class Recorder:
    """A target-side encoder (`decoding.target.ContextEncoder`) that keeps, instead of encoding, the state
    of every committed position: K/V of every layer and the input of `hidden_layers` (fp16, as the
    feature cache stores them). `pipeline.SpecDecoder.record` feeds it."""

    def __init__(self, hidden_layers: tuple[int, ...], stop_token: int):
        self.hidden_layers = tuple(sorted(hidden_layers))
        self.stop_token = stop_token
        self.kv: list[np.ndarray] = []  # [n, 2, L, Hkv, d] per commit
        self.hidden: dict[int, list[np.ndarray]] = {layer: [] for layer in self.hidden_layers}
        self.length = 0

    def encode(self, cache, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        if slots.numel() and int(slots[0]) != self.length:
            raise RuntimeError(f"recorded positions jump from {self.length} to {int(slots[0])}")
        K, V = cache.kv(slots)
        self.kv.append(torch.stack([K, V]).permute(3, 0, 1, 2, 4).to(torch.float16).numpy())
        for layer in self.hidden_layers:
            self.hidden[layer].append(hidden[layer].to(torch.float16).numpy())
        self.length += slots.numel()

    def final_token(self, generation) -> int:
        """The data job stores an answer that ended on its own with `stop_token` after it."""
        return self.stop_token if generation.finish_reason == "stop" else generation.token_ids[-1]

    def arrays(self) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """kv [T, 2, L, Hkv, d] and {layer: [T, D]}, fp16."""
        return np.concatenate(self.kv), {layer: np.concatenate(h) for layer, h in self.hidden.items()}


class AnswerFeatures:
    """Features the data job stored beside its answers: one `<sequence id>.npz` per sequence (its token
    ids, kv, hidden of each kept layer), under the model cache, keyed by the target's weights and the weight
    mode that wrote them. Written to a temporary name and renamed, so a stopped job never leaves a file
    that reads as whole."""

    def __init__(self, fingerprint: str, weights: str, root: Path | None = None):
        self.folder = (root or cache_dir() / "features") / f"answers-{fingerprint[:16]}-{weights}"

    def exists(self) -> bool:
        return self.folder.is_dir()

    def write(self, sid: str, ids: list[int], kv: np.ndarray, hidden: dict[int, np.ndarray]) -> None:
        if kv.shape[0] != len(ids) or any(h.shape[0] != len(ids) for h in hidden.values()):
            raise ValueError(f"features of {kv.shape[0]} positions for a sequence of {len(ids)} tokens")
        self.folder.mkdir(parents=True, exist_ok=True)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, ids=np.asarray(ids, dtype=np.uint32), kv=kv, **{f"hidden{k}": h for k, h in hidden.items()})

        atomic_write(self.folder / f"{sid}.npz", write)

    def read(self, sid: str, ids: list[int], layers: tuple[int, ...]
             ) -> tuple[np.ndarray, dict[int, np.ndarray]] | None:
        """The features of the first len(ids) positions of sequence `sid`, or None when not stored, stored
        for other tokens, without one of `layers`, or unreadable."""
        try:
            with np.load(self.folder / f"{sid}.npz") as z:
                stored = z["ids"]
                if len(stored) < len(ids) or not np.array_equal(stored[:len(ids)], np.asarray(ids, dtype=np.uint32)):
                    return None
                if any(f"hidden{layer}" not in z.files for layer in layers):
                    return None
                n = len(ids)
                return z["kv"][:n], {layer: z[f"hidden{layer}"][:n] for layer in layers}
        except (OSError, ValueError, KeyError, EOFError):
            return None


META = "meta.json"


def _wider_cache(root: Path, sequences_key: str, layers: tuple[int, ...]) -> tuple[Path, tuple[int, ...]] | None:
    """A cache folder over the same sequences (and target, and greedy flag) that keeps a superset of
    `layers`, with the layers it keeps; the one with the fewest layers."""
    found = []
    for meta in root.glob(f"*/{META}"):
        try:
            m = json.loads(meta.read_text())
            kept = tuple(sorted(int(x) for x in m["layers"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if m.get("sequences_key") == sequences_key and set(layers) <= set(kept):
            found.append((len(kept), str(meta.parent), kept))
    if not found:
        return None
    _, folder, kept = min(found)
    return Path(folder), kept


class FeatureCache:
    """Features of a fixed list of sequences, by index; `get` computes and stores on first use (every
    layer the folder keeps, which may be more than asked for when a wider cache is reused)."""

    def __init__(self, target: Transformer, fingerprint: str, sequences: list[list[int]], layers: tuple[int, ...],
                 greedy: bool, root: Path | None = None, stored: AnswerFeatures | None = None,
                 names: list[str] | None = None):
        """`stored` and `names` (each sequence's id): features the data job wrote, read instead of
        computed where they cover a sequence (and, for `greedy`, computed anyway: the argmax needs the
        head)."""
        self.target, self.layers, self.greedy = target, tuple(sorted(layers)), greedy
        self.stored = stored if stored is not None and names is not None and not greedy else None
        self.names = names
        self.read_tokens = 0
        c = target.cfg
        root = root or cache_dir() / "features"
        h = hashlib.sha256(json.dumps([FEATURES_VERSION, fingerprint, self.layers, greedy]).encode())
        seqs = hashlib.sha256(json.dumps([FEATURES_VERSION, fingerprint, greedy]).encode())
        for ids in sequences:
            key = np.asarray(ids, dtype=np.uint32).tobytes() + b"|"
            h.update(key)
            seqs.update(key)
        self.folder = root / h.hexdigest()[:16]
        if not self.folder.exists():  # the features of more layers (other drafters) over the same tokens serve
            wider = _wider_cache(root, seqs.hexdigest(), self.layers)
            if wider is not None:
                self.folder, self.layers = wider
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = {"sequences_key": seqs.hexdigest(), "layers": list(self.layers), "sequences": len(sequences)}
        if not (self.folder / META).exists():
            (self.folder / META).write_text(json.dumps(meta))
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        n = int(self.offsets[-1])
        self.kv = self._array("kv", (n, 2, c.num_layers, c.num_kv_heads, c.head_dim), np.float16)
        self.hidden = {layer: self._array(f"hidden{layer}", (n, c.hidden_size), np.float16) for layer in self.layers}
        self.argmax = self._array("argmax", (n,), np.int32) if greedy else None
        self.done = self._array("done", (len(sequences),), np.bool_)
        self.sequences = sequences
        self.compute_s, self.computed_tokens = 0.0, 0

    def _array(self, name: str, shape: tuple[int, ...], dtype) -> np.memmap:
        path = self.folder / f"{name}.npy"
        if path.exists():
            arr = np.load(path, mmap_mode="r+")
            if arr.shape == shape and arr.dtype == dtype:
                return arr
        return open_memmap(path, mode="w+", dtype=dtype, shape=shape)

    def get(self, i: int) -> Features:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        got = None if self.done[i] or self.stored is None else \
            self.stored.read(self.names[i], self.sequences[i], self.layers)
        if got is not None:
            self.kv[a:b], hidden = got
            for layer in self.layers:
                self.hidden[layer][a:b] = hidden[layer]
            self.done[i] = True
            self.read_tokens += b - a
        if not self.done[i]:
            t0 = time.perf_counter()
            f = compute(self.target, self.sequences[i], self.layers, self.greedy)
            self.kv[a:b, 0] = f.K.permute(2, 0, 1, 3).cpu().numpy()
            self.kv[a:b, 1] = f.V.permute(2, 0, 1, 3).cpu().numpy()
            for layer in self.layers:
                self.hidden[layer][a:b] = f.hidden[layer].cpu().numpy()
            if self.argmax is not None:
                self.argmax[a:b] = f.argmax.cpu().numpy()
            self.done[i] = True
            self.compute_s += time.perf_counter() - t0
            self.computed_tokens += b - a
        # read back even when just computed, so that every epoch sees the same fp16-rounded features
        kv = torch.from_numpy(np.ascontiguousarray(self.kv[a:b])).float()  # [T, 2, L, Hkv, d]
        K, V = kv[:, 0].permute(1, 2, 0, 3), kv[:, 1].permute(1, 2, 0, 3)
        hidden = {layer: torch.from_numpy(np.ascontiguousarray(self.hidden[layer][a:b])).float()
                  for layer in self.layers}
        argmax = torch.from_numpy(self.argmax[a:b].astype(np.int64)) if self.argmax is not None else None
        return Features(K, V, hidden, argmax)

    def flush(self) -> None:
        for arr in (self.kv, *self.hidden.values(), self.done, *((self.argmax,) if self.argmax is not None else ())):
            arr.flush()
