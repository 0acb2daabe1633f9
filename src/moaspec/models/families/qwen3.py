"""Qwen3 (dense): Llama's block with an RMS norm over each q and k head before RoPE, no biases."""

from __future__ import annotations

from moaspec.models.families import LLAMA_TENSORS, QK_NORM_TENSORS, Family

FAMILY = Family(name="qwen3", hf_class="Qwen3ForCausalLM", gguf_arch="qwen3",
                tensors={**LLAMA_TENSORS, **QK_NORM_TENSORS}, qk_norm=True, stop_tokens=("<|im_end|>", "<|endoftext|>"))
