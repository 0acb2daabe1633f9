"""Many clients against one server: `python -m experiments.serving`.

Each server runs as its own process on loopback (ours: `moaspec serve`; the peer: llama.cpp's
`llama-server -np N` with continuous batching, on the same GGUF our weights come from); the clients
are asyncio tasks in this process streaming `/v1/chat/completions`. For every server and every client
count, each client asks its questions one after another (greedy), all clients at once, and the run
records per request the time to first token (TTFT), the time per output token after it (TPOT, as
vLLM's benchmarks define it: (last - first) / (tokens - 1)), and the answer. Reported per row:
aggregate tokens/s (all completion tokens over the wall time), per-client tokens/s, p50/p99 TTFT and
TPOT, errors, and how many answers differ from the same server's answer with one client (batching
must not change a greedy answer; ours are bit-identical by construction).

Every row starts a server afresh (no KV cache, suffix history or Token Recycling table from an earlier row:
each row asks the same questions, so that its answers can be compared with the lone client's), warmed up on
other questions. Caches are cold on both sides by default (ours `--cache-ram 0`, llama-server's requests
`cache_prompt: false`); `--cache warm` turns both sides' prompt caches on. Servers are measured one after
another; nothing else may run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from moaspec import llamacpp
from moaspec.errors import UserError
from moaspec.models.store import gguf_file
from moaspec.tasks import load_tasks


@dataclass
class Request:
    client: int
    question: int
    ttft_s: float = 0.0
    tpot_s: float | None = None
    tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass
class Row:
    server: str
    clients: int
    wall_s: float
    tokens: int
    requests: list[Request] = field(default_factory=list)

    @property
    def ok(self) -> list[Request]:
        return [r for r in self.requests if r.error is None]

    def summary(self, lone: dict[int, str] | None) -> dict:
        ok = self.ok
        ttft = sorted(r.ttft_s for r in ok)
        tpot = sorted(r.tpot_s for r in ok if r.tpot_s is not None)
        differ = None if lone is None else sum(r.text != lone.get(r.question) for r in ok)
        return {"server": self.server, "clients": self.clients, "aggregate_tok_s": round(self.tokens / self.wall_s, 2),
                "per_client_tok_s": round(self.tokens / self.wall_s / self.clients, 2),
                "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                "tpot_p50_ms": _ms(_pct(tpot, 50)), "tpot_p99_ms": _ms(_pct(tpot, 99)),
                "errors": len(self.requests) - len(ok), "requests": len(self.requests), "differ_from_lone": differ}


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))], 4)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on loopback, stopped on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict | None = None):
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self.url = f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"{self.name} exited with code {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise UserError(f"{self.name} did not start within {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def _ask(client: httpx.AsyncClient, url: str, model: str, question: str, max_tokens: int,
               req: Request, warm: bool = False) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "cache_prompt": warm}  # llama-server's prompt cache (ours is the server's --cache-ram)
    for attempt in range(2):  # a kept-alive connection the server closed meanwhile fails at once: once more
        t0 = time.perf_counter()
        await _stream(client, url, body, req, t0)
        if req.error is None or not req.error.startswith("RemoteProtocolError") or req.text or attempt:
            return
        req.error = None


async def _stream(client: httpx.AsyncClient, url: str, body: dict, req: Request, t0: float) -> None:
    first = last = None
    parts: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                req.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    req.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        parts.append(text)
    except httpx.HTTPError as e:
        req.error = f"{type(e).__name__}: {e}"
        req.text = "".join(parts)  # what came before the failure (nothing: the request may be sent again)
        return
    req.text = "".join(parts)
    if first is None:
        req.error = "no tokens"
        return
    req.ttft_s = first - t0
    if req.tokens > 1:
        req.tpot_s = (last - first) / (req.tokens - 1)


async def _load(url: str, model: str, questions: list[str], clients: int, max_tokens: int, warm: bool = False
                ) -> tuple[float, list[Request]]:
    """Every question once, split over `clients` clients that each ask theirs one after another."""
    reqs: list[Request] = []

    async def client_loop(c: int, http: httpx.AsyncClient) -> None:
        for q in range(c, len(questions), clients):
            req = Request(c, q)
            reqs.append(req)
            await _ask(http, url, model, questions[q], max_tokens, req, warm)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c, http) for c in range(clients)))
        return time.perf_counter() - t0, reqs


def _ours(model: str, weights: str, drafter: str, parallel: int, port: int, threads: int, warm: bool) -> list[str]:
    return [str(Path(sys.executable).parent / "moaspec"), "serve", "--model", model, "--weights", weights, "--drafter",
            drafter, "--port", str(port), "--parallel", str(parallel), "--max-waiting", "64", "--threads",
            str(threads), "--max-tokens", "1024", *([] if warm else ["--cache-ram", "0"])]


def _llama_server(model: str, parallel: int, port: int, threads: int, ctx_per_slot: int, lookup: bool) -> list[str]:
    exe = llamacpp.bin_dir() / "llama-server"
    if not exe.is_file():
        raise UserError(f"llama-server not found in {llamacpp.bin_dir()}: build it with `make llama-cpp`")
    cmd = [str(exe), "-m", str(gguf_file(model)), "-np", str(parallel), "-c", str(ctx_per_slot * parallel),
           "-t", str(threads), "-tb", str(threads), "--port", str(port), "--host", "127.0.0.1", "-cb",
           "--alias", model]  # with its warm-up pass, as ours warms up
    if lookup:
        cmd += ["--spec-type", "ngram-simple"]
    return cmd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--servers", default="plain:fp16,suffix:fp16,moa:fp16,plain:int4,suffix:int4,llama-server",
                   help="ours as DRAFTER:WEIGHTS, and llama-server / llama-server-lookup")
    p.add_argument("--clients", default="1,2,4,8,16")
    p.add_argument("--requests", type=int, default=32, help="questions answered in every row, split over its "
                   "clients")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", choices=("cold", "warm"), default="cold",
                   help="both sides' prompt caches off (cold) or on (warm)")
    p.add_argument("--out", default="bench-out/serving")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.clients.split(",")]
    if counts[0] != 1:
        raise UserError("the first client count must be 1: its answers are the reference")
    top = max(counts)
    warm = args.cache == "warm"
    tasks = load_tasks(n=8)
    questions = [q.turns[0] for q in tasks][: args.requests]
    others = [q.turns[0] for q in tasks][args.requests:][:2] or ["Say hello.", "Count to three."]  # the warm-up's
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in args.servers.split(","):
        lone: dict[int, str] | None = None
        for n in counts:  # a fresh server per row: nothing an earlier row taught it
            port = free_port()
            if spec.startswith("llama-server"):
                cmd = _llama_server(args.model, top, port, args.threads, 2048, lookup=spec.endswith("lookup"))
            else:
                drafter, _, weights = spec.partition(":")
                cmd = _ours(args.model, weights or "fp16", drafter if drafter != "plain" else "none", top, port,
                            args.threads, warm)
            server = Server(spec, cmd, port, out / f"{spec.replace(':', '-')}-{n}.log")
            try:
                server.wait_ready()
                asyncio.run(_load(server.url, args.model, others, 2, 8, warm))  # warm up, on other questions
                wall, reqs = asyncio.run(_load(server.url, args.model, questions, n, args.max_tokens, warm))
            finally:
                server.stop()
            row = Row(spec, n, wall, sum(r.tokens for r in reqs if r.error is None), reqs)
            if n == 1:
                lone = {r.question: r.text for r in reqs if r.error is None}
            summary = {**row.summary(lone), "cache": args.cache}
            results.append({**summary, "detail": [asdict(r) for r in reqs]})
            print(json.dumps(summary), flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    _report(results, out / "report.md")
    print(f"report: {out / 'report.md'}")
    return 0


def _report(results: list[dict], path: Path) -> None:
    lines = ["| server | clients | aggregate tok/s | x its 1 client | per client tok/s | TTFT p50 / p99 s | "
             "TPOT p50 / p99 ms | errors | answers differing from lone |", "|---|---|---|---|---|---|---|---|---|"]
    base: dict[str, float] = {}
    for r in results:
        if r["clients"] == 1:
            base.setdefault(r["server"], r["aggregate_tok_s"])
        ratio = r["aggregate_tok_s"] / base[r["server"]] if r["server"] in base else float("nan")
        lines.append(f"| {r['server']} | {r['clients']} | {r['aggregate_tok_s']:.1f} | {ratio:.2f}x | "
                     f"{r['per_client_tok_s']:.1f} | {r['ttft_p50_s']} / {r['ttft_p99_s']} | {r['tpot_p50_ms']} / "
                     f"{r['tpot_p99_ms']} | {r['errors']}/{r['requests']} | {r['differ_from_lone']} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
