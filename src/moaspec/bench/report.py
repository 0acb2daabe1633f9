"""The benchmark report, computed from the answer files alone: a markdown table like the paper's
(speedup and tau per task and method), a pooled table with tokens/s, target calls per token, the
draft/verify time split and the T=0 identity check, `results.json`, and plots.

Speedup is tokens/s over plain decoding's on the same questions in the same run (ratio of pooled
tokens over pooled wall time, prefill included, for every method alike). The decode speedup leaves the
prefill out (tokens over the time after it, the inverse of the time per output token that serving
benchmarks report): the part of a turn that speculative decoding accelerates, which the short answers
of a CPU benchmark otherwise dilute. A method that reports no prefill time (a transformers peer) has none.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from moaspec.bench.answers import answer_path, read_answers
from moaspec.decoding.tree import TreeConfig


def load(out: Path) -> tuple[dict, dict[tuple[float, str], dict[str, dict]]]:
    meta = json.loads((out / "meta.json").read_text())
    temps = meta["config"]["temperatures"]
    answers = {(t, m): read_answers(answer_path(out, m, t)) for t in temps for m in meta["methods"]}
    return meta, answers


def aggregate(meta: dict, answers: dict[tuple[float, str], dict[str, dict]]) -> list[dict]:
    """One row per (temperature, task or "all", method), over the questions every method answered."""
    methods = meta["methods"]
    rows = []
    for t in meta["config"]["temperatures"]:
        common = set.intersection(*(set(answers[(t, m)]) for m in methods)) if methods else set()
        tasks = sorted({answers[(t, "plain")][q]["category"] for q in common})
        for task in [*tasks, "all"]:
            qs = sorted(q for q in common if task == "all" or answers[(t, "plain")][q]["category"] == task)
            if not qs:
                continue
            stats = {m: _pool([answers[(t, m)][q]["choices"][0] for q in qs]) for m in methods}
            decode = {m: _decode_rate(stats[m]) for m in methods}
            plain_ids = [answers[(t, "plain")][q]["choices"][0]["token_ids"] for q in qs]
            for m in methods:
                s = stats[m]
                ids = [answers[(t, m)][q]["choices"][0]["token_ids"] for q in qs]
                differ = None if t != 0 or any(y is None for x in ids for y in x) else sum(  # llama.cpp: no ids
                    a != b for x, y in zip(ids, plain_ids, strict=True) for a, b in zip(x, y, strict=False))
                rows.append({
                    "temperature": t, "task": task, "method": m, "questions": len(qs), "turns": s["turns"],
                    "new_tokens": s["tokens"], "seconds": round(s["wall"], 3),
                    "tokens_per_s": round(s["tokens"] / s["wall"], 3) if s["wall"] else 0.0,
                    "speedup": round(s["tokens"] / s["wall"] / (stats["plain"]["tokens"] / stats["plain"]["wall"]), 3),
                    "prefill_share": round(s["prefill"] / s["wall"], 3) if s["wall"] and s["prefill"] else None,
                    "decode_tokens_per_s": decode[m],
                    "decode_speedup": round(decode[m] / decode["plain"], 3) if decode[m] and decode["plain"] else None,
                    "tau": round(s["accepted"] / s["calls"], 3) if s["calls"] else (1.0 if m == "plain" else None),
                    "target_calls_per_token": round(s["calls"] / s["tokens"], 3) if s["calls"] else None,
                    "draft_share": round(s["draft"] / s["wall"], 3) if s["wall"] else None,
                    "verify_share": round(s["verify"] / s["wall"], 3) if s["wall"] else None,
                    "mismatched_turns": differ,
                    "accept_histogram": s["histogram"],
                })
    return rows


def _decode_rate(s: dict) -> float | None:
    """Tokens per second after the prefill, or None where no prefill time was reported."""
    decode = s["wall"] - s["prefill"]
    return round(s["tokens"] / decode, 3) if s["prefill"] > 0 and decode > 0 else None


def _pool(choices: list[dict]) -> dict:
    s = {"turns": 0, "tokens": 0, "wall": 0.0, "prefill": 0.0, "calls": 0, "accepted": 0, "draft": 0.0,
         "verify": 0.0}
    hist: dict[int, int] = defaultdict(int)
    for c in choices:
        s["turns"] += len(c["new_tokens"])
        s["tokens"] += sum(c["new_tokens"])
        s["wall"] += sum(c["wall_time"])
        s["prefill"] += sum(c.get("prefill_time", [0.0]))
        s["draft"] += sum(c.get("draft_time", [0.0]))
        s["verify"] += sum(c.get("verify_time", [0.0]))
        for lengths, calls, tokens in zip(c["accept_lengths"], c["target_calls"], c["new_tokens"], strict=True):
            s["calls"] += calls
            s["accepted"] += sum(lengths) if lengths else tokens * bool(calls)  # a peer reports counts only
            for n in lengths:
                hist[n] += 1
    s["histogram"] = dict(sorted(hist.items()))
    return s


def markdown(meta: dict, rows: list[dict]) -> str:
    cfg = meta["config"]
    lines = [f"# moaspec bench: {cfg['model']} ({cfg['weights']} weights, {meta['threads']} threads)", "",
             f"Started {meta['started']}. Up to {cfg['max_new_tokens']} new tokens per turn; "
             f"{max((r['questions'] for r in rows if r['task'] == 'all'), default=0)} questions answered by every "
             "method. Trees: "
             + ", ".join(f"{m} {TreeConfig(**t).label()}" for m, t in meta["trees"].items() if m != "plain")
             + ".", ""]
    lines += [f"- {n}" for n in meta.get("notes", [])]
    for t in cfg["temperatures"]:
        sub = [r for r in rows if r["temperature"] == t]
        if not sub:
            continue
        tasks = [x for x in dict.fromkeys(r["task"] for r in sub) if x != "all"]
        lines += ["", f"## T = {t:g}", "", "Speedup over plain decoding (tau) per task:", "",
                  "| method | " + " | ".join(tasks) + " | all |", "|---" * (len(tasks) + 2) + "|"]
        for m in meta["methods"]:
            cells = []
            for task in [*tasks, "all"]:
                r = next((r for r in sub if r["task"] == task and r["method"] == m), None)
                cells.append("" if r is None else f"{r['speedup']:.2f}x" + (
                    f" ({r['tau']:.2f})" if r["tau"] is not None else ""))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += ["", "Pooled over tasks:", "",
                  "| method | tokens/s | speedup | decode tokens/s | decode speedup | tau | target calls/token | "
                  "prefill time | draft time | verify time | turns differing from plain |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in sub if r["task"] == "all"):
            mism = "" if r["mismatched_turns"] is None else r["mismatched_turns"]
            dec = r.get("decode_speedup")
            lines.append(f"| {r['method']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | "
                         f"{_fmt(r.get('decode_tokens_per_s'))} | {'' if dec is None else f'{dec:.2f}x'} | "
                         f"{_fmt(r['tau'])} | {_fmt(r['target_calls_per_token'])} | "
                         f"{_pct(r.get('prefill_share'))} | {_pct(r['draft_share'])} | "
                         f"{_pct(r['verify_share'])} | {mism} |")
    if "sweep" in meta:
        sw = meta["sweep"]
        lines += ["", "## Tree sweep (T = 0, first turns)", "",
                  f"Plain: {sw['plain_tokens_per_s']} tokens/s.", "",
                  "| method | depth | top-k | tokens | tau | tokens/s | speedup |", "|---|---|---|---|---|---|---|"]
        for r in sw["rows"]:
            t = r["tree"]
            lines.append(f"| {r['method']} | {t['depth']} | {t['topk']} | {t['total_tokens']} | {r['tau']} | "
                         f"{r['tokens_per_s']} | {r['speedup']}x |")
    lines += ["", "Turns differing from plain must be 0 at T = 0 for this engine's methods (lossless "
              "verification); for transformers peers (fp32) they count answers that differ from ours by fp32 "
              "near-ties resolved the other way or, with our weights quantised, by those weights; llama.cpp "
              "(its own quantised weights, no token ids reported) is not compared.", ""]
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def plots(out: Path, meta: dict, rows: list[dict]) -> list[Path]:
    """Speedup per task and method, the accepted-length histogram, and tokens/s against tree size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for t in meta["config"]["temperatures"]:
        sub = [r for r in rows if r["temperature"] == t]
        tasks = list(dict.fromkeys(r["task"] for r in sub))
        methods = [m for m in meta["methods"] if m != "plain"]
        if not sub or not methods:
            continue
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(tasks) * max(1, len(methods)) / 3), 4))
        w = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ys = [next((r["speedup"] for r in sub if r["task"] == k and r["method"] == m), 0) for k in tasks]
            ax.bar([x + i * w for x in range(len(tasks))], ys, w, label=m)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([x + 0.4 - w / 2 for x in range(len(tasks))], tasks)
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(f"{meta['config']['model']}, T = {t:g}")
        ax.legend(fontsize=7, ncol=3)
        made.append(_save(fig, out / f"speedup_T{t:g}.png"))
    hist = [r for r in rows if r["task"] == "all" and r["temperature"] == 0 and r["accept_histogram"]
            and r["method"] != "plain"]
    if hist:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in hist:
            total = sum(r["accept_histogram"].values())
            xs = sorted(int(k) for k in r["accept_histogram"])
            ax.plot(xs, [r["accept_histogram"][k] / total for k in xs],
                    marker="o", label=f"{r['method']} (tau {r['tau']:.2f})")
        ax.set_xlabel("tokens per target call (accepted + 1)")
        ax.set_ylabel("share of target calls")
        ax.legend(fontsize=7)
        made.append(_save(fig, out / "tau_histogram.png"))
    if "sweep" in meta:
        fig, ax = plt.subplots(figsize=(6, 4))
        by: dict[str, list] = defaultdict(list)
        for r in meta["sweep"]["rows"]:
            by[r["method"]].append((r["tree"]["total_tokens"], r["tokens_per_s"]))
        for m, pts in by.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.axhline(meta["sweep"]["plain_tokens_per_s"], color="black", lw=0.8, label="plain")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("draft tokens verified per call (tree total_tokens)")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
        made.append(_save(fig, out / "tokens_per_s_vs_tree.png"))
    return made


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out: Path) -> Path:
    meta, answers = load(out)
    rows = aggregate(meta, answers)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    made = plots(out, meta, rows)
    text = markdown(meta, rows)
    if made:
        text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in made) + "\n"
    path = out / "report.md"
    path.write_text(text)
    return path
