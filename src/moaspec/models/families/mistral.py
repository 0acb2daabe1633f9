"""Mistral: Llama's block with a sliding attention window (v0.1: 4,096; later versions none). llama.cpp
writes Mistral's GGUF files as `llama` (without the window, as llama.cpp runs them); a Hugging Face folder
keeps its window here."""

from __future__ import annotations

from moaspec.models.families import LLAMA_TENSORS, Family

FAMILY = Family(name="mistral", hf_class="MistralForCausalLM", gguf_arch=None, tensors=LLAMA_TENSORS,
                stop_tokens=("</s>",))
