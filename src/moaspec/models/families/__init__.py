"""One architecture spec per model family: what differs between Llama, Qwen, Mistral, Gemma and Phi in how a
decoder block computes, and how the family's GGUF files name its tensors and settings.

The runtime (`runtime.Layer`, `Transformer.layer_forward`), the compiled one-call `Stack` and the drafters'
frozen target layers read the spec through `ModelConfig`; a GGUF is described as a Hugging Face config by
`gguf_config`, so both sources give one `ModelConfig`. A new family is one module here, listed in `FAMILIES`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from moaspec.errors import UserError

SILU, GELU_TANH = "silu", "gelu_tanh"

# GGUF tensor pieces of a block -> Hugging Face module paths, as llama, qwen2 and mistral name them
LLAMA_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class GGUFMeta(Protocol):
    """What a family reads of a GGUF file (`gguf_file.GGUFFile`) to describe its model."""

    tensors: Mapping[str, Any]

    def key(self, name: str, default: Any = None) -> Any: ...

    def dequantize(self, name: str) -> Any: ...


@dataclass(frozen=True)
class Family:
    """How one model family's decoder block computes and how its files name things."""

    name: str  # config.json's model_type
    hf_class: str  # its transformers class (config.json's architectures)
    gguf_arch: str | None  # general.architecture of its GGUF files; None: they are written as another family's
    tensors: Mapping[str, str]  # GGUF block tensor piece -> Hugging Face module path
    aliases: tuple[str, ...] = ()  # other model_type spellings of the same block
    mlp_norm: str = "post_attention_layernorm"  # the norm before the MLP (Gemma: pre_feedforward_layernorm)
    qk_norm: bool = False  # an RMS norm over each q and k head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
    activation: str = SILU  # of the gate: silu or gelu_tanh
    embed_scale: bool = False  # embeddings times sqrt(hidden) (Gemma)
    norm_offset: float = 0.0  # Hugging Face weights store w - offset, the block scales by w (Gemma: 1)
    permuted_qk: bool = False  # llama.cpp interleaved each q/k head's rotary halves in the GGUF (llama)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # a stacked tensor -> the ones it stacks
    chat_template: str | None = None  # for a file that carries none
    stop_tokens: tuple[str, ...] = ()  # token texts that end a turn besides the file's eos
    gguf_config: Callable[[GGUFMeta], dict] | None = None  # family-only config keys from a GGUF's metadata
    tied_by_default: bool = False  # a config.json without tie_word_embeddings ties them (Gemma)

    def layer_windows(self, c: Mapping) -> tuple[int, ...]:
        """Each layer's sliding window (0: full attention) from a Hugging Face config."""
        n = int(c["num_hidden_layers"])
        window = c.get("sliding_window")
        if not window or c.get("use_sliding_window") is False:
            return (0,) * n
        types = c.get("layer_types")
        if types:
            if len(types) != n:
                raise UserError(f"config.json lists {len(types)} layer_types for {n} layers")
            return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
        pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern")
        if pattern:  # every pattern-th layer attends to all
            return tuple(0 if (i + 1) % int(pattern) == 0 else int(window) for i in range(n))
        return (int(window),) * n


@functools.cache
def _registry() -> dict[str, Family]:
    from moaspec.models.families import gemma3, llama, mistral, phi3, qwen2, qwen3

    out: dict[str, Family] = {}
    for module in (llama, qwen2, qwen3, mistral, gemma3, phi3):
        fam: Family = module.FAMILY
        for key in (fam.name, *fam.aliases):
            out[key] = fam
    return out


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3")


def family(model_type: str | None) -> Family:
    """The family of a config.json's model_type, or a UserError naming what runs."""
    fam = _registry().get(str(model_type))
    if fam is None:
        raise UserError(f"unsupported architecture {model_type!r}: this runtime runs {', '.join(FAMILIES)} "
                        "(Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, Gemma 3 text, Phi-3/3.5)")
    return fam


def gguf_family(arch: str) -> Family | None:
    """The family whose GGUF files say `general.architecture` = arch (None: none runs here)."""
    return next((f for f in _registry().values() if f.gguf_arch == arch), None)


def gguf_archs() -> list[str]:
    return sorted({f.gguf_arch for f in _registry().values() if f.gguf_arch})
