"""`moaspec bench`: the paper's table on this machine (`bench.suite`)."""

from __future__ import annotations

import argparse
import sys

from moaspec.cli.options import WEIGHTS_HELP, add_threads_arg, check_model_name, csv
from moaspec.errors import UserError
from moaspec.models.linear import WEIGHT_CHOICES


def add_parsers(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="the paper's table on this machine: tau, tokens/s and speedup per task and "
                       "method, interleaved per question, with peers",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--model", default="qwen2.5-coder-0.5b")
    b.add_argument("--methods", default="", help="comma-separated among plain, hf, hf-assisted, llama.cpp, "
                   "llama.cpp-spec, llama.cpp-lookup, lookup, suffix, suffix-nostore (no datastore), model, "
                   "independent, eagle, moa, moa-n1, moa-n3, hybrid, hybrid-merge; default: plain, "
                   "the peers (llama.cpp where `make llama-cpp` built it) and every drafter with a checkpoint")
    b.add_argument("--tasks", default="", help="comma-separated task sets; default: all")
    b.add_argument("--questions", type=int, default=None, help="questions per task (default: the whole set)")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--temperatures", default="0,1", help="comma-separated; T=0 answers are checked token-identical "
                   "to plain decoding")
    b.add_argument("--tree", default="auto", help="auto (calibrated to this machine), sweep (measure a grid, use the "
                   "best per method), adaptive[:max depth] (chain length chosen per call) or depth,topk,total; "
                   "all but sweep take @P for a confidence stop at path probability P (--min-prob)")
    b.add_argument("--checkpoints", metavar="DIR", help="folder of <method>/ drafter checkpoints (default: shipped)")
    b.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)
    add_threads_arg(b)
    b.add_argument("--out", default="bench-out", help="answer files, report.md, results.json and plots; "
                   "a rerun resumes")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--quick", action="store_true", help="1 question per task, 64 tokens, T=0: minutes")
    b.add_argument("--deterministic-drafts", action="store_true",
                   help="at T > 0, top-k drafts instead of drafts sampled from the drafter's distribution")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from moaspec.bench.suite import BenchConfig, run

    check_model_name(args.model)
    try:
        temps = tuple(float(t) for t in csv(args.temperatures))
    except ValueError:
        raise UserError(f"--temperatures must be numbers like 0,1; got {args.temperatures!r}") from None
    kw = dict(model=args.model, methods=csv(args.methods), tasks=csv(args.tasks), tree=args.tree,
              checkpoints=args.checkpoints, weights=args.weights, out=args.out, seed=args.seed,
              sampled_drafts=not args.deterministic_drafts)
    if args.quick:
        cfg = BenchConfig.quick(**kw)
    else:
        cfg = BenchConfig(questions=args.questions, max_new_tokens=args.max_new_tokens, temperatures=temps, **kw)
    path = run(cfg)
    print(path.read_text())
    print(f"report: {path}", file=sys.stderr)
    return 0
