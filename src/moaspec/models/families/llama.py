"""Llama 2 and 3.x (3.1/3.2/3.3 with Llama 3's RoPE scaling): the block every other family varies."""

from __future__ import annotations

from moaspec.models.families import LLAMA_TENSORS, Family

FAMILY = Family(name="llama", hf_class="LlamaForCausalLM", gguf_arch="llama", tensors=LLAMA_TENSORS,
                permuted_qk=True, stop_tokens=("<|eot_id|>", "<|eom_id|>"))
