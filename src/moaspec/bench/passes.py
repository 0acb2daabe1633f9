"""What a target pass over k rows costs with the compiled few-row kernels and without them (fbgemm's
fp16 layers and SDPA), interleaved in one process on one copy of the weights, so machine drift cancels.

Verification scores a draft of k tokens in one pass; speculative decoding pays off only if that pass
costs little more than a one-row decode step.

    python -m moaspec.bench.passes --model qwen2.5-coder-0.5b --rows 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moaspec.decoding.tree import Tree
from moaspec.models.runtime import Transformer
from moaspec.models.store import resolve


def measure(model: Transformer, rows: list[int], context: int, reps: int) -> dict[bool, dict[int, float]]:
    """Median ms of a k-row chain pass after `context` cached tokens, kernels on and off."""
    model.reset()
    model.forward(torch.zeros(context, dtype=torch.long))
    model.advance(context)
    times: dict[bool, dict[int, list[float]]] = {on: {k: [] for k in rows} for on in (False, True)}
    for rep in range(reps + 1):
        for k in rows:
            tree = Tree.chain(100, [101] * (k - 1))
            for on in (False, True):
                model.few_row_kernels(on)
                t = time.perf_counter()
                if k == 1:  # as `LocalTarget.verify` runs a decode step: no mask
                    model.forward(torch.tensor(tree.tokens))
                else:
                    model.forward(torch.tensor(tree.tokens), positions=tree.positions(context), tree_mask=tree.mask())
                if rep:  # the first round warms up
                    times[on][k].append((time.perf_counter() - t) * 1e3)
    model.few_row_kernels(True)
    model.reset()
    return {on: {k: statistics.median(v) for k, v in d.items()} for on, d in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = Transformer(resolve(a.model), weights="fp16")
    if model.kernels is None:
        raise SystemExit("the compiled kernels are not available here: nothing to compare")
    model.warmup()
    rows = [int(r) for r in a.rows.split(",")]
    res = measure(model, rows, a.context, a.reps)
    base = res[False][rows[0]]
    print(f"{a.model} fp16, {a.context} cached tokens, {torch.get_num_threads()} threads; ms per pass "
          f"(x a {rows[0]}-row pass without the kernels)")
    print("| kernels | " + " | ".join(f"k={k}" for k in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for on, label in ((False, "fbgemm + SDPA"), (True, "few-row + row-invariant attention")):
        print(f"| {label} | " + " | ".join(f"{res[on][k]:.1f} ({res[on][k] / base:.2f})" for k in rows) + " |")


if __name__ == "__main__":
    main()
