"""Phi-3 and Phi-3.5 (mini): q|k|v in one tensor and gate|up in one, LongRoPE past the original context
(Phi-3.5, the 128k variants), a sliding window where the file names one."""

from __future__ import annotations

from moaspec.models.families import Family, GGUFMeta

TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_qkv": "self_attn.qkv_proj",
           "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}


def gguf_config(gguf: GGUFMeta) -> dict:
    out: dict = {}
    window = gguf.key("attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    if "rope_factors_long.weight" in gguf.tensors:
        orig = int(gguf.key("rope.scaling.original_context_length") or gguf.key("context_length"))
        out["rope_scaling"] = {
            "rope_type": "longrope", "original_max_position_embeddings": orig,
            "long_factor": gguf.dequantize("rope_factors_long.weight").reshape(-1).tolist(),
            "short_factor": gguf.dequantize("rope_factors_short.weight").reshape(-1).tolist(),
            "factor": int(gguf.key("context_length")) / orig,
        }
        attn = gguf.key("rope.scaling.attn_factor")
        if attn:
            out["rope_scaling"]["attention_factor"] = float(attn)
    return out


FAMILY = Family(name="phi3", hf_class="Phi3ForCausalLM", gguf_arch="phi3", tensors=TENSORS,
                fused={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
                stop_tokens=("<|end|>", "<|endoftext|>"), gguf_config=gguf_config)
