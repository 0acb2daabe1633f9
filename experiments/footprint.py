"""One GGUF here and in llama.cpp, side by side in one run: load time, peak resident memory, prefill tokens/s
at 512 tokens, plain decode tokens/s, and what a pass over k new rows costs (k = 1, 2, 4, 8, 16: the
verification of a k-token draft tree). Each side runs in its own process, so its peak memory is its own
(`wait4`); the rounds alternate the two sides.

    python -m experiments.footprint --model qwen2.5-coder-1.5b
    python -m experiments.footprint --model bench-out/shaped/qwen2.5-7b-Q4_K_M.gguf --rounds 1

Both sides decode after the 512-token prompt and run the k-row passes after 128 cached tokens, after a warm-up
pass. llama.cpp's figures are its own timers: `llama-bench` for prefill (pp512), decode (tg at depth 512) and the
k-row passes (ppK at depth 128: one batch of K tokens), `llama-completion` for load time and memory. The same
statistic on both sides: prefill and decode are measured once a round on each side, each k-row pass `--reps` times
a round (llama-bench `-r`) and its median taken; the table reports the median over the rounds.

Peak RSS is each process's high-water mark, file pages included. Our loader reads the file, repacks its tensors
into anonymous memory and drops the file's pages; llama.cpp by default maps the file (its clean pages count in its
RSS while resident, but the kernel may reclaim them) and repacks some tensors. So llama.cpp is measured twice:
as it runs by default (mmap) and without mmap (`--load-mode none`, the `--no-mmap` of earlier versions: the weights
read into anonymous memory, as ours are).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from moaspec import llamacpp

KS = (1, 2, 4, 8, 16)
CONTEXT = 128  # cached tokens before a k-row pass


def _child(model: str, weights: str, prompt: int, new: int, ks: tuple[int, ...], reps: int) -> dict:
    """This runtime's figures, measured inside the child process (load counted from before the import)."""
    t0 = time.perf_counter()
    import torch

    from moaspec.models.runtime import Transformer
    from moaspec.models.store import resolve

    folder = resolve(model, progress=False)
    m = Transformer(folder, weights=weights, max_seq_len=prompt + new + max(ks) + 136)
    load = time.perf_counter() - t0
    ids = torch.randint(100, 5000, (prompt,), generator=torch.Generator().manual_seed(0))
    m.warmup()
    m.reset()
    t = time.perf_counter()
    m.prefill(ids)
    prefill = prompt / (time.perf_counter() - t)
    tok = torch.tensor([101])
    t = time.perf_counter()
    for _ in range(new):
        tok = m.forward(tok).logits[-1].argmax()[None]
        m.advance(1)
    decode = new / (time.perf_counter() - t)
    costs = m.pass_costs(ks, context=CONTEXT, reps=reps, statistic=statistics.median)
    return {"weights": m.weights, "load_s": load, "prefill_tok_s": prefill, "decode_tok_s": decode,
            "pass_ms": {str(k): v for k, v in costs.items()}}


def _warm(path: Path) -> None:
    """Read the file once, so both sides start from a warm page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def ours(model: str, weights: str, prompt: int, new: int, ks: tuple[int, ...], reps: int) -> dict:
    cmd = [sys.executable, "-m", "experiments.footprint", "--child", "--model", model, "--weights", weights,
           "--prompt-tokens", str(prompt), "--new-tokens", str(new), "--ks", ",".join(map(str, ks)),
           "--reps", str(reps)]
    out, _, rss = _peak(cmd)
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_mb": rss}


def _peak(cmd: list[str]) -> tuple[str, str, float]:
    """Like `_run`, reading the child's peak memory with wait4 (Popen would reap it first)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read()))
               for s, b in ((p.stdout, out), (p.stderr, err))]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(p.pid, 0)
    for r in readers:
        r.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({p.returncode}): {''.join(err)[-1500:]}")
    return "".join(out), "".join(err), usage.ru_maxrss / 1024


def llama(gguf: Path, prompt: int, new: int, ks: tuple[int, ...], threads: int, reps: int) -> dict:
    """llama.cpp's figures at the depths ours are measured at: prefill from an empty cache, decode after the
    prompt, k-row passes after `CONTEXT` tokens (the median of `reps` timings, as ours)."""
    def bench(r: int, *args: str) -> list[dict]:
        out, _, _ = _peak([str(llamacpp.bin_dir() / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", str(r),
                           "-o", "json", *args])
        return json.loads(out)

    pp, = bench(1, "-p", str(prompt), "-n", "0")
    tg, = bench(1, "-p", "0", "-n", str(new), "-d", str(prompt))
    rows = {r["n_prompt"]: statistics.median(ns / 1e6 for ns in r["samples_ns"])
            for r in bench(reps, "-p", ",".join(map(str, ks)), "-n", "0", "-d", str(CONTEXT))}

    def completion(*extra: str) -> tuple[str, float]:
        _, err, rss = _peak([str(llamacpp.bin_dir() / llamacpp.PLAIN), "-m", str(gguf), "-p", "Hello", "-n", "16",
                             "-t", str(threads), "-c", str(prompt + new + 64), "--temp", "0", "-no-cnv",
                             "--no-display-prompt", "--simple-io", *extra])
        return err, rss

    err, rss = completion()
    _, rss_no_mmap = completion("--load-mode", "none")  # this version's --no-mmap
    load = re.search(r"load time =\s*([\d.]+) ms", err)
    return {"weights": "file", "load_s": float(load.group(1)) / 1e3 if load else float("nan"),
            "prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"],
            "pass_ms": {str(k): rows[k] for k in ks}, "peak_rss_mb": rss, "peak_rss_no_mmap_mb": rss_no_mmap}


