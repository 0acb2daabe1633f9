"""Runtime measurements, interleaved in one run so machine drift cancels:
plain decode tokens/s against transformers `generate`, the cost of scoring k tokens in one pass
relative to one decode step, and tau / speedup of the training-free drafters.

    python -m experiments.runtime --model qwen2.5-coder-0.5b
    python -m experiments.runtime --model smollm2-135m --parts drafters --drafters lookup,moa,eagle,independent \
        --prompts-from data/smollm2-135m-v2-seed0 --max-prompts 10 --new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import TreeConfig
from moaspec.drafters import TRAINED, drafter_kind
from moaspec.models.runtime import Transformer
from moaspec.models.store import chat_ids, load_tokenizer, resolve
from moaspec.pipeline import SpecDecoder

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in a short paragraph why the sky is blue.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "A train travels 180 km in 2.5 hours. What is its average speed? Show the steps.",
]


def _ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def greedy(m: Transformer, prompt_ids: list[int], new_tokens: int, timing: dict | None = None) -> list[int]:
    """Plain greedy decoding on the bare runtime (no engine): what a decode step costs. `timing` gets
    "prefill_s" and "decode_s" (the steps after the first token, what llama.cpp's decode timer counts)."""
    m.reset()
    t0 = time.perf_counter()
    tok = m.prefill(prompt_ids).logits[-1].argmax()
    out = [int(tok)]
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        tok = m.forward(tok[None]).logits[-1].argmax()
        m.advance(1)
        out.append(int(tok))
    if timing is not None:
        timing.update(prefill_s=t1 - t0, decode_s=time.perf_counter() - t1)
    return out


def decode_speed(folder, prompt_ids: list[int], new_tokens: int, rounds: int) -> dict:
    """Greedy decode tokens/s: transformers generate vs this runtime (fp32, fp16), interleaved."""
    from moaspec.models.store import reference_model

    hf = reference_model(folder)
    ours = {mode: Transformer(folder, weights=mode, max_seq_len=len(prompt_ids) + new_tokens + 8)
            for mode in ("fp32", "fp16")}
    ids = torch.tensor([prompt_ids])

    def run_hf() -> list[int]:
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones_like(ids))
        return out[0, len(prompt_ids):].tolist()

    runs = {"transformers": run_hf, "fp32": lambda: greedy(ours["fp32"], prompt_ids, new_tokens),
            "fp16": lambda: greedy(ours["fp16"], prompt_ids, new_tokens)}
    speeds: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name, fn in runs.items():  # interleaved: drift hits every method alike
            t = time.perf_counter()
            tokens[name] = fn()
            speeds[name].append(new_tokens / (time.perf_counter() - t))
    with torch.inference_mode():
        hf_logits = hf(ids).logits[0, -1]
    ours["fp32"].reset()
    diff = (ours["fp32"].prefill(prompt_ids).logits[-1] - hf_logits).abs().max().item()
    med = {k: statistics.median(v) for k, v in speeds.items()}
    return {
        "tokens_per_s": {k: round(v, 2) for k, v in med.items()},
        "speedup_vs_transformers": {k: round(v / med["transformers"], 3) for k, v in med.items()},
        "fp32_same_tokens_as_transformers": tokens["fp32"] == tokens["transformers"],
        "fp32_max_logit_diff": diff,
    }


def scoring_cost(folder, weights: str, context: int = 200, ks=(1, 2, 4, 8, 16, 32), reps: int = 7) -> dict:
    """Milliseconds to score k new tokens after `context` cached ones, and the ratio to k=1."""
    m = Transformer(folder, weights=weights, max_seq_len=context + max(ks) + 8)
    m.prefill(torch.randint(100, 5000, (context,)))
    out = {}
    for k in ks:
        toks = torch.randint(100, 5000, (k,))
        out[k] = _ms(lambda toks=toks: m.forward(toks), reps)
    return {"ms": {k: round(v, 2) for k, v in out.items()},
            "x_decode_step": {k: round(v / out[1], 3) for k, v in out.items()}}


