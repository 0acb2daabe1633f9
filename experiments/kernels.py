"""Milliseconds per linear layer for each weight mode at the row counts decoding and verification use.

One layer shape, many copies streamed from memory (more bytes than the L3 cache holds), so the time is
what a decode step sees, not a cache-hot loop; the modes are interleaved per repetition.

    python -m experiments.kernels --shape 9728x896 --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moaspec.models.linear import WEIGHT_MODES, Linear


def measure(out: int, inp: int, rows: list[int], modes: list[str], copies: int,
            reps: int) -> dict[str, dict[int, float]]:
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) * 0.02 for _ in range(copies)]
    layers = {m: [Linear(w, None, m) for w in weights] for m in modes}
    del weights
    times: dict[str, dict[int, list[float]]] = {m: {r: [] for r in rows} for m in modes}
    xs = {r: torch.randn(r, inp) for r in rows}
    for rep in range(reps + 1):
        for r in rows:
            for m in modes:
                t = time.perf_counter()
                for lin in layers[m]:
                    lin(xs[r])
                if rep:
                    times[m][r].append((time.perf_counter() - t) * 1e3 / copies)
    return {m: {r: statistics.median(v) for r, v in d.items()} for m, d in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="9728x896", help="out x in of the layer")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--modes", default=",".join(WEIGHT_MODES))
    ap.add_argument("--copies", type=int, default=24)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    out, inp = (int(v) for v in a.shape.lower().split("x"))
    rows = [int(r) for r in a.rows.split(",")]
    res = measure(out, inp, rows, a.modes.split(","), a.copies, a.reps)
    print(f"ms per {out}x{inp} layer ({a.copies} copies streamed, {torch.get_num_threads()} threads)")
    print("| mode | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for m, d in res.items():
        print(f"| {m} | " + " | ".join(f"{d[r]:.3f}" for r in rows) + " |")


if __name__ == "__main__":
    main()