def summarise(runs: dict[str, list[dict]], ks: tuple[int, ...]) -> dict[str, dict]:
    """Each side's medians over the rounds."""
    table = {}
    for side, rs in runs.items():
        if not rs:
            continue
        keys = ["load_s", "peak_rss_mb", "prefill_tok_s", "decode_tok_s"] + \
            (["peak_rss_no_mmap_mb"] if "peak_rss_no_mmap_mb" in rs[0] else [])
        med = {key: statistics.median(r[key] for r in rs) for key in keys}
        med["pass_ms"] = {k: statistics.median(r["pass_ms"][str(k)] for r in rs) for k in ks}
        med["weights"] = rs[0]["weights"]
        table[side] = med
    return table


def markdown(table: dict[str, dict], ks: tuple[int, ...], prompt: int) -> str:
    """The side-by-side table (and each side's k-row pass over its 1-row pass)."""
    lines = [f"| | weights | load s | peak RSS MB | prefill tok/s ({prompt}) | decode tok/s | "
             + " | ".join(f"{k} rows ms" for k in ks) + " |", "|---|---|---|---|---|---|" + "---|" * len(ks)]
    for side, m in table.items():
        lines.append(f"| {side} | {m['weights']} | {m['load_s']:.1f} | {m['peak_rss_mb']:.0f} | "
                     f"{m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.1f} | "
                     + " | ".join(f"{m['pass_ms'][k]:.1f}" for k in ks) + " |")
        if "peak_rss_no_mmap_mb" in m:
            lines.append(f"| {side} without mmap | | | {m['peak_rss_no_mmap_mb']:.0f} | | |" + " |" * len(ks))
    if len(table) == 2:
        o, ll = table["moaspec"], table["llama.cpp"]
        lines.append(f"| ours / llama.cpp | | {o['load_s'] / ll['load_s']:.2f}x | "
                     f"{o['peak_rss_mb'] / ll['peak_rss_mb']:.2f}x (without mmap: "
                     f"{o['peak_rss_mb'] / ll.get('peak_rss_no_mmap_mb', float('nan')):.2f}x) | "
                     f"{o['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x | "
                     f"{o['decode_tok_s'] / ll['decode_tok_s']:.2f}x | "
                     + " | ".join(f"{o['pass_ms'][k] / ll['pass_ms'][k]:.2f}x" for k in ks) + " |")
        for side, m in table.items():
            lines.append(f"{side}: k-row pass / 1 row: " + ", ".join(f"{k}: {m['pass_ms'][k] / m['pass_ms'][1]:.2f}x"
                                                                      for k in ks))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a known model name or a .gguf file")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="timings of each k-row pass a round, on each side")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    ks = tuple(int(k) for k in a.ks.split(","))
    if a.child:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(_child(a.model, a.weights, a.prompt_tokens, a.new_tokens, ks, a.reps)))
        return 0
    from moaspec.models.store import MODELS, gguf_file, resolve

    gguf = gguf_file(a.model) if a.model in MODELS else Path(a.model)
    resolve(a.model)  # described before timing: a first run's metadata is not the load time measured
    _warm(gguf)
    runs: dict[str, list[dict]] = {"moaspec": [], "llama.cpp": []}
    for _ in range(a.rounds):
        runs["moaspec"].append(ours(a.model, a.weights, a.prompt_tokens, a.new_tokens, ks, a.reps))
        if not llamacpp.missing(("llama-bench", llamacpp.PLAIN)):
            runs["llama.cpp"].append(llama(gguf, a.prompt_tokens, a.new_tokens, ks, a.threads, a.reps))
    table = summarise(runs, ks)
    print(f"\n{gguf.name}, {a.threads} threads, {a.rounds} rounds: medians (k-row passes: of {a.reps} a round)")
    print(markdown(table, ks, a.prompt_tokens))
    if a.out:
        Path(a.out).write_text(json.dumps({"model": gguf.name, "threads": a.threads, "rounds": a.rounds, "reps": a.reps,
                                           "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "ks": ks,
                                           "runs": runs, "median": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
