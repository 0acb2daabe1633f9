"""`--drafter auto` against plain decoding where drafts rarely match: open-ended prose, no code to copy,
per target and weight mode. Speculation must not cost a user speed there: the adaptive chain drafts
nothing while no draft length is expected to beat a plain step (`decoding.tree.AdaptiveChain`).
Both run on one copy of the target, interleaved per prompt and round; every greedy answer is checked
token-identical to plain.

    python -m moaspec.bench.auto --models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --modes fp16,int8,int4
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
]


def compare(model: str, mode: str, new_tokens: int, rounds: int, prompts: list[str] = PROSE) -> dict:
    """Mean tokens/s of plain and auto decoding, tau of auto, and answers differing from plain."""
    dec = SpecDecoder(model, drafter="none", weights=mode)
    plain = dec.engine
    dec.set_drafter("auto", tree="auto")
    engines = {"plain": plain, "auto": dec.engine}
    cfg = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    tps: dict[str, list[float]] = {k: [] for k in engines}
    taus, differ = [], 0
    for _ in range(rounds):
        for p in prompts:
            base = None
            for name, engine in engines.items():
                dec.engine = engine
                g = dec.generate(p, cfg)
                tps[name].append(g.metrics.tokens_per_s)
                if base is None:
                    base = g.token_ids
                else:
                    taus.append(g.metrics.tau)
                    differ += g.token_ids != base
    p, a = statistics.mean(tps["plain"]), statistics.mean(tps["auto"])
    return {"weights": dec.target.weights, "drafter": resolve_auto(model), "plain_tok_s": round(p, 2),
            "auto_tok_s": round(a, 2), "auto_x_plain": round(a / p, 3), "tau": round(statistics.mean(taus), 3),
            "answers": len(taus), "differing": int(differ)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--modes", default="fp16,int8,int4")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    a = ap.parse_args()
    results = {}
    print(f"{torch.get_num_threads()} threads, {a.new_tokens} tokens, {len(PROSE)} prose prompts x {a.rounds} rounds")
    print("| target | weights | drafter | plain tok/s | auto tok/s | auto x plain | tau | answers differing |")
    print("|---|---|---|---|---|---|---|---|")
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            r = results[f"{model}/{mode}"] = compare(model, mode, a.new_tokens, a.rounds)
            print(f"| {model} | {r['weights']} | {r['drafter']} | {r['plain_tok_s']} | {r['auto_tok_s']} | "
                  f"{r['auto_x_plain']:.2f}x | {r['tau']:.2f} | {r['differing']}/{r['answers']} |", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
