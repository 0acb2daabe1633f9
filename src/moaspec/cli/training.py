"""`moaspec data`, `train`, `export` and `datastore`: the drafters' training data, training, and what ships."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moaspec.cli.options import EXIT_INTERRUPT, check_model_name, csv
from moaspec.errors import UserError
from moaspec.models.linear import WEIGHT_MODES
from moaspec.models.store import DEFAULT_MODEL, MODELS
from moaspec.training.data import ENGINES as DATA_ENGINES


def add_parsers(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("data", help="training data: the target's answers to diverse prompts, and package text",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--model", default=DEFAULT_MODEL)
    d.add_argument("--tokens", type=int, default=1_000_000, help="distinct tokens to reach, both sources")
    d.add_argument("--text-fraction", type=float, default=0.5,
                   help="share of the tokens from existing code and documentation (no generation needed)")
    d.add_argument("--self-chat", type=float, default=0.0, metavar="FRACTION",
                   help="share of the generated tokens from self-chat: the target writes the requests too "
                        "(one or two turns), instead of answering template and file prompts")
    d.add_argument("--prompts", type=int, default=30_000, help="size of the prompt pool generation draws from")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-new-tokens", type=int, default=1024)
    d.add_argument("--engine", default="auto", choices=DATA_ENGINES,
                   help="what writes the answers: llama.cpp's batched server (`make llama-cpp`) where built; "
                        "moaspec: this runtime, batched, in the --weights mode the drafter will serve")
    d.add_argument("--weights", default="fp16", choices=WEIGHT_MODES, help="--engine moaspec: the weight mode")
    d.add_argument("--features", action="store_true",
                   help="--engine moaspec: also store the target's features of each answer, from the passes that "
                        "wrote it (training then reads them: `moaspec train --target-weights` the same mode)")
    d.add_argument("--parallel", type=int, default=8, help="answers decoded together")
    d.add_argument("--threads", type=int, default=1)
    d.add_argument("--out", default="data", help="data sets go to OUT/<model>-v<version>-seed<seed>/")
    d.add_argument("--time-budget", type=float, default=None, metavar="MIN",
                   help="stop after this many minutes; run again to resume")
    d.set_defaults(func=cmd_data)

    tr = sub.add_parser("train", help="train a drafter (MoA, EAGLE-2, independent) for a target",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tr.add_argument("--model", default=DEFAULT_MODEL)
    tr.add_argument("--data", required=True, help="a data folder written by `moaspec data`")
    tr.add_argument("--out", required=True, help="run folder: checkpoints, trainer state (resumes), history")
    tr.add_argument("--kind", default="moa",
                    help="drafter(s) to train, comma-separated among moa, eagle, independent; several train "
                         "side by side on one target pass per sequence (same data, steps and budget)")
    tr.add_argument("--target-weights", default="fp32", choices=WEIGHT_MODES,
                    help="the target mode whose features the drafters learn from (fp32: the exact model; the served "
                         "mode reads the features `moaspec data --features` stored)")
    tr.add_argument("--tli", default="0", help="MoA Target Layer Inference N; e.g. 0,1,3 trains one MoA per N")
    tr.add_argument("--every", default="6-14", metavar="MIN-MAX",
                    help="MoA: a verified slot every MIN..MAX tokens (drawn per sequence), so that it learns to "
                         "draft 1..MAX steps ahead (the paper: 6-14)")
    tr.add_argument("--query-state", action="store_true",
                    help="MoA's query rows also read the target's final state of the last verified token, as "
                         "EAGLE-2 does (not in the paper; --init from a paper MoA starts it as that drafter)")
    tr.add_argument("--vocab", type=int, default=16384, help="trimmed drafter head size K (0 = full)")
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument("--epochs", type=float, default=0.0, help="if > 0: passes over the data (sets --steps)")
    tr.add_argument("--data-tokens", type=int, default=0,
                    help="train on a seeded subset of about this many tokens (0 = all): points of a learning curve")
    tr.add_argument("--answers-only", action="store_true",
                    help="train on the target's own answers in the data only, not on package text")
    tr.add_argument("--no-feature-cache", action="store_true",
                    help="run the target for every step instead of caching its features on disk")
    tr.add_argument("--batch-size", type=int, default=4,
                    help="sequences per step, shared among the processes of a data-parallel launch "
                         "(torchrun --nproc-per-node N -m moaspec train ...)")
    tr.add_argument("--max-len", type=int, default=1024)
    tr.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast for the drafters)")
    tr.add_argument("--lr", type=float, default=6e-4)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--val-every", type=int, default=100)
    tr.add_argument("--init", default="",
                    help="fine-tune: start each drafter from INIT/<label> (a run, a curve point, or checkpoints "
                         "such as src/moaspec/checkpoints/<model>)")
    tr.set_defaults(func=cmd_train)

    e = sub.add_parser("export", help="copy a finished training run's drafters as fp16 checkpoints "
                       "(default: into the package, where --drafter KIND finds them)")
    e.add_argument("run", help="the --out folder of `moaspec train`, or a learning curve's points/<budget> folder")
    e.add_argument("--to", metavar="DIR", help="write DIR/<label>/ instead (label: moa, moa-n1, eagle, ...)")
    e.set_defaults(func=cmd_export)

    ds = sub.add_parser("datastore", help="build the suffix drafter's datastore from the answers in a data folder "
                        "(default: into the package, where --drafter suffix finds it)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ds.add_argument("--model", default=DEFAULT_MODEL)
    ds.add_argument("--data", required=True, help="a data folder written by `moaspec data` for --model")
    ds.add_argument("--sources", default="gen", help="comma-separated among gen (the target's answers), self "
                    "(self-chat) and text (package code and docs)")
    ds.add_argument("--to", metavar="DIR", help="write DIR instead of the package's checkpoints/<model>/datastore")
    ds.set_defaults(func=cmd_datastore)


def cmd_data(args: argparse.Namespace) -> int:
    from moaspec.training.data import Builder, DataConfig

    check_model_name(args.model)
    cfg = DataConfig(model=args.model, tokens=args.tokens, text_fraction=args.text_fraction,
                     self_fraction=args.self_chat, prompts=args.prompts,
                     seed=args.seed, max_new_tokens=args.max_new_tokens, engine=args.engine, parallel=args.parallel,
                     threads=args.threads, weights=args.weights, features=args.features)
    budget = None if args.time_budget is None else args.time_budget * 60
    manifest = Builder(cfg, Path(args.out)).run(budget)
    print(json.dumps(manifest, indent=1))
    if manifest["stopped"]:
        print(f"stopped by signal after the current round, written to {args.out}: the same command resumes",
              file=sys.stderr)
        return EXIT_INTERRUPT
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from moaspec.training.train import TrainConfig, Trainer

    check_model_name(args.model)
    try:
        every = [int(x) for x in args.every.split("-")]
        every = every * 2 if len(every) == 1 else every
        if len(every) != 2:
            raise ValueError
    except ValueError:
        raise UserError(f"--every takes MIN-MAX (two integers, e.g. 1-4) or one integer, not {args.every!r}") from None
    cfg = TrainConfig(model=args.model, data=args.data, out=args.out, kind=args.kind, tli_layers=args.tli,
                      vocab_ids=args.vocab, steps=args.steps, epochs=args.epochs, data_tokens=args.data_tokens,
                      answers_only=args.answers_only, every_min=every[0], every_max=every[1],
                      query_state=args.query_state,
                      feature_cache=not args.no_feature_cache, batch_size=args.batch_size, max_len=args.max_len,
                      lr=args.lr, seed=args.seed, val_every=args.val_every, device=args.device, init=args.init,
                      target_weights=args.target_weights)
    result = Trainer(cfg).run()
    print(json.dumps(result))
    return EXIT_INTERRUPT if result["stopped"] else 0


def cmd_export(args: argparse.Namespace) -> int:
    from moaspec.training.train import export

    for path in export(args.run, args.to):
        print(path)
    return 0


def cmd_datastore(args: argparse.Namespace) -> int:
    from moaspec.drafters import shipped_checkpoint
    from moaspec.drafters.datastore import Datastore
    from moaspec.training.data import answers

    check_model_name(args.model)
    if args.to is None and args.model not in MODELS:
        raise UserError(f"--model {args.model} is not a known model name: pass --to DIR for its datastore")
    sources = csv(args.sources)
    store = Datastore.from_sequences(answers(args.data, args.model, sources), args.model)
    folder = store.save(args.to or shipped_checkpoint("datastore", args.model),
                        {"data": Path(args.data).name, "sources": list(sources)})
    print(f"{folder}: {len(store):,} tokens")
    return 0
