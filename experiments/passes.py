"""What a target pass over k rows costs with each choice of kernels for 1-8 rows: fbgemm's fp16 layers
and SDPA (no compiler), the compiled few-row fp16 layers or fbgemm's, each with the row-invariant
attention; interleaved in one process on one copy of the weights, so machine drift cancels. The runtime
picks the layers per model and machine (`Transformer.few_row_choice`); this shows what it is worth.

Verification scores a draft of k tokens in one pass; speculative decoding pays off only if that pass
costs little more than a one-row decode step.

    python -m experiments.passes --model qwen2.5-coder-0.5b --rows 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moaspec.decoding.tree import Tree
from moaspec.models.runtime import Transformer
from moaspec.models.store import resolve

KERNELS = {  # label: (few-row fp16 layers, row-invariant attention)
    "fbgemm + SDPA": (False, False),
    "few-row + row-invariant attention": (True, True),
    "fbgemm + row-invariant attention": (False, True),
}


def measure(model: Transformer, rows: list[int], context: int, reps: int) -> dict[str, dict[int, float]]:
    """Median ms of a k-row chain pass after `context` cached tokens with each of `KERNELS`."""
    model.reset()
    model.forward(torch.zeros(context, dtype=torch.long))
    model.advance(context)
    times: dict[str, dict[int, list[float]]] = {label: {k: [] for k in rows} for label in KERNELS}
    for rep in range(reps + 1):
        for k in rows:
            tree = Tree.chain(100, [101] * (k - 1))
            for label, (layers, attention) in KERNELS.items():
                model.few_row_kernels(layers, attention)
                t = time.perf_counter()
                if k == 1:  # as `LocalTarget.verify` runs a decode step: no mask
                    model.forward(torch.tensor(tree.tokens))
                else:
                    model.forward(torch.tensor(tree.tokens), positions=tree.positions(context), tree_mask=tree.mask())
                if rep:  # the first round warms up
                    times[label][k].append((time.perf_counter() - t) * 1e3)
    model.few_row_kernels()
    model.reset()
    return {label: {k: statistics.median(v) for k, v in d.items()} for label, d in times.items()}


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
    base = res["fbgemm + SDPA"][rows[0]]
    chosen = "few-row" if model.few_row_choice() else "fbgemm"
    print(f"{a.model} fp16, {a.context} cached tokens, {torch.get_num_threads()} threads; ms per pass "
          f"(x a {rows[0]}-row pass with fbgemm + SDPA); the runtime runs {chosen} layers here")
    print("| kernels | " + " | ".join(f"k={k}" for k in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for label, ms in res.items():
        print(f"| {label} | " + " | ".join(f"{ms[k]:.1f} ({ms[k] / base:.2f})" for k in rows) + " |")


if __name__ == "__main__":
    main()
