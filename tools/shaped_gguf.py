"""Write a random-weight GGUF in the shapes of a 7-8B model and quantise it with llama.cpp's own llama-quantize.

No real 7-8B weights install on this machine, yet what such a model costs here (load time, resident memory,
prefill and decode speed, the k-row pass costs that size a draft tree) depends only on its shapes and
formats. So this writes the real layer shapes (Qwen2.5-7B, Llama-3.1-8B) with random weights and a real
tokenizer (the installed Qwen2.5-Coder's for the Qwen shape, SmolLM2's for the Llama shape, each padded
with unused entries to the model's vocabulary size), as F16, then runs `llama-quantize` (built by
`make llama-cpp`) to the asked format and deletes the F16 file. Random weights make speed and memory
real, not acceptance: the text they write is noise. RoPE scaling (Llama 3.1's) is left out.

    .venv/bin/python tools/shaped_gguf.py qwen2.5-7b --out /tmp/shaped            # -> qwen2.5-7b-Q4_K_M.gguf
    .venv/bin/python tools/shaped_gguf.py llama-3.1-8b --type Q4_K_M --out /tmp/shaped
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from moaspec.models import store
from moaspec.models.gguf_file import GGUFFile

SHAPES = {
    "qwen2.5-7b": dict(arch="qwen2", hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064,
                       theta=1e6, eps=1e-6, bias=True, context=32768, tokenizer="qwen2.5-coder-0.5b"),
    "llama-3.1-8b": dict(arch="llama", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                         theta=5e5, eps=1e-5, bias=False, context=8192, tokenizer="smollm2-135m"),
}
UNUSED = 5  # llama.cpp's token type of a padding entry


def tensors(s: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, row length]) of every tensor of the shape `s`."""
    d, hd = s["hidden"], s["hidden"] // s["heads"]
    out = [("token_embd.weight", (s["vocab"], d)), ("output_norm.weight", (d,)), ("output.weight", (s["vocab"], d))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,)), (b + "ffn_norm.weight", (d,)),
                (b + "attn_q.weight", (s["heads"] * hd, d)), (b + "attn_k.weight", (s["kv_heads"] * hd, d)),
                (b + "attn_v.weight", (s["kv_heads"] * hd, d)), (b + "attn_output.weight", (d, s["heads"] * hd)),
                (b + "ffn_gate.weight", (s["ffn"], d)), (b + "ffn_up.weight", (s["ffn"], d)),
                (b + "ffn_down.weight", (d, s["ffn"]))]
        if s["bias"]:
            out += [(b + "attn_q.bias", (s["heads"] * hd,)), (b + "attn_k.bias", (s["kv_heads"] * hd,)),
                    (b + "attn_v.bias", (s["kv_heads"] * hd,))]
    return out


def write_f16(name: str, path: Path, seed: int = 0) -> None:
    s = SHAPES[name]
    src = GGUFFile(store.gguf_file(s["tokenizer"], progress=False))
    tokens = list(src.meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in src.meta["tokenizer.ggml.token_type"]]
    if len(tokens) > s["vocab"]:
        raise SystemExit(f"the {s['tokenizer']} vocabulary ({len(tokens)}) is larger than {name}'s {s['vocab']}")
    pad = s["vocab"] - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), s["vocab"])]
    types += [UNUSED] * pad
    w = GGUFWriter(path, s["arch"])
    w.add_name(f"random {name} shape")
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_file_type(1)  # mostly F16
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(src.meta.get("tokenizer.ggml.pre", "default")))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(src.meta["tokenizer.ggml.merges"]))
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("padding_token_id", w.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in src.meta:
            add(int(src.meta[f"tokenizer.ggml.{key}"]))
    if "tokenizer.chat_template" in src.meta:
        w.add_chat_template(str(src.meta["tokenizer.chat_template"]))
    plan = tensors(s)
    for tname, shape in plan:
        one_d = len(shape) == 1
        w.add_tensor_info(tname, shape, np.dtype(np.float32 if one_d else np.float16),
                          int(np.prod(shape)) * (4 if one_d else 2),
                          GGMLQuantizationType.F32 if one_d else GGMLQuantizationType.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, shape in plan:
        if len(shape) == 1:
            data = np.ones(shape, np.float32) if tname.endswith("norm.weight") else \
                rng.standard_normal(shape, np.float32) * np.float32(0.02)
        else:
            data = np.empty(shape, np.float16)
            for r in range(0, shape[0], 4096):  # a few hundred MB of float32 at a time
                data[r:r + 4096] = rng.standard_normal((min(4096, shape[0] - r), shape[1]), np.float32) * 0.02
        w.write_tensor_data(data)
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type (Q4_K_M, Q4_0, Q8_0, ...)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/shaped"))
    ap.add_argument("--llama-dir", type=Path, default=store.cache_dir() / "llama.cpp" / "build" / "bin")
    args = ap.parse_args()
    quantize = args.llama_dir / "llama-quantize"
    if not quantize.is_file():
        raise SystemExit(f"{quantize} is missing: run `make llama-cpp` first")
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"{args.shape}-F16.gguf"
    final = args.out / f"{args.shape}-{args.type}.gguf"
    t = time.perf_counter()
    write_f16(args.shape, f16)
    print(f"wrote {f16} ({f16.stat().st_size / 1e9:.1f} GB) in {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    threads = str(os.cpu_count() or 2)
    done = subprocess.run([str(quantize), str(f16), str(final), args.type, threads], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama-quantize failed ({done.returncode}): {done.stderr[-2000:]}")
    f16.unlink()
    print(f"wrote {final} ({final.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
