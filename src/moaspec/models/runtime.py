"""A compact decoder runtime built for speculative decoding, one for every family (`models/families`: Llama,
Mistral, Qwen2, Qwen3, Gemma 3, Phi-3; the spec says what differs).

It owns a static KV cache (batch 1) and offers what the engine and the drafters need:
prefill, scoring a draft tree in one pass (tree mask + per-node positions), committing the accepted
path (compacting the cache), the K/V of every layer and the hidden states of chosen layers.
transformers is only the tests' oracle.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from moaspec.errors import ContextLengthError, UserError
from moaspec.models import blocks, families, quant, rope
from moaspec.models.families import GELU_TANH, Family
from moaspec.models.linear import (
    AUTO,
    FEW_ROWS,
    GGUF,
    QUANTISED,
    WEIGHT_CHOICES,
    Linear,
    Parts,
    WeightMode,
    runnable_mode,
    tensor_mode,
)
from moaspec.models.weights import RowTable, WeightSource, gguf_path, open_weights

# Prompt rows per pass. Small enough that a prompt beside other sequences in a batched pass holds them up
# for little more than a decode step; large enough to run near the kernels' prefill speed.
PREFILL_CHUNK = 64


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    model_type: str
    eos_token_ids: tuple[int, ...]
    # what the family spec (`families`) and its config add to Llama's block
    family: Family = field(default_factory=lambda: families.family("llama"), compare=False, repr=False)
    rope_scaling: dict | None = field(default=None, compare=False)  # global layers' (`rope.inv_freq`)
    rope_factors: tuple[float, ...] | None = None  # per-frequency divisors from a GGUF (Llama 3's rope_freqs)
    local_rope_theta: float | None = None  # sliding-window layers' own RoPE base (Gemma 3)
    windows: tuple[int, ...] = ()  # each layer's sliding window, 0 for full attention ((): none anywhere)
    query_scalar: float | None = None  # Gemma's query_pre_attn_scalar: q.k is scaled by its 1/sqrt (None: head_dim)

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        c = json.loads((Path(folder) / "config.json").read_text())
        fam = families.family(c.get("model_type"))
        glob, local = _rope_params(c)
        partial = glob.get("partial_rotary_factor", c.get("partial_rotary_factor")) or 1.0
        if float(partial) != 1.0:
            raise UserError(f"RoPE over part of each head (partial_rotary_factor {partial}) is not supported yet")
        scaling = {k: v for k, v in glob.items() if k not in ("rope_theta", "partial_rotary_factor")}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in rope.ROPE_TYPES:
            raise UserError(f"unsupported RoPE scaling {kind!r}; this runtime runs {', '.join(rope.ROPE_TYPES)}")
        if kind in ("llama3", "yarn", "longrope"):
            scaling.setdefault("original_max_position_embeddings", c.get("original_max_position_embeddings"))
        if kind == "longrope" and not scaling.get("factor"):
            scaling["factor"] = c["max_position_embeddings"] / scaling["original_max_position_embeddings"]
        eos = c.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        gen = Path(folder) / "generation_config.json"
        if gen.exists():
            g = json.loads(gen.read_text()).get("eos_token_id")
            eos += tuple(x for x in (g if isinstance(g, list) else [g]) if x is not None and x not in eos)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        windows = fam.layer_windows(c)
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rope_theta=float(glob.get("rope_theta", 10000.0)),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            max_position=int(c.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(c.get("tie_word_embeddings", fam.tied_by_default)),
            model_type=fam.name,
            eos_token_ids=eos,
            family=fam,
            rope_scaling=None if kind == "default" else scaling,
            rope_factors=tuple(c["rope_factors"]) if c.get("rope_factors") else None,
            local_rope_theta=float(local["rope_theta"]) if local and any(windows) else None,
            windows=windows if any(windows) else (),
            query_scalar=float(c["query_pre_attn_scalar"]) if c.get("query_pre_attn_scalar") else None,
        )

    @property
    def attn_scale(self) -> float:
        """The factor of q.k: 1/sqrt of the family's query scalar, else of head_dim."""
        return self.query_scalar ** -0.5 if self.query_scalar else 1.0 / math.sqrt(self.head_dim)

    @property
    def embed_scale(self) -> float:
        """The factor of a token's embedding (Gemma: sqrt(hidden))."""
        return math.sqrt(self.hidden_size) if self.family.embed_scale else 1.0

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def rope_tables(self, length: int, device: torch.device | str = "cpu", local: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, head_dim] of the global layers, or with `local` of the sliding-window layers."""
        if local and self.local_rope_theta is not None:
            return rope.tables(self.local_rope_theta, self.head_dim, length, device)
        return rope.tables(self.rope_theta, self.head_dim, length, device, self.rope_scaling, self.rope_factors)


def _rope_params(c: dict) -> tuple[dict, dict | None]:
    """(the global layers' RoPE parameters, the sliding-window layers' or None), each {rope_theta, rope_type,
    ...}, from transformers 5's `rope_parameters` (flat, or per layer type) or 4's rope_theta + rope_scaling."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return dict(params["full_attention"]), params.get("sliding_attention")
    if isinstance(params, dict) and params:
        return dict(params), None
    glob = dict(c.get("rope_scaling") or {})
    glob["rope_theta"] = c.get("rope_theta", 10000.0)
    local = {"rope_theta": c["rope_local_base_freq"]} if c.get("rope_local_base_freq") else None
    return glob, local


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(theta: float, head_dim: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv = 1.0 / (theta**exponents)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` with one temporary fewer (same operations in the same order, so the same rounding);
    inference only (in-place on its own temporaries)."""
    return (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """A RoPE sine table [..., d] with the rotate-half sign folded in: `rope_rows` needs no negation."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` (HF rotate-half) as x * cos + roll(x, d/2) * signed_sin(sin): 4 ops instead of 7, and
    the same rounding (the sign moved into the table is exact; no fused multiply-add)."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(sin_signed))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, d]; cos/sin: [n, d] (HF's rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def resolve_weights(mode: str, folder: str | Path, device: str | torch.device = "cpu") -> str:
    """The weight mode `auto` stands for: the fastest whose answers keep the model's own quality. A GGUF
    model runs in its file's own formats (`gguf`: each tensor in its block format, through the kernels of
    `blocks.py`); a folder of float weights runs int4 where they lie on int4's grid, else int8 (Qwen 0.5B
    against fp32: perplexity 4.637 vs 4.644, HumanEval 0.439 vs 0.433, where int4 costs 1.8 points); fp16
    where the compiled kernels cannot run. Other modes as given."""
    if mode not in WEIGHT_CHOICES:
        raise UserError(f"unknown weight mode {mode!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
    from_gguf = gguf_path(folder) is not None
    if mode == GGUF and not from_gguf:
        raise UserError(f"--weights gguf runs a GGUF file's own formats, and {folder} holds float weights; "
                        "choose int8, int4 or fp16")
    if mode != AUTO:
        return mode
    if torch.device(device).type != "cpu" or not quant.available():
        return "fp16"
    if from_gguf:
        return GGUF
    return "int4" if _native_int4(Path(folder)) else "int8"


def _native_int4(folder: Path, rows: int = 64) -> bool:
    """Whether the model's weights lie on int4's grid: the first rows of its first MLP projection decide."""
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            name = next((k for k in st.keys() if k.endswith("mlp.gate_proj.weight")), None)
            if name is not None:
                return quant.on_int4_grid(st.get_slice(name)[:rows].float())
    return False


def source_linear(src: WeightSource, names: list[str], mode: str, kind: str) -> Linear | Parts:
    """One kernel for the weights `names` stacked by output rows (q|k|v, gate|up), read from `src` tensor by
    tensor. In `gguf` mode a tensor keeps its file's block format where a kernel exists (stacked ones share
    one kernel where they share a format, else run as `Parts`); one in another format is de-quantised and
    runs in int8. `kind`: the module path that `tensor_mode` keys its choice on."""
    if mode == GGUF:
        found = [src.blocks(n) for n in names]
        fmts = {f[0] for f in found if f is not None}
        if None not in found and len(fmts) == 1:
            fmt, inp = found[0][0], found[0][2]
            raw = found[0][1] if len(found) == 1 else np.concatenate([f[1] for f in found])
            if blocks.supported(fmt, raw.shape[0], inp):
                lin = Linear.from_blocks(blocks.pack(fmt, raw, raw.shape[0], inp), _bias(src, names))
                for n in names:
                    src.release(n)
                return lin
        if len(names) > 1:
            return Parts([source_linear(src, [n], mode, kind) for n in names])
    weight = torch.cat([src.tensor(n) for n in names]) if len(names) > 1 else src.tensor(names[0])
    lin = Linear(weight, _bias(src, names), tensor_mode(mode, kind, weight))
    for n in names:
        src.release(n)
    return lin


def _stack_parts(lin: Linear | Parts | None) -> list[tuple] | None:
    """A layer slot as the compiled `Stack` takes it: parts (kind, tensors, bias, group) whose outputs lie side
    by side; kind 0 int8 [q, scale], 1 int4 [q, scale, offset] with its group, 2.. a GGUF block format
    (`blocks.stack_part`). None where a part has no compiled kernel (fp16, fp32)."""
    if lin is None:
        return None
    parts = []
    for part in lin.parts if isinstance(lin, Parts) else [lin]:
        bias = torch.empty(0) if part.bias is None else part.bias
        if part.blocks is not None:
            parts.append((*blocks.stack_part(part.blocks), bias, 0))
        elif part.q is not None:
            parts.append((0, [part.q, part.scale], bias, 0) if part.mode == "int8" else
                         (1, [part.q, part.scale, part.offset], bias, part.group))
        else:
            return None
    return parts


def _bias(src: WeightSource, names: list[str]) -> torch.Tensor | None:
    """The stacked biases of weights `names` (None where none has one; zeros for those without)."""
    names_b = [n.removesuffix("weight") + "bias" for n in names]
    if not any(src.has(b) for b in names_b):
        return None
    parts = []
    for n, b in zip(names, names_b, strict=True):
        if src.has(b):
            parts.append(src.tensor(b).float().reshape(-1))
        else:
            found = src.blocks(n)
            rows = found[1].shape[0] if found is not None else src.tensor(n).shape[0]
            parts.append(torch.zeros(rows))
    return torch.cat(parts)


def fused_pieces(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Each layer's stacked tensors of a family that stacks them (Phi-3): name -> [(piece name, rows)]."""
    rows = {"self_attn.q_proj": cfg.num_heads * cfg.head_dim, "self_attn.k_proj": cfg.num_kv_heads * cfg.head_dim,
            "self_attn.v_proj": cfg.num_kv_heads * cfg.head_dim, "mlp.gate_proj": cfg.intermediate_size,
            "mlp.up_proj": cfg.intermediate_size}
    return {f"model.layers.{i}.{whole}.weight": [(f"model.layers.{i}.{p}.weight", rows[p]) for p in pieces]
            for i in range(cfg.num_layers) for whole, pieces in cfg.family.fused.items()}


def read_norm(src: WeightSource, name: str, cfg: ModelConfig) -> torch.Tensor:
    """An RMS norm's weight as the block scales by it: a family that stores w - offset in Hugging Face
    folders (Gemma: 1) gets it added back; its GGUF files hold w already."""
    w = src.tensor(name).float()
    if cfg.family.norm_offset and getattr(src, "gguf", None) is None:
        w = w + cfg.family.norm_offset
    return w


class Layer:
    """One decoder layer's weights and its block's math, as its family (`cfg.family`) shapes it: norms, q/k
    norms, activation, norms after attention and MLP. The target's passes (`Transformer.layer_forward`) and
    the drafters' frozen target layers call `qkv_in`, `attn_out` and `ffn`; the compiled one-call `Stack`
    runs the same steps with the same kernels. Outside fp32 (kept unfused for training through the frozen
    layers) q|k|v and gate|up are fused into one kernel call each: one dispatch and one activation
    quantisation instead of three and two, which a decode step of small matrices feels."""

    def __init__(self, src: WeightSource, prefix: str, mode: WeightMode, cfg: ModelConfig):
        def lin(*names: str) -> Linear | Parts:
            return source_linear(src, [f"{prefix}.{n}.weight" for n in names], mode,
                                 "self_attn.qkv" if len(names) == 3 else names[0])

        fam = cfg.family
        self.cfg = cfg
        self.q = self.k = self.v = self.gate = self.up = self.qkv = self.gate_up = None
        kv = cfg.num_kv_heads * cfg.head_dim
        self.qkv_sizes = [cfg.num_heads * cfg.head_dim, kv, kv]
        if mode != "fp32":
            self.qkv = lin("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            self.gate_up = lin("mlp.gate_proj", "mlp.up_proj")
        else:
            self.q = lin("self_attn.q_proj")
            self.k = lin("self_attn.k_proj")
            self.v = lin("self_attn.v_proj")
            self.gate = lin("mlp.gate_proj")
            self.up = lin("mlp.up_proj")
        self.o = lin("self_attn.o_proj")
        self.down = lin("mlp.down_proj")
        self.ln1 = read_norm(src, f"{prefix}.input_layernorm.weight", cfg)
        self.ln2 = read_norm(src, f"{prefix}.{fam.mlp_norm}.weight", cfg)
        self.q_norm = self.k_norm = self.post_attn = self.post_ffn = None
        if fam.qk_norm:
            self.q_norm = read_norm(src, f"{prefix}.self_attn.q_norm.weight", cfg)
            self.k_norm = read_norm(src, f"{prefix}.self_attn.k_norm.weight", cfg)
        if fam.sandwich_norms:
            self.post_attn = read_norm(src, f"{prefix}.post_attention_layernorm.weight", cfg)
            self.post_ffn = read_norm(src, f"{prefix}.post_feedforward_layernorm.weight", cfg)
        self.gelu = fam.activation == GELU_TANH

    def linears(self) -> list[Linear]:
        """The layer's kernels as stored (fused or not)."""
        found = (self.q, self.k, self.v, self.qkv, self.o, self.gate, self.up, self.gate_up, self.down)
        return [part for lin in found if lin is not None for part in (lin.parts if isinstance(lin, Parts) else [lin])]

    def norms(self) -> list[torch.Tensor | None]:
        """[q_norm, k_norm, after attention, after the MLP] as the compiled `Stack` takes them (None: none)."""
        return [self.q_norm, self.k_norm, self.post_attn, self.post_ffn]

    def project_qkv(self, h: torch.Tensor, counts: list[int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of rows h [n, D] (`counts`: rows per sequence of a batched pass, see `Linear`)."""
        if self.qkv is not None:
            return self.qkv(h, counts).split(self.qkv_sizes, -1)
        return self.q(h, counts), self.k(h, counts), self.v(h, counts)

    def qkv_in(self, x: torch.Tensor, counts: list[int] | None = None, kernels=None) -> torch.Tensor:
        """[q | k | v] [R, (H + 2 Hkv) d] of rows x [R, D] before RoPE: the input norm, the projection and the
        family's q/k norms. `kernels`: the compiled steps (what the `Stack` runs, the same bits)."""
        cfg = self.cfg
        if kernels is not None and self.qkv is not None:
            qkv = self.qkv(kernels.rms_norm(x.contiguous(), self.ln1, cfg.rms_eps), counts).contiguous()
            if self.q_norm is not None:
                kernels.rms_heads_(qkv, self.q_norm, cfg.rms_eps, 0, cfg.num_heads)
                kernels.rms_heads_(qkv, self.k_norm, cfg.rms_eps, self.qkv_sizes[0], cfg.num_kv_heads)
            return qkv
        q, k, v = self.project_qkv(rms_norm_rows(x, self.ln1, cfg.rms_eps), counts)
        if self.q_norm is not None:
            R, d = q.shape[0], cfg.head_dim
            q = rms_norm(q.reshape(R, -1, d), self.q_norm, cfg.rms_eps).reshape(R, -1)
            k = rms_norm(k.reshape(R, -1, d), self.k_norm, cfg.rms_eps).reshape(R, -1)
        return torch.cat([q, k, v], -1)

    def attn_out(self, x: torch.Tensor, att: torch.Tensor, counts: list[int] | None = None, kernels=None
                 ) -> torch.Tensor:
        """x + (the family's norm of) o(att): the residual stream after attention."""
        o = self.o(att, counts)
        if self.post_attn is not None:
            o = kernels.rms_norm(o, self.post_attn, self.cfg.rms_eps) if kernels is not None else \
                rms_norm_rows(o, self.post_attn, self.cfg.rms_eps)
        return x + o

    def ffn(self, x: torch.Tensor, counts: list[int] | None = None, kernels=None) -> torch.Tensor:
        """x + (the family's norm of) mlp(norm(x)): the residual stream after the MLP."""
        eps = self.cfg.rms_eps
        if kernels is not None and self.gate_up is not None:
            y = self.mlp(kernels.rms_norm(x.contiguous(), self.ln2, eps), counts, kernels)
            return x + (kernels.rms_norm(y, self.post_ffn, eps) if self.post_ffn is not None else y)
        y = self.mlp(rms_norm_rows(x, self.ln2, eps), counts)
        return x + (rms_norm_rows(y, self.post_ffn, eps) if self.post_ffn is not None else y)

    def mlp(self, h: torch.Tensor, counts: list[int] | None = None, kernels=None) -> torch.Tensor:
        """down(act(gate(h)) * up(h)) of rows h [n, D], act silu or gelu (tanh) as the family has it;
        `kernels`: the compiled ones' act * up (what the one-call `Stack` runs)."""
        if self.gate_up is not None:
            gu = self.gate_up(h, counts)
            if kernels is not None:
                return self.down(kernels.gelu_mul(gu) if self.gelu else kernels.silu_mul(gu), counts)
            g, u = gu.chunk(2, -1)
        else:
            g, u = self.gate(h, counts), self.up(h, counts)
        act = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down((act * u).contiguous(), counts)


@dataclass
class ForwardOut:
    logits: torch.Tensor | None  # [n_rows_asked, vocab]
    hidden: dict[int, torch.Tensor]  # layer index -> input of that layer [n, D]; num_layers -> final normed
    pass_rows: int = 0  # the rows of the whole pass these came from, other sequences' included (0: these alone)


class KVCache:
    """One sequence's K/V for every layer of a model: the per-request state, apart from the weights, so
    that one set of weights serves many sessions (a server holds one cache per session).

    Slots [0, length) hold committed tokens; a forward pass writes tentative rows after them, which
    `commit` keeps (compacted to the accepted path) or the next pass overwrites. Memory is taken as the
    sequence grows, in blocks of `BLOCK` slots (doubling, up to `size`), so an idle or short session
    holds little; `release` gives it back."""

    BLOCK = 256

    def __init__(self, cfg: ModelConfig, size: int, device: torch.device | str = "cpu"):
        self.shape = (cfg.num_layers, cfg.num_kv_heads, 0, cfg.head_dim)
        self.device = torch.device(device)
        self.k = torch.zeros(self.shape, device=self.device)
        self.v = torch.zeros(self.shape, device=self.device)
        self.size = size
        self.length = 0
        self.epoch = 0  # bumped whenever committed slots may be rewritten (reset, truncate)
        # the token ids of the committed slots, where their writer keeps them (`LocalTarget`; else stale, and
        # `known` says so); `exact`: how many leading slots a cold prefill of the same tokens gives the same
        # bits (where passes are not row-invariant, only whole prefill chunks from slot 0)
        self.ids: list[int] = []
        self.exact = 0

    @property
    def known(self) -> int:
        """Leading committed slots whose token ids are known (`ids`)."""
        return len(self.ids) if len(self.ids) <= self.length else 0

    def copy_prefix(self, other: KVCache, n: int) -> None:
        """Make this cache hold `other`'s first n committed slots (a cached prefix, copied on start)."""
        if n > other.length or n > self.size:
            raise UserError(f"cannot copy {n} slots from a {other.length}-token cache into a {self.size}-slot one")
        self.reset()
        self.reserve(n)
        self.k[:, :, :n] = other.k[:, :, :n]
        self.v[:, :, :n] = other.v[:, :, :n]
        self.length = n
        self.ids = list(other.ids[:n])
        self.exact = min(other.exact, n)

    @property
    def capacity(self) -> int:
        """Slots allocated now."""
        return self.k.shape[2]

    def bytes_for(self, slots: int) -> int:
        """Memory of K and V for `slots` slots."""
        L, H, _, d = self.shape
        return 2 * L * H * slots * d * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.capacity)

    def check_room(self, n: int) -> None:
        """ContextLengthError unless n more rows fit after the committed slots."""
        if self.length + n > self.size:
            raise ContextLengthError(f"context full: {self.length} + {n} tokens exceed the {self.size}-token cache")

    def reserve(self, n: int) -> None:
        """Make n more slots after the committed ones writable (`check_room`): grow to the next block, at
        least doubling (amortised copies)."""
        self.check_room(n)
        end = self.length + n
        if end <= self.capacity:
            return
        grown = min(self.size, max(-(-end // self.BLOCK) * self.BLOCK, 2 * self.capacity))
        L, H, old, d = self.k.shape
        with torch.inference_mode(False):  # called inside passes; the cache must stay writable outside them
            for name in ("k", "v"):
                new = torch.zeros((L, H, grown, d), device=self.device)
                new[:, :, :old] = getattr(self, name)
                setattr(self, name, new)

    def release(self) -> None:
        """Empty the cache and give its memory back."""
        self.reset()
        self.k = torch.zeros(self.shape, device=self.device)
        self.v = torch.zeros(self.shape, device=self.device)

    def advance(self, n: int) -> None:
        """Keep the last forward's n rows as committed (a plain, in-order pass)."""
        self.length += n

    def commit(self, rows: list[int] | torch.Tensor) -> None:
        """Keep rows (indices into the last forward's new tokens, in path order) and drop the rest."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.k.device)
        n = rows.shape[0]
        if n and not torch.equal(rows, torch.arange(n, device=self.k.device)):
            src = self.length + rows
            self.k[:, :, self.length:self.length + n] = self.k[:, :, src]
            self.v[:, :, self.length:self.length + n] = self.v[:, :, src]
        self.length += n

    def truncate(self, length: int) -> None:
        """Roll the committed prefix back to `length` tokens."""
        if not 0 <= length <= self.length:
            raise UserError(f"cannot truncate a {self.length}-token cache to {length}")
        if length < self.length:
            self.epoch += 1
        self.length = length
        del self.ids[length:]
        self.exact = min(self.exact, length)

    def reset(self) -> None:
        self.length = 0
        self.epoch += 1
        self.ids = []
        self.exact = 0

    def kv(self, positions: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """K (after RoPE) and V of every layer for cache slots: each [L, Hkv, n, d]."""
        return self.k[:, :, positions], self.v[:, :, positions]


@dataclass
class Rows:
    """One sequence's new rows in a forward pass (`Transformer.forward_batch`); the fields are `forward`'s."""

    tokens: torch.Tensor | None
    cache: KVCache
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    logits_rows: slice | torch.Tensor | None = None
    hidden_layers: tuple[int, ...] = ()
    embeds: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return self.tokens.shape[0] if self.embeds is None else self.embeds.shape[0]


class Transformer:
    """A decoder of any supported family over a batch-1 `KVCache`.

    `forward` writes new K/V at slots [length, length + n) of a cache and attends to [0, length + n)
    under an optional mask; nothing is committed until the cache's `commit`/`advance`, so a tree pass
    can be thrown away or compacted to its accepted path. Every call takes a `cache`; without one it
    uses the model's own (`self.cache`), the single-session case.
    """

    def __init__(
        self,
        folder: str | Path,
        weights: WeightMode = "fp32",
        device: str | torch.device = "cpu",
        max_seq_len: int = 4096,
    ):
        self.folder = Path(folder)
        self.cfg = cfg = ModelConfig.from_folder(self.folder)
        self.device = torch.device(device)
        weights = resolve_weights(weights, self.folder, self.device)
        self.weights = weights = runnable_mode(weights, self.device)  # fp16 where int8/int4 cannot run
        self.source = src = open_weights(self.folder, cfg.num_heads, cfg.num_kv_heads, self.device, fused_pieces(cfg))
        embed = "model.embed_tokens.weight"
        # in the file's formats the embedding stays in its blocks, rows de-quantised as they are looked up
        self._embedding = RowTable(src, embed) if weights == GGUF and src.blocks(embed) is not None \
            else src.tensor(embed).float()
        self._embed_full: torch.Tensor | None = None
        self.layers = [Layer(src, f"model.layers.{i}", weights, cfg) for i in range(cfg.num_layers)]
        self.norm = read_norm(src, "model.norm.weight", cfg)
        self._head_name = embed if cfg.tie_embeddings or not src.has("lm_head.weight") else "lm_head.weight"
        self.lm_head = source_linear(src, [self._head_name], weights, "lm_head")
        self._head_full: torch.Tensor | None = None
        self.max_seq_len = min(max_seq_len, cfg.max_position)
        self.cos, self.sin = cfg.rope_tables(self.max_seq_len, self.device)
        self.sin_signed = signed_sin(self.sin)  # the decoding path's table (`rope_rows`)
        # the sliding-window layers' own tables where the family gives them another base (Gemma 3)
        self.cos_local, self.sin_signed_local = self.cos, self.sin_signed
        if cfg.local_rope_theta is not None:
            self.cos_local, sin_local = cfg.rope_tables(self.max_seq_len, self.device, local=True)
            self.sin_signed_local = signed_sin(sin_local)
        self.local = [cfg.local_rope_theta is not None and cfg.window(i) > 0 for i in range(cfg.num_layers)]
        self.cache = self.new_cache()
        self.scale = cfg.attn_scale
        self._batch_invariant: bool | None = None
        # Last-bit differences between a 1-row step and a k-row verification can turn into different
        # tokens (quantised activations often do); on the CPU the few-row layers and the attention of
        # `qgemm.cpp` compute each row alone, so both score a token alike (fbgemm's fp16 layers are used
        # only where they measure faster and their rows prove independent). fp16 without a compiler keeps
        # fbgemm and SDPA.
        self.kernels = quant.kernels_or_none() if self.device.type == "cpu" and weights != "fp32" else None
        self.stack = None
        self.few_row_kernels()
        self.stack = self.native_stack()

    def native_stack(self):
        """The compiled `Stack` that runs every decoder layer of a one-sequence pass in one call, where every
        layer is quantised and the row-invariant attention runs (else None: layer by layer in Python). It
        calls the same compiled steps as `layer_forward` in the same order: the same bits, without the
        Python between layers (~4 ms of a 14 ms Qwen 0.5B int4 decode step)."""
        if self.kernels is None or self.weights not in QUANTISED or not self.row_invariant:
            return None
        layers = []
        for i, layer in enumerate(self.layers):
            slots = [_stack_parts(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(slot is None for slot in slots):
                return None
            norms = [None if w is None else w.contiguous() for w in layer.norms()]
            layers.append((layer.ln1.contiguous(), layer.ln2.contiguous(), slots, norms, int(self.local[i]),
                           int(self.cfg.window(i) > 0)))
        cfg = self.cfg
        return self.kernels.Stack(layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps, self.scale,
                                  int(cfg.family.activation == GELU_TANH))

    def few_row_kernels(self, layers: bool | None = None, attention: bool = True) -> None:
        """Choose the kernels of passes of 1-8 rows (where the compiled ones built): fp16 layers through
        the few-row kernel (True), fbgemm (False) or whichever this machine measured faster for this
        model (None: `few_row_choice`); the row-invariant attention (True) or SDPA. `experiments.passes`
        compares them."""
        self.row_invariant = attention and self.kernels is not None and self.cfg.head_dim % 8 == 0 \
            and self.cfg.head_dim <= 256
        if self.weights != "fp16" or self.kernels is None:
            return
        chosen = layers is None
        if chosen:
            layers = self.few_row_choice()
        for lin in self.linears():
            lin.set_few_rows(layers, keep_copy=not chosen)

    def linears(self) -> list[Linear]:
        """Every weight kernel of the model: the LM head and each layer's (fused or not)."""
        return [self.lm_head, *(lin for layer in self.layers for lin in layer.linears())]

    def few_row_choice(self) -> bool:
        """Whether this model's fp16 layers run 1-8 rows faster through the few-row kernel than through
        fbgemm's, measured once per model and machine (`quant.machine_key`; ~1-2 s of interleaved 1-4 row
        passes) and cached in kernel_choice.json. On a 2-core Zen 2 VM the few-row kernel won (it
        converts each weight once for all rows); on a Zen 4 VM with AVX-512 fbgemm streams Qwen 0.5B's
        2-4 row passes faster, the few-row kernel SmolLM2's. fbgemm is taken only where its rows prove
        independent (each row of an 8-row product bit-identical to that row alone, for every layer shape), so a
        k-row verification scores a token exactly as a decode step does. `MOASPEC_F16_KERNEL` overrides."""
        forced = quant.f16_override()
        if forced is not None:
            return forced
        from moaspec.models.store import read_measurements, save_measurements

        key = f"{quant.machine_key()}|{self.folder.name}|{self.cfg.num_layers}x{self.cfg.hidden_size}"
        known = read_measurements("kernel_choice.json")
        entry = known.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("few_rows"), bool):
            return entry["few_rows"]
        known[key] = entry = self._time_few_rows()
        save_measurements("kernel_choice.json", known)
        return entry["few_rows"]

    def _time_few_rows(self, ks: tuple[int, ...] = (1, 2, 3, 4), reps: int = 4) -> dict:
        """Best ms of 1-4 row passes after up to 128 cached tokens (what the context allows) with each kind
        of fp16 layer (interleaved, on a scratch cache), and whether fbgemm's rows are independent for every
        layer shape."""
        lins = self.linears()
        for lin in lins:
            lin.set_few_rows(False)
        gen = torch.Generator().manual_seed(0)
        independent = all(lin.fbgemm_splits_agree(torch.randn(8, lin.in_features, generator=gen), tuple(range(1, 8)))
                          for lin in {(lin.out_features, lin.in_features): lin for lin in lins}.values())
        entry: dict = {"fbgemm_rows_independent": independent}
        if not independent:
            entry["few_rows"] = True
            return entry
        ks = tuple(k for k in ks if k <= self.max_seq_len) or (1,)
        context = min(128, self.max_seq_len - max(ks))
        cache = self.new_cache(context + max(ks))
        if context:
            self.forward(torch.zeros(context, dtype=torch.long, device=self.device), cache=cache)
            cache.advance(context)
        best: dict[bool, dict[int, float]] = {True: {}, False: {}}
        for rep in range(reps + 1):
            for k in ks:
                for few in (True, False):
                    for lin in lins:
                        lin.set_few_rows(few)
                    t = time.perf_counter()
                    self.forward(torch.full((k,), 100, dtype=torch.long, device=self.device), cache=cache)
                    ms = (time.perf_counter() - t) * 1e3
                    if rep:  # round 0 warms up
                        best[few][k] = min(best[few].get(k, ms), ms)
        entry["few_row_ms"] = {k: round(v, 2) for k, v in best[True].items()}
        entry["fbgemm_ms"] = {k: round(v, 2) for k, v in best[False].items()}
        entry["few_rows"] = sum(best[True].values()) <= sum(best[False].values())
        return entry

    @property
    def embed(self) -> torch.Tensor:
        """The embedding table [V, D] in float32 (what drafters share). A table kept in the file's blocks is
        de-quantised the first time it is asked for, so plain decoding never holds the float copy."""
        if isinstance(self._embedding, torch.Tensor):
            return self._embedding
        if self._embed_full is None:
            self._embed_full = self._embedding.full()
        return self._embed_full

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head [V, D] in float32 (the embedding when tied), read on first use, for drafters that share
        the frozen head."""
        if self._head_name == "model.embed_tokens.weight":
            return self.embed
        if self._head_full is None:
            self._head_full = self.source.tensor(self._head_name).float()
            self.source.release(self._head_name)
        return self._head_full

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings [n, D] of token ids [n]."""
        if isinstance(self._embedding, torch.Tensor):
            return self._embedding[tokens]
        if self._embed_full is not None:
            return self._embed_full[tokens]
        return self._embedding.rows(tokens).to(self.device)

    def new_cache(self, size: int | None = None) -> KVCache:
        """A cache of `size` slots (default: the model's context) for one more session."""
        size = self.max_seq_len if size is None else size
        if not 1 <= size <= self.max_seq_len:
            raise UserError(f"a cache holds 1..{self.max_seq_len} tokens for this model, not {size}")
        return KVCache(self.cfg, size, self.device)

    @property
    def length(self) -> int:
        """Tokens committed in the model's own cache."""
        return self.cache.length

    def tail_layers(self, n: int) -> list[Layer]:
        """The last n layers (what a drafter's Target Layer Inference runs)."""
        if not 0 <= n <= self.cfg.num_layers:
            raise UserError(f"the target has {self.cfg.num_layers} layers; cannot take the last {n}")
        return self.layers[self.cfg.num_layers - n:]

    # ---------------------------------------------------------------- core
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        logits_rows: slice | torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        embeds: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> ForwardOut:
        """Run n new tokens after the committed prefix.

        tokens: [n] ids; positions: [n] absolute RoPE positions (default length..length+n-1);
        tree_mask: [n, m] bool (m >= n) over the last m cache slots, i.e. tentative slots written by
        earlier passes and then these n rows; True where row i may attend (default causal [n, n]);
        logits_rows: which rows get LM-head logits (default all); hidden_layers: layer indices whose
        *input* hidden states to return (num_layers means the final normed state).
        """
        cache = self.cache if cache is None else cache
        return self.forward_batch([Rows(tokens, cache, positions, tree_mask, logits_rows, hidden_layers, embeds)])[0]

    def batch_invariant(self) -> bool:
        """Whether a pass over several sequences gives each the bits of a pass over it alone, so that
        `forward_batch` may stack them. The quantised kernels and the few-row fp16 kernel compute a row
        the same whatever rows share the call; fbgemm's fp16 kernel is checked once per model (its rows
        are then stacked too, else its calls stay per sequence); fp32 (MKL pads and blocks rows) and
        accelerators are not batched: their sequences run one after another."""
        if self._batch_invariant is None:
            ok = self.device.type == "cpu" and self.weights != "fp32"
            packed = [lin for lin in self.linears() if lin.packed is not None]  # fp16 (also a layer int4 cannot take)
            if ok and packed:
                gen = torch.Generator().manual_seed(0)
                shapes = {(lin.out_features, lin.in_features): lin for lin in packed}
                agree = {shape: lin.fbgemm_splits_agree(torch.randn(40, lin.in_features, generator=gen), (1, 9))
                         for shape, lin in shapes.items()}
                for lin in packed:
                    lin.fbgemm_rows_independent = agree[(lin.out_features, lin.in_features)]
            self._batch_invariant = ok
        return self._batch_invariant

    @torch.inference_mode()
    def forward_batch(self, seqs: list[Rows]) -> list[ForwardOut]:
        """One pass over the new rows of several sequences, each on its own cache with its own positions
        and tree mask: the linear layers see all rows stacked ([R, D]), attention runs per sequence over
        its own cache. A sequence's outputs are bit-identical to `forward` on it alone (`batch_invariant`;
        where that cannot hold the sequences run one after another)."""
        if len(seqs) > 1 and not self.batch_invariant():
            return [self.forward_batch([s])[0] for s in seqs]
        counts = [s.n for s in seqs]
        window = max(self.cfg.windows, default=0)
        masks, local_masks, positions = [], [], []
        for s, n in zip(seqs, counts, strict=True):
            start = s.cache.length
            s.cache.reserve(n)
            pos = torch.arange(start, start + n, device=self.device) if s.positions is None else s.positions
            positions.append(pos)
            mask = None
            if n > 1 or s.tree_mask is not None:
                new = s.tree_mask if s.tree_mask is not None else \
                    torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
                seen = torch.ones(n, start + n - new.shape[1], dtype=torch.bool, device=self.device)
                mask = torch.cat([seen, new.to(self.device)], 1)
            masks.append(mask)
            tree = 0 if s.tree_mask is None else s.tree_mask.shape[1]
            local_masks.append(self._window_mask(mask, pos, start + n, window, tree) if window else mask)
        one = len(seqs) == 1
        pos_all = positions[0] if one else torch.cat(positions)
        tables = [(self.cos[pos_all], self.sin_signed[pos_all])]
        if self.cfg.local_rope_theta is not None:
            tables.append((self.cos_local[pos_all], self.sin_signed_local[pos_all]))
        embeds = [self.embed_rows(s.tokens) * self.cfg.embed_scale if s.embeds is None else s.embeds for s in seqs]
        x = embeds[0] if one else torch.cat(embeds)
        wanted = {i for s in seqs for i in s.hidden_layers}
        hidden: dict[int, torch.Tensor] = {}
        if one and self.stack is not None:
            inner = sorted(i for i in wanted if i < self.cfg.num_layers)
            cache = seqs[0].cache
            x, *states = self.stack.forward(x.float().contiguous(), cache.k, cache.v, cache.length,
                                            [c for c, _ in tables], [s for _, s in tables], [masks[0], local_masks[0]],
                                            inner)
            hidden.update(zip(inner, states, strict=True))
        else:
            for i, layer in enumerate(self.layers):
                if i in wanted:
                    hidden[i] = x
                cos, sin = tables[int(self.local[i])]
                x = self.layer_forward(i, layer, x, cos, sin, seqs, counts,
                                       local_masks if self.cfg.window(i) else masks)
        x = rms_norm_rows(x, self.norm, self.cfg.rms_eps)
        if self.cfg.num_layers in wanted:
            hidden[self.cfg.num_layers] = x
        outs, rows, heads, start = [], [], [], 0
        for s, n in zip(seqs, counts, strict=True):
            mine = x[start:start + n]
            r = mine if s.logits_rows is None else mine[s.logits_rows]
            rows.append(r)
            heads.append(r.shape[0])
            outs.append(ForwardOut(None, {k: h[start:start + n] for k, h in hidden.items() if k in s.hidden_layers}))
            start += n
        if sum(heads):
            logits = self.lm_head((rows[0] if one else torch.cat(rows)).contiguous(), heads)
            for out, piece in zip(outs, logits.split(heads), strict=True):
                out.logits = piece if piece.shape[0] else None
        return outs

    def _window_mask(self, mask: torch.Tensor | None, positions: torch.Tensor, slots: int, window: int,
                     tree: int) -> torch.Tensor | None:
        """`mask` [n, slots] (None: causal) narrowed to a sliding window: row i sees slot j only when
        positions[i] - j < window, a committed slot (and a causal pass's own) sitting at its position. The
        last `tree` slots of a tree pass are a draft's ancestors, inside the window (a tree is far smaller)."""
        n = positions.shape[0]
        if int(positions.max()) < window:
            return mask
        if tree >= window:
            raise UserError(f"a draft tree of {tree} rows does not fit this model's sliding window of {window}")
        if mask is None:
            mask = torch.ones(n, slots, dtype=torch.bool, device=self.device).tril(slots - n)
        slot = torch.arange(slots, device=self.device)
        inside = (positions[:, None] - slot[None, :]) < window
        if tree:
            inside[:, slots - tree:] = True
        return mask & inside

    def layer_forward(
        self,
        i: int,
        layer: Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        seqs: list[Rows],
        counts: list[int],
        masks: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """Layer i over the stacked rows x [R, D] of `seqs` (`counts` rows each, `masks` theirs)."""
        cfg = self.cfg
        R = x.shape[0]
        kern = self.kernels if layer.qkv is not None else None
        qkv = layer.qkv_in(x, counts, kern)
        if kern is not None:  # the compiled steps, as the one-call `Stack` runs them
            kern.rope_(qkv, cos, sin_signed, (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim)
            q, k, v = qkv.split(layer.qkv_sizes, -1)
            q = q.reshape(R, cfg.num_heads, cfg.head_dim)
            k = k.reshape(R, cfg.num_kv_heads, cfg.head_dim)
        else:
            q, k, v = qkv.split(layer.qkv_sizes, -1)
            # RoPE on all rows at once ([R, heads, d] against [R, 1, d] tables): elementwise, so per row the
            # same bits as on one sequence's rows
            q = rope_rows(q.reshape(R, cfg.num_heads, cfg.head_dim), cos[:, None], sin_signed[:, None])
            k = rope_rows(k.reshape(R, cfg.num_kv_heads, cfg.head_dim), cos[:, None], sin_signed[:, None])
        v = v.reshape(R, cfg.num_kv_heads, cfg.head_dim)
        atts, a = [], 0
        for s, n, mask in zip(seqs, counts, masks, strict=True):
            cache, b = s.cache, a + n
            start = cache.length
            end = start + n
            cache.k[i, :, start:end] = k[a:b].transpose(0, 1)
            cache.v[i, :, start:end] = v[a:b].transpose(0, 1)
            qs = q[a:b].transpose(0, 1)
            # SDPA is faster at prefill; fp16 layers beyond FEW_ROWS are fbgemm's and not row-invariant anyway,
            # while the quantised layers are at every row count
            if self.row_invariant and (n <= FEW_ROWS or self.weights in QUANTISED):
                att = self.kernels.attention(qs, cache.k[i], cache.v[i], end, mask, self.scale)
            else:
                att = F.scaled_dot_product_attention(
                    qs[None], cache.k[i, None, :, :end], cache.v[i, None, :, :end],
                    attn_mask=mask, scale=self.scale, enable_gqa=True,
                )[0]
            atts.append(att.transpose(0, 1).reshape(n, -1))
            a = b
        att = atts[0] if len(atts) == 1 else torch.cat(atts)
        return layer.ffn(layer.attn_out(x, att, counts, kern), counts, kern)

    # ---------------------------------------------------------------- the model's own cache
    def advance(self, n: int) -> None:
        self.cache.advance(n)

    def commit(self, rows: list[int] | torch.Tensor) -> None:
        self.cache.commit(rows)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def reset(self) -> None:
        self.cache.reset()

    def kv(self, positions: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.kv(positions)

    # ---------------------------------------------------------------- helpers
    def prefill(self, tokens: list[int] | torch.Tensor, hidden_layers: tuple[int, ...] = (),
                chunk: int = PREFILL_CHUNK, cache: KVCache | None = None,
                run: Callable[[Rows], ForwardOut] | None = None) -> ForwardOut:
        """Append a prompt in chunks of `chunk` rows (bounding attention memory, and in a batched server the
        time one prompt holds a pass) and return the last row's logits; `run`: how a pass is run (default
        alone; a `Scheduler` batches it with other sequences')."""
        cache = self.cache if cache is None else cache
        run = run or (lambda rows: self.forward_batch([rows])[0])
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        outs: list[ForwardOut] = []
        for s in range(0, tokens.shape[0], chunk):
            piece = tokens[s:s + chunk]
            last = s + chunk >= tokens.shape[0]
            out = run(Rows(piece, cache, logits_rows=slice(-1, None) if last else slice(0, 0),
                           hidden_layers=hidden_layers))
            cache.advance(piece.shape[0])
            outs.append(out)
        hidden = {k: torch.cat([o.hidden[k] for o in outs]) for k in outs[-1].hidden}
        return ForwardOut(outs[-1].logits, hidden)

    def warmup(self) -> None:
        """Run each row count once so that one-time kernel set-up (MKL, oneDNN) is not billed to the
        first generation. Nothing is committed."""
        for n in (32, 16, 8, 4, 2, 1):
            if self.length + n <= self.max_seq_len:
                self.forward(torch.zeros(n, dtype=torch.long, device=self.device))

    def pass_costs(self, ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32), context: int = 32,
                   reps: int = 2, statistic: Callable[[list[float]], float] = min) -> dict[int, float]:
        """Milliseconds of one pass over k new rows after `context` cached tokens: what
        verifying a k-row draft tree costs on this machine. Leaves the cache empty. The defaults are a model's
        first-run calibration (`SpecDecoder.pass_costs`): up to 32 rows, the most a CPU tree verifies, best of
        2 after one untimed widest pass, over a short context (on a Qwen 1.5B first run: ~6 s with 64 rows, best of 5,
        at 128 tokens; ~3 s with 32 rows, best of 3; ~1.6 s now). `statistic` of the `reps` timings: the least disturbed
(min) for calibration; a benchmark beside a peer takes the peer's (the median)."""
        self.reset()
        ks = tuple(k for k in ks if context + k <= self.max_seq_len)
        self.forward(torch.zeros(context, dtype=torch.long, device=self.device))
        self.advance(context)
        times: dict[int, list[float]] = {k: [] for k in ks}
        if ks:  # the widest pass first, untimed: it touches every weight page and sizes the buffers
            self.forward(torch.full((max(ks),), 100, dtype=torch.long, device=self.device))
        for _ in range(reps):  # rounds over every k, so a burst of other load hits all k alike
            for k in ks:
                toks = torch.full((k,), 100, dtype=torch.long, device=self.device)
                t = time.perf_counter()
                self.forward(toks)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                times[k].append(time.perf_counter() - t)
        self.reset()
        return {k: statistic(v) * 1e3 for k, v in times.items()}

    def num_parameters(self) -> int:
        return self.cfg.vocab_size * self.cfg.hidden_size + self.norm.numel() + sum(
            lin.in_features * lin.out_features for layer in self.layers for lin in layer.linears())
