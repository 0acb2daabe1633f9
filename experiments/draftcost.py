"""What a draft step costs against a target step, and where the time goes.

    python -m experiments.draftcost                                  # Qwen2.5-Coder-0.5B fp16: MoA, EAGLE-2
    python -m experiments.draftcost --model smollm2-135m --drafters moa --rounds 21 --out cost.json

For a target and trained drafters (the shipped checkpoints, or `--checkpoints DIR` with <label>/ folders)
after a prompt of `--context` tokens, it measures:

- the target: one-row decode step, a pass over 2..4 rows (what verifying a chain costs), a prefill;
- each drafter: one draft step (a chain one token longer), the first step of a round (the root after
  1 or 4 committed tokens: the drafter's own pass over them, then the root's prediction), the intake of
  one verified token's context, and the target-side encoder (`drafter.encoder.encode`) for 1..4 newly
  verified tokens and for the prefill, each against what the target spends on the same tokens;
- for MoA, a breakdown by part with timers around the parts (Self-Attention, Cross-Attention, the TLI
  layers, the LM head, the Layer Self-Attention, the projection); the rest ("other") is the log-softmax,
  the tree search (top-k, tree bookkeeping), masks, embedding lookups and Python;
- the weight bytes a MoA draft step streams against the target step's: on a CPU both are memory-bound,
  so their ratio is about the floor of the step ratio.

Every measurement runs once per round, all interleaved, so that drift and other load hit them alike,
and each right after a target step, as in decoding (the caches then hold the target's weights); each
is the median over the rounds (the first two are warm-up). Run it single-threaded on a shared
machine (`OMP_NUM_THREADS=1`; `--threads`) and compare ratios, not milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moaspec.decoding.tree import TreeConfig
from moaspec.drafters import SPECS, TRAINED, drafter_kind, shipped_checkpoint
from moaspec.models.linear import WEIGHT_MODES
from moaspec.models.runtime import Transformer

STEPS = 4  # a draft step is timed as (chain of 1 + STEPS tokens - chain of 1 token) / STEPS
PENDING = (1, 4)  # rows of the drafter's own pass in a round's first step: the root after 0 and 3 accepted
VERIFIED = (1, 2, 3, 4)  # newly verified tokens per encoder call
WARMUP = 2


def _median(xs: list[float]) -> float:
    return statistics.median(xs[WARMUP:] if len(xs) > WARMUP else xs) * 1e3


class Parts:
    """Timers around named callables of a drafter, installed only while `active`."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}
        self.active = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.calls.setdefault(name, []).append(time.perf_counter() - t)
            return out

        return timed

    def run(self, fn: Callable[[], Any]) -> tuple[float, dict[str, list[float]]]:
        """Run fn with the timers on: (its seconds, part -> seconds of each call in call order)."""
        self.calls, self.active = {}, True
        t = time.perf_counter()
        try:
            fn()
        finally:
            self.active = False
        return time.perf_counter() - t, self.calls


def _instrument_moa(drafter: Any, parts: Parts) -> None:
    """Timers around the parts of a MoA drafter's inference path (instance attributes, so nothing else
    is touched)."""
    drafter.sa.infer = parts.wrap("SA", drafter.sa.infer)
    drafter.ca.infer = parts.wrap("CA", drafter.ca.infer)
    drafter.ca.context_kv_infer = parts.wrap("CA context K/V", drafter.ca.context_kv_infer)
    drafter.tli = [parts.wrap("TLI", layer) for layer in drafter.tli]
    drafter._fast_head = parts.wrap("LM head", drafter._fast_head)
    enc = drafter.encoder
    enc.lsa.infer = parts.wrap("LSA", enc.lsa.infer)
    kernel = enc.proj.kernel
    enc.proj.kernel = lambda: parts.wrap("projection", kernel())


def _moa_step_bytes(drafter: Any) -> int:
    """Weight bytes one MoA draft step reads: SA, CA (queries and tail), the TLI layers, the LM head."""
    sa, ca = drafter.sa.kernels(), drafter.ca.kernels()
    lins = [sa.qkv, sa.o, sa.gate_up, sa.down, ca.q, ca.o, ca.gate_up, ca.down, drafter._fast_head]
    for layer in drafter.tli:
        lins += layer.layer.linears()
    return sum(lin.nbytes() for lin in lins)


def _target_step_bytes(target: Transformer) -> int:
    return target.lm_head.nbytes() + sum(
        lin.nbytes() for layer in target.layers for lin in layer.linears())


