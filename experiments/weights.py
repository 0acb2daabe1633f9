"""Weight modes side by side: plain greedy decoding tokens/s of this runtime in each mode and of
llama.cpp on the model's own GGUF, interleaved in rounds so machine drift hits all alike; and what
scoring k tokens in one pass costs in each mode (the verification of a k-token draft).

    python -m experiments.weights --models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from experiments.runtime import PROMPTS, greedy, scoring_cost
from moaspec import llamacpp
from moaspec.models.runtime import Transformer
from moaspec.models.store import gguf_file, load_tokenizer, resolve

LLAMA = "llama.cpp"


def decode_speeds(model: str, modes: list[str], new_tokens: int, rounds: int) -> dict[str, float]:
    """Median decode tokens/s per mode (the prompt's prefill not counted) and llama.cpp's (its own decode
    timer) over `rounds` rounds."""
    folder = resolve(model)
    tok = load_tokenizer(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok.encode(prompt)
    ours = {m: Transformer(folder, weights=m, max_seq_len=len(ids) + new_tokens + 8) for m in modes if m != LLAMA}
    for m in ours.values():
        greedy(m, ids, 4)  # one-time kernel set-up
    speeds: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            if m == LLAMA:
                a = llamacpp.generate(prompt, gguf_file(model), new_tokens, threads=torch.get_num_threads())
                speeds[m].append(a.new_tokens / a.decode_s)
            else:  # decode steps only, as llama.cpp's decode timer counts (its prompt is timed apart)
                timing: dict = {}
                greedy(ours[m], ids, new_tokens, timing)
                speeds[m].append((new_tokens - 1) / timing["decode_s"])
    return {m: round(statistics.median(v), 1) for m, v in speeds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--modes", default="fp16,int8,int4,int4-g128,llama.cpp")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    if llamacpp.missing():
        modes = [m for m in modes if m != LLAMA]
    ks = tuple(int(k) for k in a.ks.split(","))
    results = {}
    for model in a.models.split(","):
        speeds = decode_speeds(model, modes, a.new_tokens, a.rounds)
        costs = {m: scoring_cost(resolve(model), m, ks=ks) for m in modes if m != LLAMA}
        results[model] = {"tokens_per_s": speeds, "scoring": costs}
        print(f"\n{model}, {torch.get_num_threads()} threads, {a.new_tokens} new tokens")
        print("| mode | plain tok/s | x fp16 | " + " | ".join(f"{k} rows ms" for k in ks) + " |")
        print("|---|---|---|" + "---|" * len(ks))
        base = speeds.get("fp16")
        for m in modes:
            ratio = f"{speeds[m] / base:.2f}x" if base else "-"
            ms = " | ".join(f"{costs[m]['ms'][k]:.1f}" for k in ks) if m in costs else " | ".join("-" for _ in ks)
            print(f"| {m} | {speeds[m]} | {ratio} | {ms} |")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
