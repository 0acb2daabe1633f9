"""Gemma 3 (text): q and k norms, norms after attention and after the MLP too, gelu (tanh), embeddings
scaled by sqrt(hidden), five sliding-window layers (local RoPE base 10,000) to one global layer, 1/sqrt of
`query_pre_attn_scalar` as the attention scale. Its GGUF files hold the norms as the block scales by them
(transformers stores w - 1)."""

from __future__ import annotations

from moaspec.models.families import GELU_TANH, QK_NORM_TENSORS, Family, GGUFMeta

TENSORS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
           "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
           "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj", **QK_NORM_TENSORS}

# Gemma's turn format (its instruction-tuned files carry it; a base file gets it for `chat`)
TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}{%- for message in loop_messages -%}{%- set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] -%}{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def gguf_config(gguf: GGUFMeta) -> dict:
    heads = int(gguf.key("attention.head_count"))
    hidden = int(gguf.key("embedding_length"))
    head_dim = int(gguf.key("attention.key_length", hidden // heads))
    layers = int(gguf.key("block_count"))
    # llama.cpp's own reading of a Gemma 3 file: every 6th layer global, local RoPE base 10,000, and the
    # 27B's attention scale from hidden / heads
    scalar = hidden // heads if (layers, hidden) == (62, 5376) else head_dim
    window = int(gguf.key("attention.sliding_window", 4096))
    out = {"sliding_window": window, "query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh",
           "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
           "rope_local_base_freq": 10000.0}
    factor = gguf.key("rope.scaling.factor")
    if gguf.key("rope.scaling.type") == "linear" and factor:
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return out


FAMILY = Family(name="gemma3_text", hf_class="Gemma3ForCausalLM", gguf_arch="gemma3", tensors=TENSORS,
                mlp_norm="pre_feedforward_layernorm", qk_norm=True, sandwich_norms=True,
                activation=GELU_TANH, embed_scale=True, norm_offset=1.0, chat_template=TEMPLATE,
                stop_tokens=("<end_of_turn>",), gguf_config=gguf_config, tied_by_default=True)
