"""What self-distillation data costs: `python -m experiments.datagen`.

Three ways to get a target's answers and the target's features of them, on the same prompts, one
after another in one process:
- answers: `moaspec data --engine moaspec` (this runtime, `--parallel` answers batched), no features;
- one pass: the same with `--features`: the features recorded from the passes that wrote the answers
  and stored as the data job stores them;
- two passes: the answers, then a second target pass over each whole sequence as training computes
  it today (`training.features.compute`), in fp32 (the exact target) and in the answers' own mode.
Reported: answer tokens/s (generated tokens over the wall time) and sequence tokens/s of features
(prompt + answer positions over the time to have both answers and features).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from moaspec.models.runtime import Transformer
from moaspec.models.store import load_tokenizer, resolve
from moaspec.training.features import RECORDED_TLI, AnswerFeatures, compute
from moaspec.training.generators import Request, RuntimeGenerator
from moaspec.training.prompts import build_prompts


def requests(model: str, n: int, seed: int) -> tuple[list[Request], int]:
    from moaspec.models.store import chat_ids

    tok = load_tokenizer(resolve(model))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = build_prompts(n, seed)
    reqs = [Request(p.id, chat_ids(tok, [{"role": "user", "content": p.text}])[:256], 0.0 if i % 2 else 0.7, i)
            for i, p in enumerate(prompts)]
    return reqs, eos


def run(model: str, weights: str, n: int, max_new: int, parallel: int, seed: int) -> dict:
    reqs, eos = requests(model, n, seed)
    out: dict = {"model": model, "weights": weights, "prompts": n, "max_new_tokens": max_new, "parallel": parallel}
    with tempfile.TemporaryDirectory() as tmp:
        store = AnswerFeatures("bench", weights, root=Path(tmp))
        for label, features in (("answers", False), ("one pass", True)):
            gen = RuntimeGenerator(model, weights, eos, parallel, 256 + max_new + 8, features=features)
            t0 = time.perf_counter()
            answers = list(gen.generate(reqs, max_new))
            if features:
                by_key = {r.key: r for r in reqs}
                for a in answers:
                    store.write(a.key, by_key[a.key].prompt + a.tokens, *a.features)
            wall = time.perf_counter() - t0
            layers = gen.features or ()
            del gen
            generated = sum(len(a.tokens) for a in answers)
            positions = sum(len(r.prompt) for r in reqs) + generated
            out[label] = {"seconds": round(wall, 1), "answer_tok_s": round(generated / wall, 1),
                          "feature_tok_s": round(positions / wall, 1) if features else None}
            if not features:
                by_key = {r.key: r for r in reqs}
                seqs = [by_key[a.key].prompt + a.tokens for a in answers]
                answer_s = wall
        for mode in ("fp32", weights):
            target = Transformer(resolve(model), weights=mode, max_seq_len=256 + max_new + 16)
            t0 = time.perf_counter()
            for ids in seqs:
                compute(target, ids, layers, greedy=False)
            second = time.perf_counter() - t0
            del target
            out[f"two passes ({mode} features)"] = {
                "seconds": round(answer_s + second, 1), "features_s": round(second, 1),
                "answer_tok_s": out["answers"]["answer_tok_s"],
                "feature_tok_s": round(positions / (answer_s + second), 1)}
    out["recorded_layers"] = f"L - N for N in {RECORDED_TLI}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.datagen", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--weights", default="fp16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    res = run(args.model, args.weights, args.prompts, args.max_new_tokens, args.parallel, args.seed)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