def drafter_speedup(model: str, drafters: list[tuple[str, str | None]], weights: str, new_tokens: int,
                    trees: list[TreeConfig], prompts: list[str] | list[list[int]] = PROMPTS, temperature: float = 0.0,
                    checkpoints: str | None = None) -> dict:
    """tau and tokens/s of each (drafter, tree) against plain decoding, interleaved per prompt, on one copy
    of the target; every greedy answer is checked token-identical to the plain one."""
    dec = SpecDecoder(model, drafter="none", weights=weights)
    engines = {"none": dec.engine}
    for label, draft_model in drafters:
        folder, _, variant = label.partition("/")  # "moa-n1" -> checkpoint folder; "/full": untrimmed head
        name = drafter_kind(folder)
        for tree in trees:
            path = str(Path(checkpoints) / folder) if checkpoints and name in TRAINED else None
            dec.set_drafter(name, draft_model=draft_model, drafter_path=path, tree=tree)
            if variant == "full":
                dec.drafter.untrim()
            engines[f"{label} {tree.label()}"] = dec.engine
    cfg = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingParams(temperature=temperature, seed=0))
    rows: dict[str, dict[str, list[float]]] = {k: {"tps": [], "tau": [], "mismatch": [], "draft": [], "verify": [],
                                                   "calls": []} for k in engines}
    for p in tqdm(prompts, desc="prompts", disable=len(prompts) < 8):
        base = None
        for name, engine in engines.items():
            dec.engine = engine
            g = dec.generate(p, cfg)
            base = g.token_ids if base is None else base
            rows[name]["tps"].append(g.metrics.tokens_per_s)
            rows[name]["tau"].append(g.metrics.tau)
            rows[name]["mismatch"].append(float(temperature == 0 and g.token_ids != base))
            rows[name]["draft"].append(g.metrics.draft_s)
            rows[name]["verify"].append(g.metrics.verify_s)
            rows[name]["calls"].append(g.metrics.target_calls)
    plain = statistics.mean(rows["none"]["tps"])
    return {name: {"tokens_per_s": round(statistics.mean(r["tps"]), 2), "tau": round(statistics.mean(r["tau"]), 3),
                   "speedup": round(statistics.mean(r["tps"]) / plain, 3), "mismatches": int(sum(r["mismatch"])),
                   "draft_ms_per_call": round(1e3 * sum(r["draft"]) / max(1, sum(r["calls"])), 2),
                   "verify_ms_per_call": round(1e3 * sum(r["verify"]) / max(1, sum(r["calls"])), 2)}
            for name, r in rows.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="decode,scoring,drafters")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--drafters", default="lookup,model",
                    help="comma-separated drafters to compare; a trained one names its checkpoint folder under "
                         "--checkpoints (moa, moa-n1, eagle, ...); a /full suffix drafts over the untrimmed vocabulary")
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--prompts-from", default=None,
                    help="a `moaspec data` folder: the chat prompts of its validation split's generated answers")
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--checkpoints", default=None, help="folder with <kind>/ checkpoints of trained drafters")
    ap.add_argument("--trees", default="3,1,3;4,4,6", help="draft trees 'depth,topk,total;...'")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = resolve(a.model)
    tok = load_tokenizer(folder)
    result: dict = {"model": a.model, "threads": torch.get_num_threads()}
    parts = a.parts.split(",")
    if "decode" in parts:
        ids = chat_ids(tok, [{"role": "user", "content": PROMPTS[0]}])
        result["decode"] = decode_speed(folder, ids, a.new_tokens, a.rounds)
        print(json.dumps({"decode": result["decode"]}), flush=True)
    if "scoring" in parts:
        result["scoring"] = {w: scoring_cost(folder, w) for w in ("fp32", "fp16")}
        print(json.dumps({"scoring": result["scoring"]}), flush=True)
    if "drafters" in parts:
        drafters = [(d, a.draft_model if d == "model" else None) for d in a.drafters.split(",")]
        trees = [TreeConfig.parse(t) for t in a.trees.split(";")]
        prompts = PROMPTS
        if a.prompts_from:
            from moaspec.training.data import load

            prompts = [r.ids[:r.prompt_len] for r in load(a.prompts_from, "val") if r.mode != "text"][: a.max_prompts]
        result["drafters"] = drafter_speedup(a.model, drafters, a.weights, a.new_tokens, trees, prompts,
                                             a.temperature, a.checkpoints)
        print(json.dumps({"drafters": result["drafters"]}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
