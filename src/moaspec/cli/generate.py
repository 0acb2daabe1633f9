"""`moaspec generate` (one prompt, or a .jsonl file of them decoded together) and `moaspec chat`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from moaspec.cli import options
from moaspec.cli.options import (
    EXIT_USAGE,
    add_model_args,
    add_sampling_args,
    check_models,
    error,
    generation_config,
    tree_config,
    utf8,
)
from moaspec.decoding.engine import GenerationConfig
from moaspec.drafters import DEFAULT_DRAFT_MODEL
from moaspec.errors import UserError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text; '-' reads it from stdin")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a file; '-' reads stdin; a .jsonl "
                     "file holds many prompts (one JSON string, or object with \"prompt\", per line), decoded "
                     "together (--parallel at once, their target passes batched) into JSON lines in input order")
    g.add_argument("--parallel", type=int, default=8, help="prompts of a .jsonl --prompt-file decoded at once")
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    out = g.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, metrics) on stdout")
    out.add_argument("--stream", action="store_true", help="print tokens as they are generated (default on a TTY)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat (reads lines; /reset, /exit)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt != "-":
        text = utf8(args.prompt, "--prompt")
    elif args.prompt == "-" or args.prompt_file == "-":
        options.lenient_stdin()
        text = utf8(sys.stdin.read(), "the prompt on stdin")
    else:
        path = Path(args.prompt_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"prompt file not found: {path}") from None
        except IsADirectoryError:
            raise UserError(f"prompt file is a directory: {path}") from None
        except UnicodeDecodeError as e:
            raise options.not_utf8(f"prompt file {path}", e.object[e.start], e.start) from None
        except OSError as e:
            raise UserError(f"cannot read prompt file {path}: {e}") from None
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


def _read_prompts(path: str) -> list[str]:
    """The prompts of a JSON-lines file: a string, or an object with a string "prompt", per line."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise options.not_utf8(f"prompt file {file}", e.object[e.start], e.start) from None
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


def _generate(dec, ids: list[int], cfg: GenerationConfig, out=None):
    """SpecDecoder.generate, writing each text delta to `out` (if given) as soon as it is verified."""

    def write(delta: str) -> None:
        out.write(delta)
        out.flush()

    return dec.generate(ids, cfg, on_text=write if out is not None else None)


def _summary(gen, dec) -> str:
    m = gen.metrics
    cached = f" ({m.cached_tokens} of {m.prompt_tokens} prompt tokens cached)" if m.cached_tokens else ""
    return (f"[{dec.describe()}, {dec.target.weights}] {m.new_tokens} tokens ({gen.finish_reason}) | "
            f"{m.tokens_per_s:.1f} tok/s | tau {m.tau:.2f} | {m.target_calls} target calls | "
            f"prefill {m.prefill_s:.2f}s{cached} draft {m.draft_s:.2f}s verify {m.verify_s:.2f}s "
            f"total {m.total_s:.2f}s")


def _end_line(out, text: str) -> None:
    if not text.endswith("\n"):
        out.write("\n")
    out.flush()


def _generate_file(args: argparse.Namespace) -> int:
    """`generate --prompt-file F.jsonl`: every prompt, decoded together, one JSON line each in input order."""
    from moaspec.pipeline import generate_many

    prompts = _read_prompts(args.prompt_file)
    if args.system is not None and args.no_chat:
        raise UserError("--system needs the chat template; drop --no-chat or put the text in the prompts")
    cfg = generation_config(args)
    tree = tree_config(args)
    check_models(args)
    dec = options.load_decoder(args, tree)
    prompts_in: list = list(prompts) if args.system is None else \
        [[{"role": "system", "content": args.system}, {"role": "user", "content": q}] for q in prompts]
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
    cfg = generation_config(args)
    tree = tree_config(args)
    check_models(args)
    if args.system is not None and args.no_chat:
        raise UserError("--system needs the chat template; drop --no-chat or put the text in the prompt")
    dec = options.load_decoder(args, tree)
    ids = dec.encode(prompt, chat=not args.no_chat, system=args.system)
    streaming = not args.json and (args.stream or sys.stdout.isatty())
    gen = _generate(dec, ids, cfg, sys.stdout if streaming else None)
    if args.json:
        draft_model = (args.draft_model or DEFAULT_DRAFT_MODEL.get(args.model)) if args.drafter == "model" else None
        record = {**gen.as_dict(), "model": args.model, "drafter": dec.drafter_name, "draft_model": draft_model,
                  "tree": dataclasses.asdict(dec.engine.tree)}
        print(json.dumps(record, ensure_ascii=False), flush=True)
        return 0
    if not streaming:
        sys.stdout.write(gen.text)
    _end_line(sys.stdout, gen.text)
    print(_summary(gen, dec), file=sys.stderr, flush=True)
    return 0


def _read_line(interactive: bool) -> str | None:
    """The next line of the conversation; None at its end (Ctrl-D, EOF)."""
    if not interactive:
        line = sys.stdin.readline()
        return line or None
    try:
        return input("you> ")
    except EOFError:
        print(file=sys.stderr)
        return None


def cmd_chat(args: argparse.Namespace) -> int:
    cfg = generation_config(args)
    tree = tree_config(args)
    check_models(args)
    dec = options.load_decoder(args, tree)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    failed = False
    options.lenient_stdin()
    if interactive:
        print(f"Chat with {dec.describe()}. /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while (line := _read_line(interactive)) is not None:
        line = line.strip()
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(system)
            print("(history cleared)", file=sys.stderr, flush=True)
            continue
        if not line:
            continue
        try:
            utf8(line, "that line")
        except UserError as e:
            error(f"{e} (the line is skipped)")
            failed = True
            continue
        history.append({"role": "user", "content": line})
        try:
            gen = _generate(dec, dec.encode(history), cfg, sys.stdout)
        except UserError as e:  # e.g. the conversation outgrew the context: keep chatting
            history.pop()
            sys.stdout.flush()
            error(f"{e} (/reset clears the history)")
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
        print(_summary(gen, dec), file=sys.stderr, flush=True)
    return EXIT_USAGE if failed else 0