class Bench:
    def __init__(self, model: str, weights: str, context: int, labels: list[str], checkpoints: str | None):
        from moaspec.models.store import resolve, weights_fingerprint

        folder = resolve(model)
        self.model, self.context = model, context
        self.target = Transformer(folder, weights=weights, max_seq_len=context + 64)
        fingerprint = weights_fingerprint(folder)
        gen = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(100, 5000, (context,), generator=gen).tolist()
        self.drafters: dict[str, Any] = {}
        for label in labels:
            kind = drafter_kind(label)
            if kind not in TRAINED:
                raise SystemExit(f"{label}: draftcost measures trained drafters ({', '.join(TRAINED)})")
            path = Path(checkpoints) / label if checkpoints else shipped_checkpoint(label, model)
            self.drafters[label] = SPECS[kind].load(path, self.target, model, fingerprint)
        hidden = tuple(sorted({h for d in self.drafters.values() if d.encoder for h in d.encoder.hidden_layers}))
        self.target.reset()
        out = self.target.prefill(self.prompt, hidden_layers=hidden)
        self.hidden = out.hidden  # the prompt's hidden states, for encoders that read them (EAGLE)
        self.parts = Parts()
        self.states: dict[tuple[str, int], dict[str, int]] = {}
        self.step_bytes: dict[str, int] = {}
        for label, d in self.drafters.items():
            if hasattr(d, "sa") and hasattr(d, "ca"):
                self.step_bytes[label] = _moa_step_bytes(d)
                _instrument_moa(d, self.parts)
            for pending in PENDING:
                self.states[label, pending] = self._steady_state(d, pending)

    # ------------------------------------------------------------------ set-up
    def _context(self, d: Any, first: int, n: int) -> Any:
        if d.encoder is None:  # a drafter that reads no target state (independent)
            return None
        slots = torch.arange(first, first + n)
        return d.encoder.encode(self.target.cache, slots, {k: v[first:first + n] for k, v in self.hidden.items()})

    def _steady_state(self, d: Any, pending: int) -> dict[str, int]:
        """Bring drafter d to where a round starts with `pending` rows for its own pass (the tokens
        accepted in the last round + the root), the whole prompt verified; return its counters."""
        P, cut = self.context, self.context - pending
        d.begin(self.prompt[:cut], self._context(d, 0, cut))
        d.propose(self.prompt[cut], TreeConfig(1, 1, 1))  # its pass up to the last round's root
        d.observe(self.prompt[cut:], self._context(d, cut, P - cut))
        return self._counters(d)

    @staticmethod
    def _counters(d: Any) -> dict[str, int]:
        """A drafter's int-valued bookkeeping (cache fill levels): propose/observe move nothing else."""
        return {k: v for k, v in vars(d).items() if type(v) is int}

    def _rewind(self, d: Any, state: dict[str, int]) -> None:
        for k, v in state.items():
            setattr(d, k, v)
        del d.tokens[self.context:]

    # ------------------------------------------------------------------ measurements
    def _propose(self, label: str, pending: int, depth: int) -> Callable[[], Any]:
        d, state = self.drafters[label], self.states[label, pending]
        root = self.prompt[-1]

        def fn() -> Any:
            self._rewind(d, state)
            return d.propose(root, TreeConfig(depth, 1, depth))

        return fn

    def _intake(self, label: str, n: int) -> Callable[[], Any]:
        d, state = self.drafters[label], self.states[label, 1]
        ctx = self._context(d, self.context - n, n)

        def fn() -> None:
            self._rewind(d, state)
            d.observe([], ctx)

        return fn

    def _encode(self, label: str, n: int) -> Callable[[], Any]:
        d = self.drafters[label]
        slots = torch.arange(self.context - n, self.context)
        hidden = {k: v[-n:] for k, v in self.hidden.items()}
        return lambda: d.encoder.encode(self.target.cache, slots, hidden)

    def _target_pass(self, n: int) -> Callable[[], Any]:
        toks = torch.full((n,), 100, dtype=torch.long)
        return lambda: self.target.forward(toks)  # not committed: the cache keeps the prompt

    def measure(self, rounds: int, prefill_rounds: int) -> dict:
        fns: dict[str, Callable[[], Any]] = {f"target pass {n}": self._target_pass(n) for n in VERIFIED[1:]}
        for label in self.drafters:
            for pending in PENDING:
                fns[f"{label} first {pending}"] = self._propose(label, pending, 1)
            fns[f"{label} chain {1 + STEPS}"] = self._propose(label, 1, 1 + STEPS)
            fns[f"{label} intake 1"] = self._intake(label, 1)
            if self.drafters[label].encoder is not None:
                for n in VERIFIED:
                    fns[f"{label} encode {n}"] = self._encode(label, n)
        times: dict[str, list[float]] = {k: [] for k in ["target pass 1", *fns]}
        step = self._target_pass(1)
        for _ in range(rounds):
            for k, fn in fns.items():
                # every measurement right after a target step, as in decoding: its caches hold the target's
                # weights, not the drafter's (and the target step is timed once per measurement)
                for name, f in (("target pass 1", step), (k, fn)):
                    t = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t)
        ms = {k: _median(v) for k, v in times.items()}

        # prefill: few rounds (a prefill costs ~30 target steps), the encoder interleaved with it
        slow = {"target prefill": self._prefill}
        slow.update({f"{label} encode prefill": self._encode(label, self.context)
                     for label, d in self.drafters.items() if d.encoder is not None})
        slow_times: dict[str, list[float]] = {k: [] for k in slow}
        for _ in range(prefill_rounds + 1):
            for k, fn in slow.items():
                t = time.perf_counter()
                fn()
                slow_times[k].append(time.perf_counter() - t)
        ms.update({k: statistics.median(v[1:]) * 1e3 for k, v in slow_times.items()})

        step = ms["target pass 1"]
        result: dict = {"target": {"step_ms": step, **{f"pass_{n}_ms": ms[f"target pass {n}"] for n in VERIFIED},
                                   "prefill_ms": ms["target prefill"],
                                   "weight_mb_per_step": _target_step_bytes(self.target) / 1e6},
                        "drafters": {}}
        for label, d in self.drafters.items():
            draft_step = (ms[f"{label} chain {1 + STEPS}"] - ms[f"{label} first 1"]) / STEPS
            r = {"step_ms": draft_step, "step_x_target": draft_step / step,
                 **{f"first_{p}_ms": ms[f"{label} first {p}"] for p in PENDING},
                 **{f"first_{p}_x_target": ms[f"{label} first {p}"] / step for p in PENDING},
                 "intake_1_ms": ms[f"{label} intake 1"], "intake_1_x_target": ms[f"{label} intake 1"] / step}
            if d.encoder is not None:
                r.update({f"encode_{n}_ms": ms[f"{label} encode {n}"] for n in VERIFIED})
                r.update({f"encode_{n}_x_pass": ms[f"{label} encode {n}"] / ms[f"target pass {n}"] for n in VERIFIED})
                r["encode_prefill_ms"] = ms[f"{label} encode prefill"]
                r["encode_prefill_x_prefill"] = ms[f"{label} encode prefill"] / ms["target prefill"]
            if hasattr(d, "sa") and hasattr(d, "ca"):
                r["weight_mb_per_step"] = self.step_bytes[label] / 1e6
                r["breakdown"] = self._breakdown(label, rounds, prefill_rounds)
            result["drafters"][label] = r
        return result

    def _prefill(self) -> None:
        self.target.reset()
        self.target.prefill(self.prompt)

    def _breakdown(self, label: str, rounds: int, prefill_rounds: int) -> dict[str, dict[str, float]]:
        """ms per part of: a draft step, a first step (1 and 4 rows), the intake of a token, the encoder
        for 1 and 4 verified tokens and for the prefill; `other` is the rest of each total."""
        runs: dict[str, tuple[Callable[[], Any], int]] = {
            "first 1": (self._propose(label, 1, 1), rounds), "first 4": (self._propose(label, 4, 1), rounds),
            "chain": (self._propose(label, 1, 1 + STEPS), rounds), "intake 1": (self._intake(label, 1), rounds),
            "encode 1": (self._encode(label, 1), rounds), "encode 4": (self._encode(label, 4), rounds),
            "encode prefill": (self._encode(label, self.context), prefill_rounds + WARMUP),
        }
        per: dict[str, dict[str, list[float]]] = {k: {} for k in [*runs, "step"]}
        flush = self._target_pass(1)
        for i in range(max(n for _, n in runs.values())):
            first_total = None
            for name, (fn, n) in runs.items():
                if i >= n:
                    continue
                flush()  # as in `measure`: each run right after a target step
                total, calls = self.parts.run(fn)
                if name == "chain":  # the root's call of each part belongs to the first step
                    steps = {part: sum(c[1:]) / STEPS for part, c in calls.items()}
                    if first_total is not None:
                        steps["total"] = (total - first_total) / STEPS
                        for part, v in steps.items():
                            per["step"].setdefault(part, []).append(v)
                    continue
                if name == "first 1":
                    first_total = total
                for part, c in {**calls, "total": [total]}.items():
                    per[name].setdefault(part, []).append(sum(c))
        out = {}
        for name, parts in per.items():
            if "total" not in parts:
                continue
            med = {part: _median(v) for part, v in parts.items()}
            med["other"] = med["total"] - sum(v for part, v in med.items() if part != "total")
            out[name] = med
        return out


