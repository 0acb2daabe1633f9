"""Qwen2 and Qwen2.5: Llama's block with biases on q, k and v."""

from __future__ import annotations

from moaspec.models.families import LLAMA_TENSORS, Family

FAMILY = Family(name="qwen2", hf_class="Qwen2ForCausalLM", gguf_arch="qwen2", tensors=LLAMA_TENSORS,
                stop_tokens=("<|im_end|>", "<|endoftext|>"))
