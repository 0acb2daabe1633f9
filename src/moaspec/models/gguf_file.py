"""A GGUF file as the runtime reads it: its metadata, the model configuration it describes, its tokenizer,
and each tensor's bytes memory-mapped in the file's own format (nothing is de-quantised here unless asked).

The header is parsed here rather than by gguf's `GGUFReader`, which builds a numpy view per vocabulary
string: it took 6.6 s to open Qwen2.5-Coder-1.5B's file on this machine, this parser ~0.3 s. gguf supplies
the type codes, block sizes and the reference de-quantisation of formats without a kernel of ours.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moaspec.errors import UserError
from moaspec.models.families import Family, gguf_archs, gguf_family

FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_LIMIT = 1 << 40  # no count in a sane header comes near this


class GGUFError(UserError):
    """A file that is not a GGUF this runtime can read; the message names the file and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length (the inputs of a weight)
    type: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1


class LazyStrings(Sequence[str]):
    """A GGUF string array, decoded on first use."""

    def __init__(self, raw: bytes, n: int):
        self._raw, self._n, self._items = raw, n, None

    def _decoded(self) -> list[str]:
        if self._items is None:
            raw, pos, items = self._raw, 0, []
            for _ in range(self._n):
                size = int.from_bytes(raw[pos:pos + 8], "little")
                items.append(raw[pos + 8:pos + 8 + size].decode("utf-8", "replace"))
                pos += 8 + size
            self._items, self._raw = items, b""
        return self._items

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._decoded()[i]

    def __iter__(self):
        return iter(self._decoded())


class _Cursor:
    """Little-endian reads from the mapped header, with a clear error at the end of the file."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path} ends inside its header: the file is truncated; re-download or reinstall it")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def count(self) -> int:
        n = self.take("<Q")
        if n > _LIMIT:
            raise GGUFError(f"{self.path} has a corrupt header (a count of {n}); re-download or reinstall it")
        return n

    def string(self) -> str:
        n = self.count()
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path} ends inside its header: the file is truncated; re-download or reinstall it")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", "replace")

    def strings(self, n: int) -> LazyStrings:
        """A string array, stepped over (its bytes kept) and decoded only when read: the runtime never reads
        the vocabulary (~150k strings, ~0.35 s to decode), only the tokenizer's first build does."""
        begin = self.pos
        for _ in range(n):
            size = self.count()
            if self.pos + size > len(self.buf):
                raise GGUFError(f"{self.path} ends inside its header: the file is truncated; re-download or "
                                "reinstall it")
            self.pos += size
        return LazyStrings(bytes(self.buf[begin:self.pos]), n)

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _ARRAY:
            inner, n = self.take("<I"), self.count()
            if inner == _STRING:
                return self.strings(n)
            if inner in _NUMPY:
                width = np.dtype(_NUMPY[inner]).itemsize
                if self.pos + n * width > len(self.buf):
                    raise GGUFError(f"{self.path} ends inside its header: the file is truncated")
                out = np.frombuffer(self.buf, _NUMPY[inner], n, self.pos).copy()
                self.pos += n * width
                return out
            return [self.value(inner) for _ in range(n)]
        raise GGUFError(f"{self.path} has a corrupt header (value type {kind}); re-download or reinstall it")