# ----------------------------------------------------------------------------- report
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def table(result: dict) -> str:
    t, lines = result["target"], []
    lines.append(f"{result['model']} ({result['weights']} weights), context {result['context']} tokens, "
                 f"{result['threads']} thread(s), median of {result['rounds'] - WARMUP} interleaved rounds")
    lines.append(f"target: decode step {t['step_ms']:.2f} ms ({t['weight_mb_per_step']:.0f} MB of weights); "
                 + ", ".join(f"{n}-row pass {t[f'pass_{n}_ms']:.2f} ms" for n in VERIFIED[1:])
                 + f"; prefill of {result['context']} tokens {t['prefill_ms']:.0f} ms")
    lines += ["", "| drafter | draft step | x target step | weights per step | first step, 1 row | "
                  "first step, 4 rows | context intake, 1 token |", "|---|---|---|---|---|---|---|"]
    for label, r in result["drafters"].items():
        mb = r.get("weight_mb_per_step")
        floor = f"{mb:.1f} MB ({_pct(mb / t['weight_mb_per_step'])})" if mb else "-"
        lines.append(f"| {label} | {r['step_ms']:.2f} ms | {_pct(r['step_x_target'])} | {floor} | "
                     f"{r['first_1_ms']:.2f} ms ({_pct(r['first_1_x_target'])}) | "
                     f"{r['first_4_ms']:.2f} ms ({_pct(r['first_4_x_target'])}) | "
                     f"{r['intake_1_ms']:.2f} ms ({_pct(r['intake_1_x_target'])}) |")
    lines += ["", "Target-side encoder per call, against the target pass over the same tokens:", "",
              "| drafter | " + " | ".join(f"{n} verified" for n in VERIFIED) + f" | prefill {result['context']} |",
              "|---|" + "---|" * (len(VERIFIED) + 1)]
    for label, r in result["drafters"].items():
        if "encode_prefill_ms" not in r:
            continue  # no target-side encoder
        cells = [f"{r[f'encode_{n}_ms']:.2f} ms ({_pct(r[f'encode_{n}_x_pass'])})" for n in VERIFIED]
        cells.append(f"{r['encode_prefill_ms']:.1f} ms ({_pct(r['encode_prefill_x_prefill'])})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, r in result["drafters"].items():
        b = r.get("breakdown")
        if not b:
            continue
        cols = [c for c in ("step", "first 1", "first 4", "intake 1", "encode 1", "encode 4", "encode prefill")
                if c in b]
        names = {"step": "draft step", "first 1": "first step, 1 row", "first 4": "first step, 4 rows",
                 "intake 1": "intake, 1 token", "encode 1": "encoder, 1 token", "encode 4": "encoder, 4 tokens",
                 "encode prefill": f"encoder, prefill {result['context']}"}
        parts = [p for p in ("SA", "CA", "TLI", "LM head", "CA context K/V", "LSA", "projection", "other")
                 if any(p in b[c] for c in cols)]
        lines += ["", f"{label}: ms per part (share of the column's total)", "",
                  "| part | " + " | ".join(names[c] for c in cols) + " |", "|---|" + "---|" * len(cols)]
        for p in [*parts, "total"]:
            cells = []
            for c in cols:
                v = b[c].get(p)
                share = "" if p == "total" or v is None else f" ({_pct(v / b[c]['total'])})"
                cells.append("" if v is None else f"{v:.3f}{share}")
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--weights", default="fp16", choices=WEIGHT_MODES)
    ap.add_argument("--drafters", default="moa,eagle",
                    help="checkpoint labels (moa, moa-n1, moa-n3, eagle, independent): shipped, or under --checkpoints")
    ap.add_argument("--checkpoints", default=None,
                    help="a folder with <label>/ checkpoints (default: the shipped ones)")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens before the measured steps")
    ap.add_argument("--rounds", type=int, default=17)
    ap.add_argument("--prefill-rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS or torch's)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.threads:
        torch.set_num_threads(a.threads)
    bench = Bench(a.model, a.weights, a.context, a.drafters.split(","), a.checkpoints)
    result = {"model": a.model, "weights": a.weights, "context": a.context, "threads": torch.get_num_threads(),
              "rounds": a.rounds, **bench.measure(a.rounds, a.prefill_rounds)}
    print(table(result), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
