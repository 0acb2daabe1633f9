"""Client-server mode over real sockets under network profiles (arXiv 2410.03804, section 6).

    python -m experiments.network --model qwen2.5-coder-0.5b --out bench-out/network

The target runs in its own `moaspec serve-target` process (and, for the API baseline, a `moaspec serve`
process); the client (this process) reaches both through the shaping proxy (`serving.shaping`), whose
profile changes between runs. For each profile and method it measures latency per generated token
(from sending the prompt to the last token, so the prefill and every round trip count), server calls
per token and bytes per token each way (as the proxy counted them on the wire).

Methods: the client-server drafters (MoA, EAGLE-2, the independent drafter, prompt lookup, each with
the adaptive chain that prices the round trip); `remote-plain`, one call per token on a session that
keeps the KV cache; and two API baselines on `moaspec serve`: `api-stream`, the server writes the whole
answer in one streamed request (the usual API), and `api-per-token`, one stateless completion request
per token carrying the whole text so far. `--tree-sweep moa,lookup`
adds those methods with fixed chains, to show what the adaptive chain gains on each link.

`--devices N` measures many devices against one server: for each client-server method, 1 then N devices
at once, each on its own link of the profile (its own shaping proxy), each generating every prompt one
after another; reported: aggregate tokens/s of the server, each device's ms/token, and the ratio of N
devices to one. The devices are threads of this process (each with one torch thread), so on a machine
of few cores their drafting competes with the server for the CPU, unlike real devices.

`--quality` measures the drafter alone after a cut: from token k of the target's own answer, each
drafter writes 128 tokens without the target; reported: the tokens it gets right before the first
divergence, its positional agreement with the target over 32/64/128 tokens, and the target's
perplexity of its text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from experiments.shaping import PROFILES, ShapingProxy
from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import TreeConfig
from moaspec.errors import UserError
from moaspec.tasks import load_tasks

DEFAULT_PROFILES = ("lan", "wifi", "5g", "4g", "satellite")
CS_METHODS = ("moa", "eagle", "independent", "lookup")
METHODS = (*CS_METHODS, "remote-plain", "api-stream", "api-per-token")
API = ("api-stream", "api-per-token")
SWEEP = ("chain:1", "chain:2", "chain:4", "chain:8", "adaptive:16")
HORIZONS = (32, 64, 128)
TOKEN = "moaspec-bench-network"


@dataclass
class Row:
    profile: str
    method: str
    tree: str
    tokens: int
    seconds: float
    calls: int
    bytes_up: int
    bytes_down: int
    tau: float

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / max(1, self.tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], port: int, env: dict[str, str]) -> subprocess.Popen:
    """A `moaspec` server process; returns once its /health (target) or /v1/models (API) answers."""
    proc = subprocess.Popen([sys.executable, "-m", "moaspec", *args, "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise UserError(f"`moaspec {args[0]}` exited: {proc.stderr.read().decode()[-1500:]}")
        for path in ("/health", "/v1/models"):
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                             headers={"Authorization": f"Bearer {TOKEN}"})
                with urllib.request.urlopen(req, timeout=2):
                    return proc
            except OSError:
                pass
        time.sleep(0.5)
    proc.kill()
    raise UserError(f"`moaspec {args[0]}` did not come up in 300 s")


def _tree(spec: str) -> str | TreeConfig:
    if spec.startswith("chain:"):
        d = int(spec.split(":")[1])
        return TreeConfig(d, 1, d)
    return spec


def _client(model: str, method: str, url: str, tree: str, weights: str):
    from moaspec.pipeline import SpecDecoder

    drafter = "none" if method == "remote-plain" else method
    return SpecDecoder(model, drafter=drafter, target_url=url, token=TOKEN, weights=weights, warmup=False,
                       tree=_tree(tree) if drafter != "none" else None, target_timeout_s=60)


def _api_stream(port: int, model: str, messages: list[dict], max_tokens: int) -> tuple[int, float]:
    """One streamed chat completion; (completion tokens, seconds to the last byte)."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t = time.perf_counter()
    tokens = 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens, time.perf_counter() - t


