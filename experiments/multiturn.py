"""A conversation of several turns about a ~1.5k-token module of code, sent to each server as a chat client
sends it (the whole conversation every turn, greedy, streamed): time to first token per turn, tokens/s and
the prompt tokens each server found cached. Warm on both sides: our server with its prefix cache and llama-server
with its prompt cache (on by default); cold on both sides: ours with `--cache-ram 0` and llama-server with
`cache_prompt: false` on every request; in one run, each server warmed up by its own warm-up pass.

    python -m experiments.multiturn --model qwen2.5-coder-0.5b --out bench-out/multiturn
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from experiments.serving import Server, _llama_server, _ours, free_port
from moaspec.errors import UserError

QUESTIONS = (
    "Here is a Python module:\n\n```python\n{code}\n```\n\nSummarise what it does in three sentences.",
    "Which function is the most complex, and why?",
    "Suggest one test for that function, as pytest code.",
    "Is there any input that would make the module fail? Give one.",
    "Rewrite the shortest function more clearly.",
)


def document(tokens: int = 1500) -> str:
    """About `tokens` tokens of real Python: the start of this package's draft-tree module."""
    text = (Path(__file__).resolve().parents[1] / "src" / "moaspec" / "decoding" / "tree.py").read_text()
    return text[: tokens * 3]  # ~3 characters a token for code


async def _turn(http: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                cache_prompt: bool = True) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache_prompt}
    for attempt in range(2):  # a kept-alive connection the server closed meanwhile fails at once: once more
        try:
            return await _streamed(http, url, body)
        except httpx.RemoteProtocolError:
            if attempt:
                raise
    raise AssertionError("unreachable")


async def _streamed(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first, parts, usage = None, [], {}
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise UserError(f"{url} answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    parts.append(text)
    end = time.perf_counter()
    tokens = usage.get("completion_tokens", len(parts))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft_s": round((first or end) - t0, 4), "total_s": round(end - t0, 4), "tokens": tokens,
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached,
            "tok_s": round(tokens / (end - (first or end)), 2) if first and end > first else None,
            "text": "".join(parts)}


async def conversation(url: str, model: str, turns: int, max_tokens: int, doc: str,
                       cache_prompt: bool = True) -> list[dict]:
    messages: list[dict] = []
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(900)) as http:
        for i in range(turns):
            q = QUESTIONS[i % len(QUESTIONS)].format(code=doc)
            messages.append({"role": "user", "content": q})
            r = await _turn(http, url, model, messages, max_tokens, cache_prompt)
            messages.append({"role": "assistant", "content": r["text"]})
            out.append(r)
    return out


async def _gaps(http: httpx.AsyncClient, url: str, model: str, question: str, max_tokens: int,
                stamps: list[float]) -> None:
    """Stream one answer, recording the arrival time of each piece of text."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())


async def stall(url: str, model: str, doc: str, streams: int = 3, max_tokens: int = 200) -> dict:
    """`streams` answers decoding while a long prompt arrives after 2 s: the gaps between their tokens
    before it, while it prefills (until its first token) and after, p50 / p99 ms."""
    stamps: list[list[float]] = [[] for _ in range(streams)]
    long_done: dict = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=httpx.Limits(max_connections=streams + 2)) as http:
        async def long_prompt() -> None:
            await asyncio.sleep(2.0)
            t0 = time.perf_counter()
            r = await _turn(http, url, model, [{"role": "user", "content": doc + "\n\nSummarise this."}], 8)
            long_done.update(start=t0, first=t0 + r["ttft_s"], prompt_tokens=r["prompt_tokens"])

        await asyncio.gather(long_prompt(), *(_gaps(http, url, model, f"Count from {i} to 500, one number a line.",
                                                    max_tokens, stamps[i]) for i in range(streams)))
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for ts in stamps:
        for a, b in zip(ts, ts[1:], strict=False):
            key = "before" if b < long_done["start"] else "during" if b <= long_done["first"] else "after"
            phases[key].append((b - a) * 1e3)

    def pct(xs: list[float], p: float) -> float | None:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(p / 100 * (len(xs) - 1) + 0.5))], 1) if xs else None

    return {"prompt_tokens": long_done.get("prompt_tokens"),
            "prefill_s": round(long_done["first"] - long_done["start"], 2),
            **{f"{k}_p50_ms": pct(v, 50) for k, v in phases.items()},
            **{f"{k}_p99_ms": pct(v, 99) for k, v in phases.items()},
            **{f"{k}_max_ms": round(max(v), 1) if v else None for k, v in phases.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--servers", default="ours,llama-server,ours-cold,llama-server-cold",
                   help="comma-separated among ours, ours-cold (--cache-ram 0), llama-server, llama-server-cold "
                        "(cache_prompt: false)")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="auto")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--out", default="bench-out/multiturn")
    p.add_argument("--stall", type=int, default=0, metavar="TOKENS",
                   help="instead: 3 streams decode while a prompt of about TOKENS tokens arrives (chunked prefill); "
                        "the gaps between their tokens before, during and after its prefill")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = document(args.doc_tokens)
    results = {}
    for name in args.servers.split(","):
        port = free_port()
        if name in ("ours", "ours-cold"):
            cmd = _ours(args.model, args.weights, args.drafter, 1, port, args.threads, warm=name == "ours")
        elif name in ("llama-server", "llama-server-cold"):
            cmd = _llama_server(args.model, 1, port, args.threads, 8192, lookup=False)
        else:
            raise UserError(f"unknown server {name!r}")
        if args.stall:  # room for the streams beside the long prompt
            cmd = [*cmd[:cmd.index("--parallel") + 1], "4", *cmd[cmd.index("--parallel") + 2:]] if name != \
                "llama-server" else _llama_server(args.model, 4, port, args.threads, 8192, lookup=False)
        server = Server(name, cmd, port, out / f"{name}.log")
        try:
            server.wait_ready()
            if args.stall:
                results[name] = asyncio.run(stall(server.url, args.model, document(args.stall)))
            else:
                results[name] = asyncio.run(conversation(server.url, args.model, args.turns, args.max_tokens, doc,
                                                         cache_prompt=name != "llama-server-cold"))
        finally:
            server.stop()
        print(name, results[name] if args.stall else [r["ttft_s"] for r in results[name]], flush=True)
    if args.stall:
        (out / "stall.json").write_text(json.dumps(results, indent=1))
        return 0
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"| time to first token, s | {' | '.join(f'turn {i + 1}' for i in range(args.turns))} |",
             "|---|" + "---|" * args.turns]
    for name, rows in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['ttft_s']:.2f}" for r in rows) + " |")
    lines += ["", "| cached prompt tokens | " + " | ".join(f"turn {i + 1}" for i in range(args.turns)) + " |",
              "|---|" + "---|" * args.turns]
    for name, rows in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['cached_tokens']} / {r['prompt_tokens']}" for r in rows) + " |")
    if "ours" in results and "ours-cold" in results:
        same = sum(a["text"] == b["text"] for a, b in zip(results["ours"], results["ours-cold"], strict=True))
        lines += ["", f"ours warm and cold answers identical: {same} of {args.turns} turns"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
