"""Tiny random models of every family, built by transformers from the family's own config and written as a
GGUF the way llama.cpp's converter writes them (its tensor names and keys, llama's q/k row interleave,
Gemma's norms stored as 1 + w, Llama 3's scaling as rope_freqs, Phi-3's LongRoPE factors as tensors), with
SmolLM2's real vocabulary. The oracle for `test_families.py`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from moaspec.models import families, rope
from moaspec.models.gguf_file import GGUFFile

VOCAB = 49152  # SmolLM2's, whose tokenizer the files carry
DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_config(kind: str):
    """The transformers config of a tiny model of `kind` (a family, or a family with a RoPE scaling)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    if kind == "llama":
        return LlamaConfig(**DIMS, num_hidden_layers=2, max_position_embeddings=512, rope_theta=10000.0)
    if kind == "llama3-scaled":  # positions past the original 32 are scaled
        return LlamaConfig(**DIMS, num_hidden_layers=2, max_position_embeddings=512, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "qwen2":
        return Qwen2Config(**DIMS, num_hidden_layers=2, max_position_embeddings=512, rope_theta=1e6)
    if kind == "qwen2-yarn":
        return Qwen2Config(**DIMS, num_hidden_layers=2, max_position_embeddings=512, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "qwen3":
        return Qwen3Config(**DIMS, num_hidden_layers=2, max_position_embeddings=512)
    if kind == "mistral":
        return MistralConfig(**DIMS, num_hidden_layers=2, max_position_embeddings=512, sliding_window=None)
    if kind == "mistral-window":
        return MistralConfig(**DIMS, num_hidden_layers=2, max_position_embeddings=512, sliding_window=24)
    if kind == "gemma3":
        return Gemma3TextConfig(**{**DIMS, "tie_word_embeddings": True}, num_hidden_layers=6,
                                max_position_embeddings=512, sliding_window=24, query_pre_attn_scalar=16,
                                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                             for i in range(6)])
    if kind == "phi3":
        return Phi3Config(**DIMS, num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0)
    if kind == "phi3-longrope":
        half = DIMS["head_dim"] // 2
        return Phi3Config(**DIMS, num_hidden_layers=2, max_position_embeddings=128, pad_token_id=0,
                          original_max_position_embeddings=32, rope_parameters={
                              "rope_type": "longrope", "rope_theta": 10000.0,
                              "long_factor": [1.0 + 0.5 * i for i in range(half)],
                              "short_factor": [1.0 + 0.1 * i for i in range(half)],
                              "original_max_position_embeddings": 32})
    raise ValueError(kind)


def build(kind: str, seed: int = 0):
    """A transformers model of `kind` with random weights (norms random too, so their handling shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if model.config.model_type == "gemma3_text" else 1.0))
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) * 0.08)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for llama files (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, smol_gguf: Path) -> Path:
    """`model` as a GGUF of its family (F32 tensors), with SmolLM2's tokenizer."""
    from gguf import GGUFWriter

    c = model.config
    fam = families.family(c.model_type)
    if fam.gguf_arch is None:  # Mistral files are written as llama's, without the window
        fam = families.family("llama")
    arch = fam.gguf_arch
    to_gguf = {hf: g for g, hf in fam.tensors.items()}
    w = GGUFWriter(str(path), arch)
    w.add_file_type(0)  # ALL_F32
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    params = c.rope_parameters
    params = params.get("full_attention", params)
    w.add_rope_freq_base(params["rope_theta"])
    kind = params.get("rope_type", "default")
    if kind == "yarn":
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    if kind == "longrope":
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        factor = c.max_position_embeddings / params["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(factor) / np.log(32))))
        w.add_tensor("rope_factors_long.weight", np.array(params["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(params["short_factor"], dtype=np.float32))
    if kind == "llama3":  # as llama.cpp's converter: the divisors per frequency
        plain, _ = rope.inv_freq(params["rope_theta"], c.head_dim)
        scaled, _ = rope.inv_freq(params["rope_theta"], c.head_dim, params)
        w.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    if getattr(c, "sliding_window", None) and fam.gguf_arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    smol = GGUFFile(smol_gguf)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(smol.meta["tokenizer.ggml.pre"]))
    w.add_token_list(list(smol.meta["tokenizer.ggml.tokens"]))
    w.add_token_merges(list(smol.meta["tokenizer.ggml.merges"]))
    w.add_token_types(list(np.asarray(smol.meta["tokenizer.ggml.token_type"]).tolist()))
    w.add_bos_token_id(int(smol.meta["tokenizer.ggml.bos_token_id"]))
    w.add_add_bos_token(False)
    w.add_eos_token_id(int(smol.meta["tokenizer.ggml.eos_token_id"]))
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            g = "output.weight"
        else:
            parts = name.split(".")  # model.layers.i.<module path>.weight
            g = f"blk.{parts[2]}.{to_gguf['.'.join(parts[3:-1])]}.{parts[-1]}"
            if fam.permuted_qk and parts[-2] in ("q_proj", "k_proj"):
                a = _permute(a, c.num_attention_heads if parts[-2] == "q_proj" else c.num_key_value_heads)
        if "norm" in name and fam.norm_offset:
            a = a + fam.norm_offset
        w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_folder(model, folder: Path) -> Path:
    """`model` as a Hugging Face folder (config.json + model.safetensors)."""
    model.save_pretrained(folder, safe_serialization=True)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