class GGUFFile:
    """The header of a GGUF file (metadata and tensor table), checked against the file's size, and its
    tensors memory-mapped on demand."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            raise GGUFError(f"cannot read {self.path}: {e.strerror or e}") from e
        if buf is None or size < 24 or buf[:4] != _MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic at its start); pass a .gguf model file")
        try:
            self._parse(_Cursor(buf, self.path), size)
        finally:
            buf.close()
        self._data: np.memmap | None = None

    def _parse(self, c: _Cursor, size: int) -> None:
        c.pos = 4
        self.version = c.take("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path} is GGUF version {self.version}; this runtime reads versions 2 and 3")
        n_tensors, n_kv = c.count(), c.count()
        self.meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            self.meta[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = c.take("<I")
            if dims > 4:
                raise GGUFError(f"{self.path} has a corrupt tensor entry ({name!r} with {dims} dimensions)")
            shape = tuple(c.count() for _ in range(dims))
            kind, offset = c.take("<I"), c.count()
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has an unknown type {kind}; a newer llama.cpp "
                                "wrote it, or the file is corrupt") from None
            infos.append((name, shape, qtype, offset))
        align = int(self.meta.get("general.alignment", 32))
        start = -(-c.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            block, nbytes = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape, dtype=np.int64))
            if not shape or shape[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} {shape} does not fill whole {qtype.name} blocks")
            info = TensorInfo(name, shape, qtype, start + offset, n // block * nbytes)
            if info.offset + info.nbytes > size:
                raise GGUFError(f"{self.path} is truncated: tensor {name!r} ends at byte {info.offset + info.nbytes}, "
                                f"the file has {size}; re-download or reinstall it")
            self.tensors[name] = info

    # ------------------------------------------------------------------ metadata
    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", "?"))

    def key(self, name: str, default=None):
        """An architecture-scoped key (`llama.block_count` for name "block_count")."""
        return self.meta.get(f"{self.architecture}.{name}", default)

    # ------------------------------------------------------------------ tensors
    def _map(self) -> np.memmap:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._data

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, [rows, bytes per row] (memory-mapped, read-only), or for a float
        tensor its values [rows, row length]."""
        info = self.tensors[name]
        data = self._map()[info.offset:info.offset + info.nbytes]
        if info.type in FLOAT_TYPES:
            return data.view(FLOAT_TYPES[info.type]).reshape(info.rows, info.shape[0])
        return data.reshape(info.rows, -1)

    def dequantize(self, name: str, rows: np.ndarray | slice | None = None) -> torch.Tensor:
        """float32 [rows, row length] of the tensor (or of the chosen rows), by gguf's reference code."""
        from gguf.quants import dequantize

        info = self.tensors[name]
        raw = self.raw(name)
        if rows is not None:
            raw = raw[rows]
        if info.type in FLOAT_TYPES:
            return torch.from_numpy(np.array(raw, dtype=np.float32))
        out = dequantize(np.ascontiguousarray(raw), info.type)
        return torch.from_numpy(out.reshape(raw.shape[0], info.shape[0]).astype(np.float32, copy=False))

    def release(self, name: str) -> None:
        """Tell the kernel the tensor's mapped pages are no longer needed (they stop counting as resident)."""
        data = self._data
        if data is None or not hasattr(data, "_mmap") or data._mmap is None:
            return
        info = self.tensors[name]
        page = mmap.PAGESIZE
        begin = info.offset // page * page
        end = min(len(data), -(-(info.offset + info.nbytes) // page) * page)
        try:
            data._mmap.madvise(mmap.MADV_DONTNEED, begin, end - begin)
        except (OSError, ValueError, AttributeError):
            pass

    def close(self) -> None:
        self._data = None


# ---------------------------------------------------------------------- configuration

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
TOKENIZERS = ("gpt2", "llama")  # byte-level BPE; SentencePiece (BPE by scores, byte fallback)


def file_family(gguf: GGUFFile) -> Family:
    """The family of the file's architecture, or a GGUFError naming what runs."""
    fam = gguf_family(gguf.architecture)
    if fam is None:
        raise GGUFError(f"{gguf.path.name}: unsupported architecture {gguf.architecture!r}; this runtime runs "
                        f"GGUF files of {', '.join(gguf_archs())} (Llama 2/3.x and Mistral files are 'llama')")
    return fam


def hf_name(gguf: GGUFFile, name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for tensors the runtime does not use)."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        piece = file_family(gguf).tensors.get(parts[2])
        if piece is not None:
            return f"model.layers.{parts[1]}.{piece}.{parts[3]}"
    return None


def check_family(gguf: GGUFFile) -> Family:
    """Refuse at once, before anything is written, a file whose family, RoPE or tokenizer this runtime cannot
    run; return its family."""
    fam = file_family(gguf)
    scaling = gguf.key("rope.scaling.type")
    if scaling not in (None, "none", "linear", "yarn"):
        raise GGUFError(f"{gguf.path.name}: RoPE scaling {scaling!r} is not supported; this runtime runs linear "
                        "and YaRN scaling, Llama 3's (rope_freqs) and Phi-3's LongRoPE")
    if (gguf.key("rope.dimension_count") or 0) not in (0, int(gguf.key("attention.key_length") or 0) or
                                                       int(gguf.key("embedding_length")) //
                                                       int(gguf.key("attention.head_count"))):
        raise GGUFError(f"{gguf.path.name}: RoPE over part of each head (partial rotary) is not supported yet")
    if gguf.meta.get("tokenizer.ggml.model") not in TOKENIZERS:
        raise GGUFError(f"{gguf.path.name}: tokenizer {gguf.meta.get('tokenizer.ggml.model')!r} is not supported; "
                        "this runtime reads byte-level BPE (gpt2) and SentencePiece (llama) vocabularies")
    if "token_embd.weight" not in gguf.tensors:
        raise GGUFError(f"{gguf.path.name} has no token_embd.weight tensor: not a causal language model file")
    return fam


def hf_config(gguf: GGUFFile) -> dict:
    """The Hugging Face style config.json of the model the file holds (`ModelConfig.from_folder` reads it)."""
    fam = check_family(gguf)
    heads = int(gguf.key("attention.head_count"))
    hidden = int(gguf.key("embedding_length"))
    embd = gguf.tensors["token_embd.weight"]
    eos = gguf.meta.get("tokenizer.ggml.eos_token_id")
    eot = gguf.meta.get("tokenizer.ggml.eot_token_id")
    stops = [int(t) for t in (eos, eot) if t is not None]
    if fam.stop_tokens:  # the turn ends the family's chat format uses, where the vocabulary has them
        wanted = set(fam.stop_tokens)
        stops += [i for i, t in enumerate(gguf.meta["tokenizer.ggml.tokens"]) if t in wanted and i not in stops]
    config = {
        "architectures": [fam.hf_class],
        "model_type": fam.name,
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(gguf.key("feed_forward_length")),
        "num_hidden_layers": int(gguf.key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.key("attention.head_count_kv", heads)),
        "head_dim": int(gguf.key("attention.key_length", hidden // heads)),
        "rope_theta": float(gguf.key("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(gguf.key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(gguf.key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "bos_token_id": gguf.meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stops or None,
        "torch_dtype": "float32",
    }
    scaling, factor = gguf.key("rope.scaling.type"), gguf.key("rope.scaling.factor")
    if scaling == "linear" and factor:
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif scaling == "yarn":
        orig = int(gguf.key("rope.scaling.original_context_length"))
        config["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor),
                                  "original_max_position_embeddings": orig}
    if "rope_freqs.weight" in gguf.tensors:  # Llama 3's scaling as per-frequency divisors
        config["rope_factors"] = gguf.dequantize("rope_freqs.weight").reshape(-1).tolist()
    if fam.gguf_config is not None:
        config.update(fam.gguf_config(gguf))
    return config


def file_type_name(ftype: object) -> str | None:
    """llama.cpp's name of a `general.file_type` (15: "Q4_K_M"), or None where it names none."""
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_")  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def summary(gguf: GGUFFile) -> dict:
    """What a user asks of a GGUF before running it, from its header alone: family, parameters, format,
    context, tokenizer, file size, and whether it runs here (else why not)."""
    fmt = file_type_name(gguf.meta.get("general.file_type"))
    if fmt is None:  # the commonest tensor format stands for the file
        kinds = [t.type.name for t in gguf.tensors.values() if len(t.shape) == 2]
        fmt = max(set(kinds), key=kinds.count) if kinds else "?"
    try:
        fam, reason = check_family(gguf).name, None
    except GGUFError as e:
        fam, reason = None, str(e).split(": ", 1)[-1]
    return {"path": str(gguf.path), "architecture": gguf.architecture, "family": fam,
            "name": gguf.meta.get("general.name"),
            "parameters": int(sum(np.prod(t.shape, dtype=np.int64) for t in gguf.tensors.values())),
            "format": fmt, "context": gguf.key("context_length"), "tokenizer": gguf.meta.get("tokenizer.ggml.model"),
            "bytes": gguf.path.stat().st_size, "runs": reason is None, "why_not": reason}


def unpermute_rows(gguf: GGUFFile, name: str, heads: int, kv_heads: int) -> np.ndarray | None:
    """Row order that undoes llama.cpp's permutation of a llama file's q and k weights (its converter
    interleaves each head's two rotary halves; this runtime rotates halves, as transformers does), or None
    where the tensor is stored in order."""
    if not file_family(gguf).permuted_qk:
        return None
    piece = name.split(".")[2] if name.startswith("blk.") else ""
    if piece not in ("attn_q", "attn_k"):
        return None
    n_head = heads if piece == "attn_q" else kv_heads
    rows = gguf.tensors[name].rows
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


# ---------------------------------------------------------------------- tokenizer

# How each pre-tokenizer named by `tokenizer.ggml.pre` splits text before the byte-level BPE.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT,
           "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4


def build_tokenizer(gguf: GGUFFile):
    """The file's vocabulary as a `tokenizers.Tokenizer` (with its special tokens): byte-level BPE split as its
    `tokenizer.ggml.pre` says, or SentencePiece (`_sentencepiece`); llama.cpp's token ids, no transformers
    needed."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    meta = gguf.meta
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    if meta.get("tokenizer.ggml.model") == "llama":
        tok = _sentencepiece(gguf, tokens)
    else:
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]  # type: ignore[union-attr]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre == "smollm":  # digits one by one, then GPT-2's byte-level split (SmolLM2's own tokenizer)
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
        elif pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), "isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    types = [] if types is None else list(types)  # type: ignore[arg-type]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types, strict=False) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types, strict=False) if k == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], int(bos))])
    return tok


def _sentencepiece(gguf: GGUFFile, tokens: list[str]):
    """A SentencePiece BPE vocabulary (`tokenizer.ggml.model` llama: Llama 2, Mistral, Gemma, Phi-3) as a
    `tokenizers` BPE: merges ranked by the score of the piece they make (SentencePiece merges the pair whose
    result scores highest), unknown bytes as <0xNN> pieces, spaces as U+2581."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    meta = gguf.meta
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise GGUFError(f"{gguf.path.name}: a SentencePiece vocabulary without scores cannot be read")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores, strict=False):
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((a, b, float(score)) for a, b in local)
    merges.sort(key=lambda m: m[2], reverse=True)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, [(a, b) for a, b, _ in merges], unk_token=tokens[int(unk)] if unk is not None
                               else None, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    tail = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    return tok


def tokenizer_config(gguf: GGUFFile) -> dict:
    """tokenizer_config.json for the built tokenizer: its special tokens by name."""
    tokens = gguf.meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = gguf.meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None  # type: ignore[index]

    return {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"), "pad_token": token("padding_token_id") or token("eos_token_id"),
            "unk_token": token("unknown_token_id"), "model_max_length": int(gguf.key("context_length", 4096))}
