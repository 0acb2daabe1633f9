"""The option groups several commands share (model and drafter, draft tree, sampling, threads) and the checks
that run on them before any model loads, so that a mistake fails at once."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys
from pathlib import Path
from typing import Any

from moaspec.decoding.context import WIRE_DTYPES
from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import ADAPTIVE_MAX_DEPTH, MAX_DEPTH, MAX_TOPK, MAX_TREE_TOKENS, TreeConfig
from moaspec.drafters import DEFAULT_DRAFT_MODEL, DRAFTERS, HYBRID_MODELS
from moaspec.drafters.hybrid import POLICIES as HYBRID_POLICIES
from moaspec.errors import UserError
from moaspec.models.linear import WEIGHT_CHOICES
from moaspec.models.store import DEFAULT_MODEL, MODELS
from moaspec.threads import MAX_THREADS

EXIT_USAGE = 2  # a mistake the user can fix (its message on stderr)
EXIT_INTERRUPT = 130  # Ctrl-C, or a signal that stopped a long job at a safe point (the same command resumes)
THREADS_DEFAULT = os.environ.get("MOASPEC_THREADS", "auto")
TREE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TreeConfig) if f.name not in ("adaptive", "min_prob")}
WEIGHTS_HELP = ("weight storage of the linear layers: auto = the fastest mode at the model's own quality (a GGUF's own "
                "block formats, gguf; for float weights int4 where they lie on its grid, else int8; fp16 where the "
                "compiled kernels cannot run); fp32 the exact reference; fp16, int8, int4[-gGROUP] "
                "(see docs/results.md)")


def error(message: object) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def threads(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of threads or 'auto', got {value!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"threads must be 1..{MAX_THREADS}, got {n}")
    return n


def add_threads_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--threads", dest="kernel_threads", type=threads, default=THREADS_DEFAULT, metavar="N|auto",
                   help="kernel threads (auto: the cores idle at start; default: $MOASPEC_THREADS or auto)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and drafter")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"target: {', '.join(MODELS)}, a .gguf file or a Hugging Face folder")
    g.add_argument("--drafter", default="auto", choices=DRAFTERS,
                   help="auto = the shipped MoA drafter once it is marked the target's default, else suffix; "
                        "suffix = suffix-tree drafting over the text, earlier answers and --datastore; "
                        "hybrid = suffix + --hybrid-model; none = plain decoding")
    g.add_argument("--hybrid-model", default="moa", choices=HYBRID_MODELS,
                   help="the model drafter of --drafter hybrid (its checkpoint: --drafter-path)")
    g.add_argument("--hybrid-policy", default="switch", choices=HYBRID_POLICIES,
                   help="--drafter hybrid: per round the suffix draft or the model's (switch), or both in one "
                        "tree (merge)")
    g.add_argument("--draft-model", metavar="NAME",
                   help="draft model for --drafter model (same tokenizer as the target); default per target: "
                        + ", ".join(f"{t} -> {d}" for t, d in DEFAULT_DRAFT_MODEL.items()))
    g.add_argument("--drafter-path", metavar="DIR",
                   help="checkpoint folder of a trained drafter (moa, eagle, independent, or the one of "
                        "--hybrid-model); default: the one shipped for the target")
    g.add_argument("--datastore", metavar="DIR|none",
                   help="the suffix drafter's store of the target's answers (`moaspec datastore`); default: the one "
                        "shipped for the target; none: only the text and this session's earlier answers")
    g.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)
    add_threads_arg(g)
    g.add_argument("--target", metavar="URL", help="verify on a `moaspec serve-target` server (ws://host:port): "
                   "only the drafter and the embedding/LM head run here")
    g.add_argument("--token-file", metavar="PATH", help="--target: file whose first line is the server's bearer "
                   "token (default: $MOASPEC_TOKEN)")
    g.add_argument("--wire", default="fp16", choices=WIRE_DTYPES,
                   help="--target: precision of the drafter context the server sends back")
    g.add_argument("--ca-file", metavar="PATH", help="--target wss://: the CA (or self-signed certificate) the "
                   "server's certificate is checked against (default: the system's)")
    g.add_argument("--max-context", type=int, default=4096, metavar="N",
                   help="KV-cache size in tokens (prompt + new tokens); capped by the model's own limit")
    t = p.add_argument_group("draft tree (EAGLE-2 shape); default: calibrated to this machine's verify cost "
                             "(cached), which gives a CPU an adaptive chain and a GPU the paper's big tree")
    t.add_argument("--depth", type=int,
                   help=f"draft steps, 1 to {MAX_DEPTH} (fixed shape default {TREE_DEFAULTS['depth']})")
    t.add_argument("--topk", type=int,
                   help=f"children per expanded node, 1 to {MAX_TOPK} (default {TREE_DEFAULTS['topk']})")
    t.add_argument("--total-tokens", type=int,
                   help=f"draft tokens verified per target call, --depth to {MAX_TREE_TOKENS} "
                        f"(default {TREE_DEFAULTS['total_tokens']})")
    t.add_argument("--adaptive", action="store_true", help="draft a chain (or, with --topk W, a tree W tokens wide "
                   f"at each level) whose depth (up to --depth, default {ADAPTIVE_MAX_DEPTH}) is chosen per call from "
                   "live acceptance and this machine's costs")
    t.add_argument("--min-prob", type=float, default=None, metavar="P",
                   help="stop drafting once the likeliest draft path's probability (the drafter's own) is below P, "
                        "0 <= P < 1 (EAGLE-2's confidence stop; default 0: off)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus filter, in (0, 1]; 1 = off")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--deterministic-drafts", action="store_true",
                   help="at temperature > 0, draft the drafter's top-k tokens instead of sampling them from its "
                        "distribution (sampled drafts are accepted more often; both keep the output exact)")
    g.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    g.add_argument("--system", metavar="TEXT", help="system message for the chat template")


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """Sampling and length checks, all before any model is loaded."""
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=tuple(args.stop),
                           sampled_drafts=not args.deterministic_drafts)
    if any(not s for s in cfg.stop):
        raise UserError("--stop needs a non-empty string")
    for s in cfg.stop:
        utf8(s, "--stop")
    if args.system is not None:
        utf8(args.system, "--system")
    if args.max_context < 2:
        raise UserError(f"--max-context must be at least 2 tokens, got {args.max_context}")
    if cfg.max_new_tokens >= args.max_context:
        raise UserError(
            f"--max-new-tokens {cfg.max_new_tokens} leaves no room for the prompt in a context of "
            f"{args.max_context} tokens; lower it or raise --max-context"
        )
    return cfg


def tree_config(args: argparse.Namespace) -> TreeConfig | str:
    """A fixed shape when any of --depth/--topk/--total-tokens is given, an adaptive chain (or tree with
    --topk) with --adaptive, else "auto"; with --min-prob P each carries the confidence stop ("auto@P" for
    auto)."""
    given = {k: v for k in TREE_DEFAULTS if (v := getattr(args, k)) is not None}
    min_prob = TreeConfig(min_prob=args.min_prob or 0.0).min_prob  # its range checked before a model loads
    if args.adaptive:
        if "total_tokens" in given:
            raise UserError("--adaptive drafts --topk tokens at each of up to --depth levels: drop --total-tokens")
        return TreeConfig.adaptive_tree(given.get("depth", ADAPTIVE_MAX_DEPTH), given.get("topk", 1), min_prob)
    if not given:
        return f"auto@{min_prob}" if min_prob else "auto"
    given["min_prob"] = min_prob
    shape = {**TREE_DEFAULTS, **given}
    if "total_tokens" not in given:  # --depth alone: enough tokens to reach it
        shape["total_tokens"] = max(shape["total_tokens"], shape["depth"])
    return TreeConfig(**shape)


def check_model_name(name: str, flag: str = "--model") -> None:
    if name in MODELS or name.lower() in MODELS or Path(name).expanduser().exists():
        return
    raise UserError(
        f"unknown model {name!r} ({flag}); known models: {', '.join(MODELS)} "
        f"(or a path to a .gguf file or a Hugging Face folder)"
    )


def check_models(args: argparse.Namespace) -> None:
    check_model_name(args.model, "--model")
    if args.draft_model is not None:
        if args.drafter != "model" and (args.drafter, args.hybrid_model) != ("hybrid", "model"):
            raise UserError(f"--draft-model only applies to --drafter model (got --drafter {args.drafter})")
        check_model_name(args.draft_model, "--draft-model")
    if args.datastore is not None:
        if args.drafter not in ("auto", "suffix", "hybrid"):
            raise UserError("--datastore only applies to --drafter suffix, hybrid or auto "
                            f"(got --drafter {args.drafter})")
        if args.datastore != "none" and not Path(args.datastore).expanduser().is_dir():
            raise UserError(f"--datastore {args.datastore}: no such folder; build one with `moaspec datastore` "
                            "or pass none")


def not_utf8(what: str, byte: int, offset: int) -> UserError:
    return UserError(f"{what} is not valid UTF-8 (byte 0x{byte:02x} at byte offset {offset}); give it as UTF-8 text")


def utf8(text: str, what: str) -> str:
    """`text`, if it is valid UTF-8: bytes that are not arrive as surrogate escapes (in argv, and on
    stdin once `lenient_stdin` ran), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        offset = len(text[:e.start].encode("utf-8"))
        if 0xDC80 <= c <= 0xDCFF:  # a surrogate escape: the byte c - 0xDC00
            raise not_utf8(what, c - 0xDC00, offset) from None
        raise UserError(f"{what} holds a lone surrogate U+{c:04X} at byte offset {offset}; give it as UTF-8 text") \
            from None
    return text


def lenient_stdin() -> None:
    """Have stdin decode bytes that are not UTF-8 as surrogate escapes (as argv does), for `utf8` to
    report, instead of failing inside the reader with a traceback."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")


def decoder_settings(args: argparse.Namespace, tree: TreeConfig | str) -> dict[str, Any]:
    """The `SpecDecoder` the model and drafter options describe, as its keyword arguments."""
    token = None
    if args.target:
        from moaspec.link.remote import read_token

        token = read_token(args.token_file)
    return dict(model=args.model, drafter=args.drafter, draft_model=args.draft_model, drafter_path=args.drafter_path,
                weights=args.weights, tree=tree, max_seq_len=args.max_context, hybrid_model=args.hybrid_model,
                hybrid_policy=args.hybrid_policy, target_url=args.target, token=token, wire=args.wire,
                datastore=args.datastore, ca_file=args.ca_file)


def load_decoder(args: argparse.Namespace, tree: TreeConfig | str):
    from moaspec.pipeline import SpecDecoder

    return SpecDecoder(**decoder_settings(args, tree))


def csv(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())
