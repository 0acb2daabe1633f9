"""`--drafter auto` against plain decoding where drafts rarely match: open-ended prose, no code to copy,
per target and weight mode. Speculation must not cost a user speed there: the adaptive chain drafts
nothing while no draft length is expected to beat a plain step (`decoding.tree.AdaptiveChain`).
Each prompt is answered once (to its end or `--new-tokens`), by plain decoding and by a fresh `auto`
drafter (no memory of the other prompts' answers; the shipped datastore as a user gets it), on one copy of
the target, interleaved per prompt; every greedy answer is checked token-identical to plain.

    python -m experiments.auto --models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --modes fp16,int8,int4
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from moaspec.decoding.engine import GenerationConfig
from moaspec.drafters import resolve_auto
from moaspec.pipeline import SpecDecoder

PROSE = [
    "Write a short story about a lighthouse keeper who finds a map inside a bottle.",
    "Describe the taste of a mango to someone who has never eaten one.",
    "Invent a board game and its backstory in one paragraph.",
    "Write four lines about autumn rain in a small mountain town.",
    "Give three unusual uses for a paperclip and say why each works.",
    "Compose a friendly letter from a cat to the dog next door.",
    "Traduis en français : The old bridge was closed for repairs, so we took the ferry across the river.",
    "Describe a sunrise over a desert without using the words sun, light or sand.",
    "What might a city look like in the year 2300? Answer in one paragraph.",
    "Write a product description for a teapot shaped like a snail.",
    "Summarise the plot of a made-up detective novel set on a night train.",
    "Explain to a child why leaves change colour in autumn.",
]


def compare(model: str, mode: str, new_tokens: int, prompts: list[str] = PROSE) -> dict:
    """Tokens/s of plain and auto decoding over all answers, tau of auto, and answers differing from plain."""
    dec = SpecDecoder(model, drafter="none", weights=mode)
    plain = dec.engine
    cfg = GenerationConfig(max_new_tokens=new_tokens)
    tokens = {"plain": 0, "auto": 0}
    secs = {"plain": 0.0, "auto": 0.0}
    taus, differ = [], 0
    for p in prompts:
        dec.engine = plain
        base = dec.generate(p, cfg)
        dec.set_drafter("auto", tree="auto")  # fresh: no memory of the other answers
        g = dec.generate(p, cfg)
        for name, r in (("plain", base), ("auto", g)):
            tokens[name] += r.metrics.new_tokens
            secs[name] += r.metrics.total_s - r.metrics.prefill_s
        taus.append(g.metrics.tau)
        differ += g.token_ids != base.token_ids
    p, a = tokens["plain"] / secs["plain"], tokens["auto"] / secs["auto"]
    return {"weights": dec.target.weights, "drafter": resolve_auto(model), "plain_tok_s": round(p, 2),
            "auto_tok_s": round(a, 2), "auto_x_plain": round(a / p, 3), "tau": round(statistics.mean(taus), 3),
            "answers": len(taus), "differing": int(differ)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--modes", default="fp16,int8,int4")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    a = ap.parse_args()
    results = {}
    print(f"{torch.get_num_threads()} threads, up to {a.new_tokens} tokens, {len(PROSE)} prose prompts, decode tok/s")
    print("| target | weights | drafter | plain tok/s | auto tok/s | auto x plain | tau | answers differing |")
    print("|---|---|---|---|---|---|---|---|")
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            r = results[f"{model}/{mode}"] = compare(model, mode, a.new_tokens)
            print(f"| {model} | {r['weights']} | {r['drafter']} | {r['plain_tok_s']} | {r['auto_tok_s']} | "
                  f"{r['auto_x_plain']:.2f}x | {r['tau']:.2f} | {r['differing']}/{r['answers']} |", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
