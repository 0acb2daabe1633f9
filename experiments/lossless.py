"""Losslessness at scale: `python -m experiments.lossless`.

Every (prompt, drafter, temperature) job runs on a fork of one decoder whose target passes are batched
with whatever other jobs happen to run beside it (`--parallel` at once, in a shuffled order, so each job
meets random co-tenants: other drafters, tree shapes, prompt lengths and temperatures), and its tokens
are compared with plain decoding of the same prompt alone: at T=0 greedy, at T>0 seeded (the seeded race
makes a speculative answer exactly plain seeded sampling's). Any difference is a mismatch, reported with
its job. The weight mode must be batch-invariant (fp16, int8, int4) for passes to stack.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.scheduler import Scheduler
from moaspec.decoding.tree import TreeConfig
from moaspec.pipeline import SpecDecoder
from moaspec.tasks import TASKS, load_tasks

TREES = ("adaptive:4", "3,2,6", "4,1,4", "adaptive:3x2")


def _cfg(max_new: int, temperature: float, seed: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new, sampling=SamplingParams(temperature, seed=seed))


def run(model: str, weights: str, n_prompts: int, drafters: list[str], temperatures: list[float], parallel: int,
        max_new: int, seed: int) -> dict:
    dec = SpecDecoder(model, drafter="none", weights=weights)
    questions = load_tasks(list(TASKS), max(1, -(-n_prompts // len(TASKS))))[:n_prompts]
    prompts = [dec.encode([{"role": "user", "content": q.turns[0]}]) for q in questions]
    rng = random.Random(seed)
    t0 = time.perf_counter()
    refs = {(i, t): dec.generate(p, _cfg(max_new, t, 1000 + i)).token_ids
            for i, p in enumerate(prompts) for t in temperatures}
    lone_s = time.perf_counter() - t0
    jobs = [(i, d, t, rng.choice(TREES)) for i in range(len(prompts)) for d in drafters for t in temperatures]
    rng.shuffle(jobs)
    scheduler = Scheduler(dec.target, own_thread=False)
    idle = [dec.fork(scheduler) for _ in range(parallel)]
    forks = list(idle)
    mismatches: list[dict] = []

    def job(k: int) -> None:
        i, drafter, temperature, tree = jobs[k]
        fork = idle.pop()
        try:
            fork.set_drafter(drafter=drafter, tree=None if drafter == "none" else TreeConfig.parse(tree))
            got = fork.generate(prompts[i], _cfg(max_new, temperature, 1000 + i)).token_ids
            if got != refs[(i, temperature)]:
                want = refs[(i, temperature)]
                at = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                          min(len(got), len(want)))
                mismatches.append({"prompt": i, "drafter": drafter, "tree": tree, "temperature": temperature,
                                   "first_difference": at})
        finally:
            fork.release()
            idle.append(fork)

    t0 = time.perf_counter()
    for f in scheduler.completed(job, range(len(jobs)), parallel):  # each job a slot of the scheduler's loop
        f.result()
    batched_s = time.perf_counter() - t0
    for fork in forks:
        fork.close()
    scheduler.close()
    s = scheduler.stats
    return {"model": model, "weights": weights, "prompts": len(prompts), "drafters": drafters,
            "temperatures": temperatures, "trees": list(TREES), "parallel": parallel, "max_new_tokens": max_new,
            "runs": len(jobs), "mismatches": len(mismatches), "mismatch_list": mismatches,
            "passes": s.passes, "max_sequences_per_pass": max(s.seqs_per_pass, default=0),
            "lone_reference_s": round(lone_s, 1), "batched_s": round(batched_s, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.lossless", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="int8", choices=("fp16", "int8", "int4"))
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--drafters", default="none,lookup,suffix,moa,eagle,independent,hybrid")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/lossless.json")
    a = ap.parse_args(argv)
    res = run(a.model, a.weights, a.prompts, [d for d in a.drafters.split(",") if d],
              [float(t) for t in a.temperatures.split(",")], a.parallel, a.max_new_tokens, a.seed)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "mismatch_list"}, indent=1))
    for m in res["mismatch_list"]:
        print("MISMATCH", m)
    return 1 if res["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
