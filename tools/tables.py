"""Rebuild the results tables of README.md and docs/results.md from the raw results committed under docs/raw/.

A generated table sits between `<!-- table: KIND ARG... -->` and `<!-- /table -->`; KIND names a builder below and
each ARG a run under docs/raw/ (a bench run's folder: meta.json + answers/, as `moaspec bench --out` writes them; a
study's JSON: `--out` of `experiments.footprint`, `experiments.multiturn`, `experiments.serving`). So every figure
in those tables can be rechecked from the per-answer records, and a rerun replaces a table by copying its run here.

    .venv/bin/python tools/tables.py           # rewrite the tables from docs/raw/
    .venv/bin/python tools/tables.py --check   # exit 1 naming every table that differs (make test runs this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "docs" / "raw"
DOCS = (ROOT / "README.md", ROOT / "docs" / "results.md")
BLOCK = re.compile(r"(<!-- table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
KS = ("1", "2", "4", "8", "16")


def _json(name: str) -> dict:
    path = RAW / name
    if not path.is_file():
        raise SystemExit(f"tools/tables.py: no raw results at {path.relative_to(ROOT)}")
    return json.loads(path.read_text())


def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def _pair(ours: dict, theirs: dict, key: str) -> str:
    return f"{ours[key]:.1f} / {theirs[key]:.1f} ({_x(ours[key], theirs[key])})"


# ------------------------------------------------------------------ experiments.footprint
def _sides(runs: tuple[str, ...]) -> list[tuple[str, dict, dict]]:
    """(file, our medians, llama.cpp's medians) of each footprint run."""
    return [(r["model"], r["median"]["moaspec"], r["median"]["llama.cpp"]) for r in map(_json, runs)]


def footprint(*runs: str) -> str:
    """Per file: load, peak RSS (llama.cpp mapped and --no-mmap), prefill and decode, ours / llama.cpp."""
    lines = ["| model (file) | load s | peak RSS MB: ours / llama.cpp mmap / no mmap (x mmap, x no mmap) | "
             "prefill tok/s | decode tok/s |", "|---|---|---|---|---|"]
    for model, o, ll in _sides(runs):
        rss, mapped, anon = o["peak_rss_mb"], ll["peak_rss_mb"], ll["peak_rss_no_mmap_mb"]
        lines.append(f"| {model} ({o['weights']}) | {o['load_s']:.1f} / {ll['load_s']:.1f} | "
                     f"{rss:.0f} / {mapped:.0f} / {anon:.0f} ({_x(rss, mapped)}, {_x(rss, anon)}) | "
                     f"{_pair(o, ll, 'prefill_tok_s')} | {_pair(o, ll, 'decode_tok_s')} |")
    return "\n".join(lines)


def passes(*runs: str) -> str:
    """A k-row pass as a multiple of the same side's 1-row pass (medians of the same number of timings)."""
    lines = ["| model | 1 row, ms | 2 rows | 4 | 8 | 16 |", "|---|---|---|---|---|---|"]
    for model, ours, theirs in _sides(runs):
        o, ll = ours["pass_ms"], theirs["pass_ms"]
        cells = [f"{o['1']:.1f} / {ll['1']:.1f}"] + [f"{o[k] / o['1']:.2f}x / {ll[k] / ll['1']:.2f}x" for k in KS[1:]]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(*runs: str) -> str:
    """The README's one-GGUF table: ratios to llama.cpp, with our figure."""
    lines = ["| one GGUF, here vs llama.cpp | peak RSS (x llama.cpp mmap / no mmap) | prefill, 512 tokens | "
             "decode after 512 tokens | 8-row pass / 1-row pass |", "|---|---|---|---|---|"]
    for model, o, ll in _sides(runs):
        p, q = o["pass_ms"], ll["pass_ms"]
        lines.append(f"| {model} | {_x(o['peak_rss_mb'], ll['peak_rss_mb'])} / "
                     f"{_x(o['peak_rss_mb'], ll['peak_rss_no_mmap_mb'])} ({o['peak_rss_mb'] / 1024:.2f} GB) | "
                     f"{_x(o['prefill_tok_s'], ll['prefill_tok_s'])} ({o['prefill_tok_s']:.0f} tok/s) | "
                     f"{_x(o['decode_tok_s'], ll['decode_tok_s'])} ({o['decode_tok_s']:.1f} tok/s) | "
                     f"{p['8'] / p['1']:.2f}x (llama.cpp {q['8'] / q['1']:.2f}x) |")
    return "\n".join(lines)


# ------------------------------------------------------------------ moaspec bench
def _bench(run: str) -> tuple[dict, dict[tuple[str, float], dict]]:
    from moaspec.bench.report import aggregate, load

    folder = RAW / run
    if not (folder / "meta.json").is_file():
        raise SystemExit(f"tools/tables.py: no bench run at {folder.relative_to(ROOT)}")
    meta, answers = load(folder)
    rows = {(r["method"], r["temperature"]): r for r in aggregate(meta, answers) if r["task"] == "all"}
    return meta, rows


def six_tasks(*runs: str) -> str:
    """Per bench run at T=0: our plain and suffix, llama.cpp's plain, the ratios, suffix's tau, turns differing."""
    lines = ["| model (weights; questions x tokens) | our plain tok/s | suffix (`--drafter auto`) tok/s | "
             "llama.cpp plain tok/s | plain x llama.cpp | suffix x llama.cpp | suffix tau | others x llama.cpp | "
             "turns differing from plain |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        meta, rows = _bench(run)
        cfg = meta["config"]
        plain, suffix, peer = rows[("plain", 0.0)], rows[("suffix", 0.0)], rows[("llama.cpp", 0.0)]
        others = ", ".join(f"{m} {_x(rows[(m, 0.0)]['tokens_per_s'], peer['tokens_per_s'])}" for m in meta["methods"]
                           if m not in ("plain", "suffix", "llama.cpp") and (m, 0.0) in rows)
        differ = sum(r["mismatched_turns"] or 0 for (m, t), r in rows.items() if t == 0)
        lines.append(f"| {cfg['model']} ({cfg['weights']}; {plain['questions']} x {cfg['max_new_tokens']}) | "
                     f"{plain['tokens_per_s']:.1f} | {suffix['tokens_per_s']:.1f} | {peer['tokens_per_s']:.1f} | "
                     f"{_x(plain['tokens_per_s'], peer['tokens_per_s'])} | "
                     f"**{_x(suffix['tokens_per_s'], peer['tokens_per_s'])}** | {suffix['tau']:.2f} | {others} | "
                     f"{differ} |")
    return "\n".join(lines)


def end_to_end(run: str, *methods: str) -> str:
    """The README's end-to-end rows of one bench run: tok/s x llama.cpp plain at T=0."""
    meta, rows = _bench(run)
    cfg = meta["config"]
    peer = rows[("llama.cpp", 0.0)]["tokens_per_s"]
    lines = [f"| {cfg['model']} ({cfg['weights']}), six tasks, {cfg['max_new_tokens']} tokens, T=0, prompt included, "
             f"every turn cold | tok/s x llama.cpp plain |", "|---|---|"]
    for m in methods:
        r = rows[(m, 0.0)]
        tau = f", tau {r['tau']:.2f}" if m != "plain" and r["tau"] else ""
        ratio = _x(r["tokens_per_s"], peer) if m == "plain" else f"**{_x(r['tokens_per_s'], peer)}**"
        label = "suffix (`--drafter auto`, the default)" if m == "suffix" else m
        lines.append(f"| {label} | {ratio} ({r['tokens_per_s']:.1f} tok/s{tau}) |")
    lines.append(f"| llama.cpp plain | 1.00x ({peer:.1f} tok/s) |")
    return "\n".join(lines)


# ------------------------------------------------------------------ experiments.multiturn / serving
def multiturn(run: str) -> str:
    r = _json(run)
    names = {"ours": "moaspec serve (prefix cache)", "llama-server": "llama-server (prompt cache)",
             "ours-cold": "moaspec serve `--cache-ram 0` (every turn cold)",
             "llama-server-cold": "llama-server `cache_prompt: false` (every turn cold)"}
    turns = len(next(iter(r.values())))
    lines = ["| time to first token, s (cached / prompt tokens) | " + " | ".join(f"turn {i + 1}" for i in range(turns))
             + " |", "|---|" + "---|" * turns]
    for name, rows in r.items():
        lines.append(f"| {names.get(name, name)} | " + " | ".join(
            f"{x['ttft_s']:.2f} ({'?' if x['cached_tokens'] is None else x['cached_tokens']} / {x['prompt_tokens']})"
            for x in rows) + " |")
    return "\n".join(lines)


def serving(run: str) -> str:
    rows = _json(run)
    lines = ["| server | clients | aggregate tok/s | x its 1 client | TPOT p50 / p99 ms | "
             "answers differing from lone |", "|---|---|---|---|---|---|"]
    base: dict[str, float] = {}
    for r in rows:
        base.setdefault(r["server"], r["aggregate_tok_s"]) if r["clients"] == 1 else None
        lines.append(f"| {r['server']} | {r['clients']} | {r['aggregate_tok_s']:.1f} | "
                     f"{_x(r['aggregate_tok_s'], base[r['server']])} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} | "
                     f"{r['differ_from_lone']} of {r['requests']} |")
    return "\n".join(lines)


BUILDERS: dict[str, Callable[..., str]] = {
    "footprint": footprint, "passes": passes, "headline": headline, "six-tasks": six_tasks,
    "end-to-end": end_to_end, "multiturn": multiturn, "serving": serving,
}


def rebuild(text: str) -> tuple[str, list[str]]:
    """The text with every generated table rebuilt, and the specs of the tables that changed."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        kind, *args = m["spec"].split()
        if kind not in BUILDERS:
            raise SystemExit(f"tools/tables.py: unknown table kind {kind!r}; known: {', '.join(BUILDERS)}")
        body = BUILDERS[kind](*args) + "\n"
        if body != m["body"]:
            changed.append(m["spec"])
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its run")
    a = ap.parse_args(argv)
    stale = []
    for doc in DOCS:
        new, changed = rebuild(doc.read_text())
        stale += [f"{doc.relative_to(ROOT)}: {spec}" for spec in changed]
        if changed and not a.check:
            doc.write_text(new)
    if stale:
        print(("differs from its raw results: " if a.check else "rebuilt: ") + "; ".join(stale))
    return 1 if stale and a.check else 0


if __name__ == "__main__":
    sys.exit(main())