def _api_per_token(port: int, model: str, prompt: str, max_tokens: int) -> tuple[int, float, int]:
    """One stateless completion request per token, each carrying the whole text so far (an API client
    that drafts locally and asks for one token at a time); (tokens, seconds, requests)."""
    import httpx

    t = time.perf_counter()
    n = 0
    with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        while n < max_tokens:
            n += 1
            r = http.post(f"http://127.0.0.1:{port}/v1/completions",
                          json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            prompt += choice["text"]
            if choice["finish_reason"] == "stop":
                break
    return n, time.perf_counter() - t, n


def run_network(model: str, profiles: list[str], methods: list[str], prompts: list[list[dict]],
                max_new_tokens: int, weights: str, sweep: list[str], out: Path) -> list[Row]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOASPEC_TOKEN": TOKEN}
    torch.set_num_threads(1)
    procs: list[subprocess.Popen] = []
    rows: list[Row] = []
    try:
        tport = _free_port()
        procs.append(_launch(["serve-target", "--model", model, "--weights", weights, "--max-sessions", "32",
                              "--idle-timeout", "7200"], tport, env))
        aport = None
        if any(m in API for m in methods):
            aport = _free_port()
            procs.append(_launch(["serve", "--model", model, "--weights", weights, "--drafter", "none"],
                                 aport, env))
        with ShapingProxy(("127.0.0.1", tport)) as tproxy, \
                ShapingProxy(("127.0.0.1", aport or tport)) as aproxy:
            url = f"ws://127.0.0.1:{tproxy.port}"
            runs = [(m, "adaptive:16") for m in methods]
            runs += [(m, t) for m in sweep for t in SWEEP if (m, t) not in runs]
            clients = {(m, t): _client(model, m, url, t, weights) for m, t in runs if m not in API}
            from moaspec.models.store import load_tokenizer, resolve

            tok = load_tokenizer(resolve(model))
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, offline=False)
            for profile in profiles:
                tproxy.set_profile(profile)
                aproxy.set_profile(profile)
                for method, tree in runs:
                    proxy = aproxy if method in API else tproxy
                    tokens = calls = 0
                    seconds = tau_sum = 0.0
                    proxy.traffic(reset=True)
                    for messages in prompts:
                        if method == "api-stream":
                            n, s = _api_stream(aproxy.port, model, messages, max_new_tokens)
                            tokens, seconds, calls = tokens + n, seconds + s, calls + 1
                            continue
                        if method == "api-per-token":
                            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                            n, s, k = _api_per_token(aproxy.port, model, text, max_new_tokens)
                            tokens, seconds, calls = tokens + n, seconds + s, calls + k
                            continue
                        dec = clients[(method, tree)]
                        before = dec.remote.calls
                        t = time.perf_counter()
                        gen = dec.generate(messages, cfg)
                        seconds += time.perf_counter() - t
                        tokens += len(gen.token_ids)
                        calls += dec.remote.calls - before
                        tau_sum += gen.metrics.tau * len(gen.token_ids)
                    traffic = proxy.traffic()
                    row = Row(profile, method, tree if method not in API else "-", tokens, seconds, calls,
                              traffic.to_server, traffic.to_client, tau_sum / max(1, tokens))
                    rows.append(row)
                    print(f"{profile:10s} {method:13s} {row.tree:12s} {row.ms_per_token:8.1f} ms/token "
                          f"{calls / max(1, tokens):5.2f} calls/token {row.bytes_up / max(1, tokens):8.0f} B up "
                          f"{row.bytes_down / max(1, tokens):8.0f} B down /token", flush=True)
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "network.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
            for dec in clients.values():
                dec.remote.shutdown()
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return rows


@dataclass
class DevicesRow:
    profile: str
    method: str
    devices: int
    tokens: int
    wall_s: float
    ms_per_token: list[float]  # per device
    tau: float

    @property
    def aggregate_tok_s(self) -> float:
        return self.tokens / self.wall_s


