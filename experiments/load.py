"""Decoding beside other work: tokens/s with 0, 1 and 2 busy background processes (each spinning one
core), for the default thread count (`--threads auto`: the cores idle at start) and for fixed counts,
plain and speculative. Each configuration runs in a fresh `moaspec generate` process, as a user's would.

    python -m experiments.load --model qwen2.5-coder-0.5b --weights int4 --drafters none,lookup
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring and two examples."


def _spin() -> None:
    while True:
        pass


def generate(model: str, weights: str, drafter: str, threads: str, tokens: int) -> float:
    cmd = [sys.executable, "-m", "moaspec", "generate", "--model", model, "--weights", weights, "--drafter", drafter,
           "--threads", threads, "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
    return float(json.loads(out.stdout)["tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--drafters", default="none,lookup")
    ap.add_argument("--threads", default="auto,1,2")
    ap.add_argument("--busy", default="0,1,2", help="numbers of busy background processes")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for busy in (int(b) for b in a.busy.split(",")):
        procs = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
        for p in procs:
            p.start()
        time.sleep(1.0)
        try:
            for drafter in a.drafters.split(","):
                for threads in a.threads.split(","):
                    speeds = [generate(a.model, a.weights, drafter, threads, a.tokens) for _ in range(a.reps)]
                    rows.append((busy, drafter, threads, statistics.median(speeds)))
                    print(rows[-1], flush=True)
        finally:
            for p in procs:
                p.terminate()
    quiet = {(d, t): s for b, d, t, s in rows if b == 0}
    print(f"\n{a.model} {a.weights}, {a.tokens} tokens, tokens/s (share of the same setting on a quiet machine)")
    print("| busy processes | drafter | threads | tok/s |")
    print("|---|---|---|---|")
    for busy, drafter, threads, s in rows:
        q = quiet.get((drafter, threads))
        print(f"| {busy} | {drafter} | {threads} | {s:.1f}" + (f" ({s / q:.0%})" if q and busy else "") + " |")


if __name__ == "__main__":
    main()
