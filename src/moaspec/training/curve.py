"""Learning curve: validation top-1 agreement at draft depth 1..6 against training tokens, for
drafters trained side by side on the same data (MoA N=0 and EAGLE-2 by default).

One run over a seeded subset of the largest budget, one epoch, constant learning rate after warm-up,
validated when it has seen each budget: a budget's point is the drafter after exactly that many
distinct tokens, and a smaller budget's tokens are a prefix of a larger one's. At each point a decay
branch (warmup-stable-decay) also trains `--decay` x the point's steps more over its last batches
again, the learning rate falling linearly to lr/20, and is validated too: what a run of that budget
would ship (a constant rate leaves 1.5-2 points of agreement on the table); the main run goes on from
before the branch. Writes curve.json, curve.png, points/<budget>/ and points/<budget>-annealed/ (the
drafters, folders that `moaspec export`, `moaspec bench --checkpoints` and `experiments.agreement` take) into
the run folder; a stopped run resumes.

    python -m moaspec.training.curve --model smollm2-135m --data data/smollm2-135m-v2-seed0 \
        --out runs/curve-smol --points 60000,120000,250000,500000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moaspec.errors import UserError
from moaspec.training.train import TrainConfig, Trainer


def run(cfg: TrainConfig, points: list[int], decay: float = 0.1) -> dict:
    if not 0.0 <= decay <= 1.0:
        raise UserError(f"--decay is a fraction of a point's steps, between 0 and 1, not {decay}")
    points = sorted(points)
    cfg.data_tokens, cfg.epochs, cfg.lr_min = points[-1], 1.0, cfg.lr
    cfg.val_every = 10**9  # validation happens at the budgets below
    cfg.save_every = 200  # a run of many sessions (Qwen at 2M tokens) keeps its progress between budgets
    tr = Trainer(cfg)
    seen, steps = 0, []
    for step in range(cfg.steps):
        seen += sum(len(e.ids) for e in tr.batch(step))
        while len(steps) < len(points) and seen >= points[len(steps)]:
            steps.append((points[len(steps)], step + 1, seen))
    while len(steps) < len(points):  # the subset came out a little short of the largest budget
        steps.append((points[len(steps)], cfg.steps, seen))
    out = Path(cfg.out)
    path = out / "curve.json"
    rows = json.loads(path.read_text())["points"] if path.exists() else []
    done = {r["budget"] for r in rows}
    for budget, step, tokens in steps:
        if budget in done:
            continue
        result = tr.run(until=step)
        if result["signalled"]:  # ended by a signal, saved: the same command resumes
            return {"points": rows, "stopped_at_step": result["steps"]}
        info = {"budget": budget, "data_tokens": tokens, "steps": step, "batch_size": cfg.batch_size, "lr": cfg.lr}
        tr.save_point(out / "points" / str(budget), info)
        row = {"budget": budget, "tokens": tokens, "step": step, "val": tr.validate(),
               "val_context_mean": tr.validate(context_mean=True),
               "feature_extraction": result.get("feature_extraction"), "seconds": result["seconds"]}
        if decay > 0:
            n, lr_end = max(1, round(decay * step)), cfg.lr / 20
            with tr.branch():
                tr.decay(n, lr_end)
                tr.save_point(out / "points" / f"{budget}-annealed", {**info, "decay_steps": n, "lr_end": lr_end})
                row.update(decay_steps=n, val_annealed=tr.validate())
        rows.append(row)
        path.write_text(json.dumps({"model": cfg.model, "data": cfg.data, "kinds": cfg.kind,
                                    "tli_layers": cfg.tli_layers, "batch_size": cfg.batch_size, "lr": cfg.lr,
                                    "points": rows}, indent=1))
        plot(rows, out / "curve.png", cfg.model)  # after every point: a run of many sessions shows its progress
    return {"points": rows}


def at_depth(by_depth: dict, depth: int) -> float | None:
    """A `top1_by_depth` entry whether its keys are ints (fresh) or strings (read back from JSON)."""
    return by_depth.get(depth, by_depth.get(str(depth)))


def plot(rows: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    labels = list(rows[0]["val"])
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4), sharey=True, squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        for depth in (1, 2, 3, 6):
            xs = [r["tokens"] for r in rows]
            ys = [at_depth(r["val"][label]["top1_by_depth"], depth) for r in rows]
            ax.plot(xs, ys, marker="o", label=f"depth {depth}")
        ablation = [(r["tokens"], r["val_context_mean"][label]["top1_by_depth"]) for r in rows
                    if label in r.get("val_context_mean", {})]
        if ablation:  # MoA with every Cross-Attention row reading the mean context
            ax.plot([x for x, _ in ablation], [at_depth(d, 1) for _, d in ablation], "--", marker="x",
                    color="C0", alpha=0.6, label="depth 1, mean context")
        annealed = [(r["tokens"], r["val_annealed"][label]["top1_by_depth"]) for r in rows if "val_annealed" in r]
        if annealed:  # the decay branch: what a run of that budget ships
            ax.plot([x for x, _ in annealed], [at_depth(d, 1) for _, d in annealed], ":", marker="^",
                    color="C0", label="depth 1, annealed")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{label} ({model})")
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("validation top-1 agreement")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kind", default="moa,eagle")
    p.add_argument("--tli", default="0", help="MoA Target Layer Inference N, e.g. 0,1: one MoA per N")
    p.add_argument("--points", default="60000,120000,250000,500000")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--val-sequences", type=int, default=64)
    p.add_argument("--decay", type=float, default=0.1,
                   help="decay branch at each point: this fraction of its steps, lr falling to lr/20 (0 = none)")
    a = p.parse_args()
    cfg = TrainConfig(model=a.model, data=a.data, out=a.out, kind=a.kind, tli_layers=a.tli,
                      batch_size=a.batch_size, lr=a.lr,
                      val_sequences=a.val_sequences)
    result = run(cfg, [int(x) for x in a.points.split(",")], a.decay)
    print(json.dumps(result, indent=1))
    return 130 if "stopped_at_step" in result else 0  # like an interrupted command: `&&` does not go on


if __name__ == "__main__":
    raise SystemExit(main())
