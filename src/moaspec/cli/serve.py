"""`moaspec serve` (the OpenAI-compatible API) and `moaspec serve-target` (the target for remote drafters):
options and checks here, the servers themselves in `serving/`."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from moaspec.cli.options import (
    WEIGHTS_HELP,
    add_model_args,
    add_threads_arg,
    check_model_name,
    check_models,
    decoder_settings,
    tree_config,
)
from moaspec.errors import UserError
from moaspec.flags import add_flags, from_flags
from moaspec.link.protocol import Limits
from moaspec.models.linear import WEIGHT_CHOICES
from moaspec.models.store import DEFAULT_MODEL, MODELS
from moaspec.serving.openai_api import API_KEY_ENV, ApiLimits
from moaspec.serving.runner import ConnectionLimits


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                        "/v1/models) over the target and drafter",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on; any but loopback needs an API key")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-token-file", metavar="PATH", help="file whose first line is the API key clients must send "
                    "(Authorization: Bearer); default: $MOASPEC_API_KEY, if set; with none the API is open and only "
                    "listens on (and answers requests addressed to) loopback. Never the --target server's token")
    _add_server_args(sv, ApiLimits)
    sv.set_defaults(func=cmd_serve)

    st = sub.add_parser("serve-target", help="serve the target model to remote drafters (client-server mode)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    st.add_argument("--model", default=DEFAULT_MODEL, help=f"target: {', '.join(MODELS)}")
    st.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)
    add_threads_arg(st)
    st.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    st.add_argument("--port", type=int, default=8765)
    st.add_argument("--token-file", metavar="PATH", help="file of the bearer tokens clients may send, one per line, "
                    "each with its own session limit (default: $MOASPEC_TOKEN)")
    st.add_argument("--drafter-path", metavar="LABEL=DIR", action="append", default=[],
                    help="a drafter checkpoint whose target-side encoder to offer (repeatable; default: every "
                         "drafter shipped for the target)")
    _add_server_args(st, Limits)
    st.set_defaults(func=cmd_serve_target)


def _add_server_args(p: argparse.ArgumentParser, limits: type) -> None:
    p.add_argument("--ssl-certfile", metavar="PATH", help="serve over TLS (wss:// / https://) with this certificate "
                   "chain, so that bearer tokens never cross a network in clear")
    p.add_argument("--ssl-keyfile", metavar="PATH", help="the certificate's private key")
    add_flags(p.add_argument_group("limits"), limits)
    add_flags(p.add_argument_group("connections"), ConnectionLimits)
    r = p.add_argument_group("scale-out")
    r.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="N >= 1: serve N replicas on Ray Serve behind one address (serving.cluster); 0: one process")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray gives each replica (its torch threads)")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. auto, after `ray start --head`); "
                   "default: start a local Ray for this command")


def _tls(args: argparse.Namespace) -> dict[str, str]:
    """uvicorn's TLS settings from --ssl-certfile/--ssl-keyfile (both or neither, readable), --port checked
    first."""
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise UserError("TLS needs both --ssl-certfile and --ssl-keyfile")
    if not args.ssl_certfile:
        return {}
    for path in (args.ssl_certfile, args.ssl_keyfile):
        if not Path(path).is_file():
            raise UserError(f"no such file: {path}")
    return {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}


def _scale_out(args: argparse.Namespace, app: functools.partial, name: str) -> int:
    from moaspec.serving import cluster

    if args.ssl_certfile:
        raise UserError("--replicas serves through Ray Serve's proxy, which this command runs without TLS: put a "
                        "TLS-terminating proxy in front of it, or serve one process with --ssl-certfile")
    print(f"serving {args.replicas} replica(s) of {name} on Ray Serve at {args.host}:{args.port}; Ctrl-C stops",
          file=sys.stderr)
    cluster.run(app, name, args.replicas, args.host, args.port, replica_cpus=args.replica_cpus,
                ray_address=args.ray_address)
    return 0


def _drafter_paths(items: list[str]) -> dict[str, Path] | None:
    folders = {}
    for item in items:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            raise UserError(f"--drafter-path takes LABEL=DIR (e.g. moa=runs/qwen/moa), got {item!r}")
        folders[label] = Path(folder)
    return folders or None


def cmd_serve_target(args: argparse.Namespace) -> int:
    from moaspec.link.remote import read_tokens
    from moaspec.serving import target_server

    tls = _tls(args)
    check_model_name(args.model)
    limits = from_flags(Limits, args)
    connections = from_flags(ConnectionLimits, args)
    tokens = read_tokens(args.token_file)
    paths = _drafter_paths(args.drafter_path)
    if args.replicas:
        return _scale_out(args, functools.partial(target_server.build_app, args.model, args.weights, tokens, limits,
                                                  paths), "target")
    server = target_server.build(args.model, args.weights, tokens, limits, paths, scheduler_thread=False)
    batched = "batched passes" if server.model.batch_invariant() else \
        "passes one session at a time (fp32 is not batch-invariant: use --weights fp16/int8/int4 to batch)"
    print(f"serving {args.model} ({server.model.weights}, {batched}) on {'wss' if tls else 'ws'}://{args.host}:"
          f"{args.port} with {len(server.encoders)} drafter encoder(s); Ctrl-C stops", file=sys.stderr)
    target_server.serve(server, args.host, args.port, connections=connections, **tls)
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """The API's own key, apart from the --target server's token (API clients must not learn that one)."""
    from moaspec.link.remote import read_token

    if args.api_token_file:
        return read_token(args.api_token_file)
    return os.environ.get(API_KEY_ENV, "").strip() or None


def cmd_serve(args: argparse.Namespace) -> int:
    from moaspec.serving import openai_api

    tls = _tls(args)
    key = _api_key(args)
    openai_api.check_host(args.host, key)
    connections = from_flags(ConnectionLimits, args)
    tree = tree_config(args)
    check_models(args)
    limits = from_flags(ApiLimits, args)
    settings = decoder_settings(args, tree)
    if args.replicas:
        return _scale_out(args, functools.partial(openai_api.build_app, settings, key, limits), "api")
    app = openai_api.build_app(settings, key, limits, scheduler_thread=False)
    dec = app.state.api.gen.dec
    together = f"up to {limits.parallel} requests together"
    if dec.remote is None and not dec.target.batch_invariant():
        together += " (fp32 is not batch-invariant: their passes run one after another; --weights fp16/int8/int4 " \
                    "batches them)"
    base = f"{'https' if tls else 'http'}://{args.host}:{args.port}"
    access = "key required" if key else "open, loopback only"
    print(f"serving {dec.describe()} as an OpenAI API on {base}/v1 ({access}; {together}); the chat page: {base}/ ; "
          "Ctrl-C stops", file=sys.stderr)
    openai_api.serve(app, args.host, args.port, connections=connections, **tls)
    return 0