def run_devices(model: str, profile: str, methods: list[str], prompts: list[list[dict]], max_new_tokens: int,
                weights: str, devices: int, out: Path) -> list[DevicesRow]:
    """1 then `devices` devices per method against one `serve-target`, each device on its own link."""
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "OMP_NUM_THREADS": "2", "MOASPEC_TOKEN": TOKEN}
    torch.set_num_threads(1)
    rows: list[DevicesRow] = []
    port = _free_port()
    server = _launch(["serve-target", "--model", model, "--weights", weights, "--max-sessions", str(4 * devices),
                      "--max-connections", str(4 * devices), "--idle-timeout", "7200"], port, env)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, offline=False)
    try:
        for method in methods:
            for n in sorted({1, devices}):
                proxies = [ShapingProxy(("127.0.0.1", port), profile=profile).start() for _ in range(n)]
                clients = [_client(model, method, f"ws://127.0.0.1:{px.port}", "adaptive:16", weights)
                           for px in proxies]
                clients[0].generate(prompts[0], GenerationConfig(max_new_tokens=4, offline=False))  # warm

                def device(dec) -> tuple[int, float, float]:
                    torch.set_num_threads(1)
                    tokens, seconds, tau = 0, 0.0, 0.0
                    for messages in prompts:
                        t = time.perf_counter()
                        gen = dec.generate(messages, cfg)
                        seconds += time.perf_counter() - t
                        tokens += len(gen.token_ids)
                        tau += gen.metrics.tau * len(gen.token_ids)
                    return tokens, seconds, tau

                t0 = time.perf_counter()
                with ThreadPoolExecutor(n) as pool:
                    results = list(pool.map(device, clients))
                wall = time.perf_counter() - t0
                for dec, px in zip(clients, proxies, strict=True):
                    dec.remote.shutdown()
                    px.close()
                tokens = sum(r[0] for r in results)
                row = DevicesRow(profile, method, n, tokens, wall, [1e3 * s / max(1, k) for k, s, _ in results],
                                 sum(r[2] for r in results) / max(1, tokens))
                rows.append(row)
                print(f"{profile} {method:13s} {n:2d} devices: {row.aggregate_tok_s:6.1f} tok/s aggregate, "
                      f"{sum(row.ms_per_token) / n:7.1f} ms/token per device (max {max(row.ms_per_token):.1f}), "
                      f"tau {row.tau:.2f}", flush=True)
                out.mkdir(parents=True, exist_ok=True)
                (out / "devices.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    return rows


def devices_table(rows: list[DevicesRow]) -> str:
    lines = ["| profile | method | devices | aggregate tok/s | x one device | ms/token per device (mean / max) | tau |",
             "|---|---|---|---|---|---|---|"]
    one = {r.method: r.aggregate_tok_s for r in rows if r.devices == 1}
    for r in rows:
        mean = sum(r.ms_per_token) / len(r.ms_per_token)
        lines.append(f"| {r.profile} | {r.method} | {r.devices} | {r.aggregate_tok_s:.1f} | "
                     f"{r.aggregate_tok_s / one[r.method]:.2f}x | {mean:.1f} / {max(r.ms_per_token):.1f} | "
                     f"{r.tau:.2f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- drafter alone after a cut
@torch.no_grad()
def offline_quality(model: str, drafters: list[str], prompts: list[list[dict]], cut: int, weights: str,
                    horizon: int = max(HORIZONS)) -> dict[str, dict[str, float]]:
    """Each drafter writes `horizon` tokens alone from token `cut` of the target's greedy answer."""
    from moaspec.pipeline import SpecDecoder

    dec = SpecDecoder(model, drafter="none", weights=weights)
    target = dec.target
    results: dict[str, dict[str, list[float]]] = {d: {} for d in drafters}
    for messages in prompts:
        ids = dec.encode(messages)
        ref = dec.generate(ids, GenerationConfig(max_new_tokens=cut + horizon + 1, ignore_eos=True)).token_ids
        prefix = ids + ref[:cut]
        truth = ref[cut + 1:cut + 1 + horizon]  # after the root ref[cut], which the target itself wrote
        for name in drafters:
            dec.set_drafter(name)
            drafter = dec.drafter
            step = LocalTarget(target, drafter.encoder).start(prefix, SamplingParams())
            assert step.verdict.bonus == ref[cut]
            drafter.begin(prefix, step.context)
            root, alone = ref[cut], []
            for _ in range(horizon):
                tree = drafter.propose(root, TreeConfig(1, 1, 1))
                if len(tree) == 1:
                    break
                drafter.observe([root], None)
                root = tree.tokens[1]
                alone.append(root)
            same = next((i for i, (a, b) in enumerate(zip(alone, truth, strict=False)) if a != b), len(alone))
            r = results[name]
            r.setdefault("first_divergence", []).append(same)
            for h in HORIZONS:
                r.setdefault(f"agree_{h}", []).append(sum(a == b for a, b in zip(alone[:h], truth[:h],
                                                                                  strict=False)) / h)
            r.setdefault("target_ppl", []).append(_perplexity(target, prefix + [ref[cut]], alone))
        dec.set_drafter("none")
    return {d: {k: sum(v) / len(v) for k, v in r.items()} for d, r in results.items()}


def _perplexity(model, context: list[int], text: list[int]) -> float:
    """The target's perplexity of `text` after `context` (teacher-forced, one pass)."""
    if not text:
        return float("inf")
    model.reset()
    model.prefill(context[:-1])
    seq = torch.tensor([context[-1], *text[:-1]])
    out = model.forward(seq)
    model.reset()
    logp = torch.log_softmax(out.logits.float(), -1)
    nll = -logp[torch.arange(len(text)), torch.tensor(text)].mean()
    return math.exp(float(nll))


# ----------------------------------------------------------------------------- report
def table(rows: list[Row]) -> str:
    lines = ["| profile | method | tree | ms/token | calls/token | bytes up/token | bytes down/token | tau |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = max(1, r.tokens)
        lines.append(f"| {r.profile} | {r.method} | {r.tree} | {r.ms_per_token:.1f} | {r.calls / n:.2f} | "
                     f"{r.bytes_up / n:.0f} | {r.bytes_down / n:.0f} | {r.tau:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.network", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--weights", default="fp16")
    p.add_argument("--profiles", default=",".join(DEFAULT_PROFILES), help=f"among {', '.join(PROFILES)}")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--tasks", default="mtbench,humaneval,math")
    p.add_argument("--questions", type=int, default=1, help="per task")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--tree-sweep", nargs="?", const="moa", default="",
                   help="also these client-server methods (default moa) with fixed chains of 1, 2, 4, 8")
    p.add_argument("--quality", action="store_true", help="also the drafter-alone quality after a cut")
    p.add_argument("--cut", type=int, default=32)
    p.add_argument("--no-network", action="store_true", help="skip the network runs (e.g. --quality alone)")
    p.add_argument("--devices", type=int, default=0, metavar="N",
                   help="instead: 1 then N devices at once against one server, on the first profile, for the "
                        "client-server methods given in --methods")
    p.add_argument("--out", default="bench-out/network")
    a = p.parse_args(argv)
    profiles = [x for x in a.profiles.split(",") if x]
    methods = [x for x in a.methods.split(",") if x]
    bad = [x for x in profiles if x not in PROFILES] + [x for x in methods if x not in METHODS]
    if bad:
        raise UserError(f"unknown profile or method: {', '.join(bad)}")
    questions = load_tasks(a.tasks.split(","), a.questions)
    prompts = [[{"role": "user", "content": q.turns[0]}] for q in questions]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = []
    if a.devices:
        if a.devices < 1 or set(methods) & set(API):
            raise UserError("--devices takes N >= 1 and client-server methods (not the API baselines)")
        report.append(devices_table(run_devices(a.model, profiles[0], methods, prompts, a.max_new_tokens,
                                                a.weights, a.devices, out)))
    elif not a.no_network:
        sweep = [x for x in a.tree_sweep.split(",") if x]
        if set(sweep) - set(CS_METHODS):
            raise UserError(f"--tree-sweep takes client-server methods among {', '.join(CS_METHODS)}")
        rows = run_network(a.model, profiles, methods, prompts, a.max_new_tokens, a.weights, sweep, out)
        report.append(table(rows))
    if a.quality:
        q = offline_quality(a.model, ["moa", "eagle", "independent"], prompts, a.cut, a.weights)
        (out / "quality.json").write_text(json.dumps(q, indent=1))
        lines = ["| drafter | tokens right before the first divergence | agreement 32 | agreement 64 | "
                 "agreement 128 | target perplexity of its text |", "|---|---|---|---|---|---|"]
        for name, r in q.items():
            lines.append(f"| {name} | {r['first_divergence']:.1f} | {r['agree_32']:.2f} | {r['agree_64']:.2f} | "
                         f"{r['agree_128']:.2f} | {r['target_ppl']:.1f} |")
        report.append("\n".join(lines))
    text = "\n\n".join(report)
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
