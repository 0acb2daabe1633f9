"""Load that holds: `python -m experiments.soak`.

Starts `moaspec serve --replicas R` (the OpenAI API) and `moaspec serve-target --replicas R` (the target
server) on loopback, each reached through a shaping proxy (`--profile`), and first takes each prompt's
answer from each server alone (greedy). Then, for each client count, for `--minutes` each:
- API: locust in a process of its own (`experiments/locustfile.py`), N users streaming chat completions, every
  answer checked against its lone answer (a different text is a failure: a session mix-up or corruption);
- devices: N client-server devices (threads here, drafter `--drafter`, one session each) generating one
  prompt after another, every text checked against the target's lone greedy text.
Reported per phase: requests, failures, p50/p99 latency (whole request and time to first token for the
API, ms per token for devices), and the peak resident memory of each server's process tree (Ray's
replicas included) sampled every second, then the memory after the sessions' idle timeout.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from experiments.network import _free_port
from experiments.shaping import ShapingProxy
from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.target import TargetUnavailable
from moaspec.errors import UserError
from moaspec.tasks import TASKS, load_tasks

TOKEN = "moaspec-soak"


class Server:
    """A `moaspec` server command in a process of its own, and the memory of its process tree."""

    def __init__(self, args: list[str], port: int, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "moaspec", *args, "--port", str(port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.port, self.peak = port, 0
        deadline, up = time.time() + 300, 0
        while up < 3:
            if self.proc.poll() is not None:
                raise UserError(f"`moaspec {args[0]}` exited: {self.proc.stderr.read().decode()[-1500:]}")
            if time.time() > deadline:
                self.close()
                raise UserError(f"`moaspec {args[0]}` did not come up in 300 s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    up += r.status == 200
            except OSError:
                up = 0
            time.sleep(1)

    def rss(self) -> int:
        try:
            root = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)] if p.is_running())
        except psutil.Error:
            return 0

    def sample(self) -> int:
        now = self.rss()
        self.peak = max(self.peak, now)
        return now

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def lone_api_answers(port: int, model: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    out = {}
    with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for p in prompts:
            r = http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                          json={"model": model, "messages": [{"role": "user", "content": p}], "temperature": 0,
                                "max_tokens": max_tokens})
            r.raise_for_status()
            out[p] = r.json()["choices"][0]["message"]["content"]
    return out


def api_phase(proxy_port: int, expected: Path, users: int, seconds: int, workdir: Path) -> dict:
    """locust, headless, in its own process; its CSV statistics read back."""
    prefix = workdir / f"locust-{users}"
    locustfile = Path(__file__).with_name("locustfile.py")
    env = {**os.environ, "MOASPEC_SOAK_EXPECTED": str(expected), "MOASPEC_API_KEY": TOKEN}
    subprocess.run([sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "-u", str(users),
                    "-r", str(users), "-t", f"{seconds}s", "--host", f"http://127.0.0.1:{proxy_port}",
                    "--csv", str(prefix), "--only-summary", "--stop-timeout", "120", "--loglevel", "WARNING"],
                   env=env, check=False, timeout=seconds + 600, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows = {r["Name"]: r for r in csv.DictReader(open(f"{prefix}_stats.csv"))}  # noqa: SIM115
    failures = list(csv.DictReader(open(f"{prefix}_failures.csv")))  # noqa: SIM115
    chat, ttft, whole = rows.get("chat (stream)", {}), rows.get("first token", {}), rows.get("whole answer", {})
    return {"requests": int(chat.get("Request Count", 0)), "failures": int(chat.get("Failure Count", 0)),
            "p50_ms": float(whole.get("50%", "nan")), "p99_ms": float(whole.get("99%", "nan")),
            "ttft_p50_ms": float(ttft.get("50%", "nan")), "ttft_p99_ms": float(ttft.get("99%", "nan")),
            "failure_kinds": [{"error": f["Error"][:200], "count": int(f["Occurrences"])} for f in failures]}


def device_phase(url: str, model: str, drafter: str, prompts: list[list[dict]], want: list[list[int]],
                 devices: int, seconds: int, max_new: int) -> dict:
    from moaspec.pipeline import SpecDecoder

    cfg = GenerationConfig(max_new_tokens=max_new)
    stop_at = time.time() + seconds
    results: list[tuple[bool, float, str | None]] = []  # (text right, ms per token, error)
    retries: list[str] = []  # session openings that timed out and were tried again
    lock = threading.Lock()

    def device(k: int) -> None:
        import torch

        torch.set_num_threads(1)
        dec = None
        while dec is None:  # many devices opening sessions at once: a handshake may time out; a device retries
            try:
                dec = SpecDecoder(model, drafter=drafter, target_url=url, token=TOKEN, warmup=False,
                                  target_timeout_s=120)
            except TargetUnavailable as e:
                with lock:
                    retries.append(str(e)[:120])
                if time.time() > stop_at:
                    with lock:
                        results.append((False, float("nan"), f"never connected: {e}"[:200]))
                    return
                time.sleep(1.0)
        i = k
        try:
            while time.time() < stop_at:
                j = i % len(prompts)
                t = time.perf_counter()
                try:
                    gen = dec.generate(prompts[j], cfg)
                    row = (gen.token_ids == want[j] and gen.metrics.unverified_in_output == 0,
                           1e3 * (time.perf_counter() - t) / max(1, len(gen.token_ids)), None)
                except Exception as e:  # counted, not raised: the phase goes on
                    row = (False, float("nan"), f"{type(e).__name__}: {e}"[:200])
                with lock:
                    results.append(row)
                i += devices
        finally:
            dec.remote.shutdown()

    with ThreadPoolExecutor(devices) as pool:
        list(pool.map(device, range(devices)))
    ms = [r[1] for r in results if r[0]]
    errors = [r[2] for r in results if r[2]]
    return {"generations": len(results), "failures": sum(not r[0] for r in results), "errors": errors[:10],
            "connect_retries": len(retries),
            "ms_per_token_p50": _pct(ms, 50), "ms_per_token_p99": _pct(ms, 99)}


def _write(out: str, report: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--clients", default="16,64")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--profile", default="wifi")
    ap.add_argument("--drafter", default="lookup", help="the devices' drafter")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--idle-timeout", type=float, default=20.0, help="the target server's, to see sessions expire")
    ap.add_argument("--parts", default="api,devices")
    ap.add_argument("--out", default="bench-out/soak.json")
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    clients = [int(x) for x in a.clients.split(",")]
    seconds = int(a.minutes * 60)
    questions = load_tasks(list(TASKS), max(1, -(-a.prompts // len(TASKS))))[:a.prompts]
    texts = [q.turns[0][:600] for q in questions]
    env = {**os.environ, "MOASPEC_TOKEN": TOKEN, "MOASPEC_API_KEY": TOKEN, "MOASPEC_THREADS": "1"}
    report: dict = {"model": a.model, "weights": a.weights, "replicas": a.replicas, "profile": a.profile,
                    "minutes": a.minutes, "prompts": len(texts), "max_tokens": a.max_tokens, "phases": []}
    workdir = Path(tempfile.mkdtemp(prefix="moaspec-soak-"))
    servers: list[Server] = []
    sampling = threading.Event()

    def sampler() -> None:
        while not sampling.wait(1.0):
            for s in servers:
                s.sample()

    threading.Thread(target=sampler, daemon=True).start()
    try:
        if "api" in parts:
            api = Server(["serve", "--model", a.model, "--weights", a.weights, "--drafter", "suffix", "--replicas",
                          str(a.replicas), "--max-tokens", str(a.max_tokens), "--max-prompt-tokens", "1024",
                          "--parallel", "16", "--max-waiting", "256"], _free_port(), env)
            servers.append(api)
            answers = lone_api_answers(api.port, a.model, texts, a.max_tokens)
            expected = workdir / "expected.json"
            expected.write_text(json.dumps({"model": a.model, "max_tokens": a.max_tokens, "answers": answers}))
            with ShapingProxy(("127.0.0.1", api.port), profile=a.profile) as proxy:
                for n in clients:
                    api.peak = 0
                    row = {"part": "api", "clients": n, **api_phase(proxy.port, expected, n, seconds, workdir)}
                    row["peak_rss_mb"] = round(api.peak / 2**20)
                    report["phases"].append(row)
                    print(json.dumps(row), flush=True)
                    _write(a.out, report)
        if "devices" in parts:
            from moaspec.pipeline import SpecDecoder

            target = Server(["serve-target", "--model", a.model, "--weights", a.weights, "--replicas",
                             str(a.replicas), "--max-sessions", "256", "--max-connections", "256", "--idle-timeout",
                             str(a.idle_timeout), "--max-waiting", "256"], _free_port(), env)
            servers.append(target)
            lone = SpecDecoder(a.model, weights=a.weights, warmup=False)
            msgs = [[{"role": "user", "content": t}] for t in texts]
            want = [lone.generate(m, GenerationConfig(max_new_tokens=a.max_tokens)).token_ids for m in msgs]
            del lone
            with ShapingProxy(("127.0.0.1", target.port), profile=a.profile) as proxy:
                for n in clients:
                    target.peak = 0
                    row = {"part": "devices", "clients": n,
                           **device_phase(f"ws://127.0.0.1:{proxy.port}", a.model, a.drafter, msgs, want, n,
                                          seconds, a.max_tokens)}
                    row["peak_rss_mb"] = round(target.peak / 2**20)
                    time.sleep(a.idle_timeout + 5)  # sessions left open expire
                    row["rss_after_idle_mb"] = round(target.sample() / 2**20)
                    report["phases"].append(row)
                    print(json.dumps(row), flush=True)
                    _write(a.out, report)
    finally:
        sampling.set()
        for s in servers:
            s.close()
    _write(a.out, report)
    failed = sum(p["failures"] for p in report["phases"])
    print(f"{failed} failed of {sum(p.get('requests', p.get('generations', 0)) for p in report['phases'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
