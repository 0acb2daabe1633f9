"""Faults injected at random moments, many times each: `python -m experiments.faults`.

Client-server (a `moaspec serve-target` process, SmolLM2 int8, a device in this process with the lookup
drafter and the policy "correct": tokens written alone are replaced by the target's once it is back):
- server-kill: the server process is SIGKILLed after a random number of calls and restarted after a random
  pause; promise: the final text is the target's greedy text, every token verified.
- link-cut: the link resets every connection at a random moment; same promise.
- link-stall: the link delivers nothing (a blackhole) for a random 1-4 s; same promise.
- client-kill: a device process is SIGKILLed mid-generation; promise: the server frees the generation's
  memory and session within FREE_BOUND_S (read from its /metrics).
- other-weights: the server is killed and comes back in other weights (fp16 for int8); promise: the device
  refuses it with a clear error, never mixes the two targets' tokens.
- replica-kill (`--faults replica-kill`, slower: Ray): the replica serving the device is SIGKILLed; promise:
  the text is the target's greedy text.
Jobs (SmolLM2, tiny settings):
- data-kill / train-kill: `moaspec data` / `moaspec train` get SIGTERM or SIGKILL at a random moment and
  are run again to the end; promise: every shard and checkpoint reads back whole, no sequence twice, the
  goal reached; a killed training run resumed from its last save ends with the weights of a run never
  stopped.
- disk-full: the same jobs with the file size capped (RLIMIT_FSIZE, the way a full disk fails a write),
  then run again without the cap; promise: a clear error, nothing half-written read as whole, and the
  rerun reaches the goal.
Every run's outcome is written to --out; the summary counts runs and failures per fault.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path

from experiments.network import _free_port
from experiments.shaping import ShapingProxy
from moaspec.decoding.engine import GenerationConfig
from moaspec.errors import UserError

MODEL = "smollm2-135m"
TOKEN = "moaspec-faults"
PROMPT = "Write a Python function that returns the squares of a list of numbers, with a docstring."
FREE_BOUND_S = 5.0  # the stated time within which a killed client's memory and session are freed
CS_FAULTS = ("server-kill", "link-cut", "link-stall", "client-kill", "other-weights")
JOB_FAULTS = ("data-kill", "train-kill", "disk-full")


def _env() -> dict[str, str]:
    return {**os.environ, "MOASPEC_THREADS": "1", "MOASPEC_TOKEN": TOKEN, "RAY_DEDUP_LOGS": "0"}


class TargetProcess:
    def __init__(self, port: int, weights: str = "int8", extra: list[str] | None = None):
        self.port = port
        cmd = [sys.executable, "-m", "moaspec", "serve-target", "--model", MODEL, "--weights", weights, "--port",
               str(port), "--max-context", "1024", "--max-prompt-tokens", "512", *(extra or [])]
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 180
        while not self.healthy():
            if self.proc.poll() is not None:
                raise UserError(f"serve-target exited: {self.proc.stderr.read().decode()[-1500:]}")
            if time.time() > deadline:
                self.kill()
                raise UserError("serve-target did not come up in 180 s")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/metrics",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            lines = r.read().decode().splitlines()
        return {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln and not ln.startswith("#")}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def _device(url: str, timeout_s: float = 5.0):
    from moaspec.pipeline import SpecDecoder

    return SpecDecoder(MODEL, drafter="lookup", target_url=url, token=TOKEN, warmup=False, target_timeout_s=timeout_s)


def _at_call(device, k: int, action: Callable[[], None]) -> threading.Thread:
    """Run `action` once the device has made `k` calls to the server (a random moment of its generation)."""

    def wait() -> None:
        while device.remote.calls < k:
            time.sleep(0.002)
        action()

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def _same_text(device, want: list[int], cfg: GenerationConfig) -> dict:
    gen = device.generate(PROMPT, cfg)
    m = gen.metrics
    return {"ok": gen.token_ids == want and m.unverified_in_output == 0, "tokens": len(gen.token_ids),
            "unverified_written": m.unverified_tokens, "reconnects": m.reconnects}


def run_cs(fault: str, rng: random.Random, want: list[int], cfg: GenerationConfig, port: int,
           server: list[TargetProcess]) -> dict:
    """One client-server fault; `server[0]` is the live server (replaced when a fault restarts it)."""
    k = rng.randint(2, 12)
    if fault in ("server-kill", "other-weights"):
        weights = "fp16" if fault == "other-weights" else "int8"
        pause = rng.uniform(0.2, 2.0)
        device = _device(f"ws://127.0.0.1:{port}")

        def restart() -> None:
            server[0].kill()
            time.sleep(pause)
            server[0] = TargetProcess(port, weights)

        t = _at_call(device, k, restart)
        try:
            out = _same_text(device, want, cfg)
            if fault == "other-weights":  # it must not have taken the fp16 server's tokens
                out = {"ok": False, "why": "no refusal", **out}
        except UserError as e:
            out = {"ok": fault == "other-weights" and "weights" in str(e), "error": str(e)[:160]}
        t.join()
        device.remote.shutdown()
        if fault == "other-weights":  # back to the int8 server for the next runs
            server[0].kill()
            server[0] = TargetProcess(port)
        return {"at_call": k, "pause_s": round(pause, 2), **out}
    if fault in ("link-cut", "link-stall"):
        with ShapingProxy(("127.0.0.1", port), profile="lan") as proxy:
            device = _device(f"ws://127.0.0.1:{proxy.port}", timeout_s=1.5)
            stall = rng.uniform(1.0, 4.0)
            action = proxy.cut if fault == "link-cut" else \
                (lambda: proxy.down("blackhole", duration_s=stall))
            t = _at_call(device, k, action)
            out = _same_text(device, want, cfg)
            t.join()
            device.remote.shutdown()
        return {"at_call": k, **({"stall_s": round(stall, 2)} if fault == "link-stall" else {}), **out}
    if fault == "client-kill":
        script = ("import sys; from moaspec.pipeline import SpecDecoder; from moaspec.decoding.engine import "
                  "GenerationConfig as G; d = SpecDecoder(sys.argv[1], drafter='lookup', target_url=sys.argv[2], "
                  "token=sys.argv[3], warmup=False); print('up', flush=True); "
                  "d.generate(sys.argv[4], G(max_new_tokens=400, ignore_eos=True))")
        proc = subprocess.Popen([sys.executable, "-c", script, MODEL, f"ws://127.0.0.1:{port}", TOKEN, PROMPT],
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        proc.stdout.readline()
        busy_until = time.time() + 30
        while server[0].metrics().get("moaspec_kv_reserved_bytes", 0) == 0 and time.time() < busy_until:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.1, 1.5))  # mid-generation
        held = server[0].metrics()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.time()
        while time.time() - t0 < 30:
            m = server[0].metrics()
            if m.get("moaspec_kv_reserved_bytes", 1) == 0 and m.get("moaspec_sessions", 1) == 0:
                break
            time.sleep(0.02)
        freed = time.time() - t0
        return {"ok": held.get("moaspec_kv_reserved_bytes", 0) > 0 and freed <= FREE_BOUND_S,
                "held_bytes": held.get("moaspec_kv_reserved_bytes", 0), "freed_after_s": round(freed, 2)}
    raise ValueError(fault)


def run_replica_kill(rng: random.Random, want: list[int], cfg: GenerationConfig, url: str) -> dict:
    device = _device(url)
    first = device.remote.info["instance"]
    k = rng.randint(2, 12)
    t = _at_call(device, k, lambda: os.kill(int(first.rsplit(":", 1)[1]), signal.SIGKILL))
    out = _same_text(device, want, cfg)
    t.join()
    out["moved"] = device.remote.info.get("instance") != first
    out["ok"] = out["ok"] and out["moved"]
    device.remote.shutdown()
    return {"at_call": k, **out}


# ------------------------------------------------------------------------------------------ jobs
def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _job(cmd: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moaspec", *cmd], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, **kw)


def _data_cmd(out: Path) -> list[str]:
    return ["data", "--model", MODEL, "--tokens", "4000", "--text-fraction", "0.5", "--prompts", "60",
            "--max-new-tokens", "16", "--engine", "transformers", "--parallel", "4", "--out", str(out)]


def _data_ok(out: Path, goal: int = 4000) -> dict:
    from moaspec.training import data as D

    folder = next(out.glob("*-v*-seed0"))
    rows = D.load(folder)  # raises on a shard that does not read whole
    ids = [r.id for r in rows]
    tokens = sum(len(r.ids) for r in rows)
    leftovers = [p.name for p in folder.iterdir() if ".tmp" in p.name]
    return {"ok": len(ids) == len(set(ids)) and tokens >= goal and not leftovers, "sequences": len(ids),
            "tokens": tokens, "leftover_tmp": leftovers}


def _train_cmd(data: Path, out: Path) -> list[str]:
    return ["train", "--model", MODEL, "--data", str(data), "--out", str(out), "--steps", "24", "--batch-size", "2",
            "--max-len", "96", "--vocab", "2048", "--tli", "0"]


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "moa" / "model.safetensors"))


class References:
    """The jobs' references, built on first use: a small data set (with validation sequences) for the
    training job, and the weights of a training run never stopped."""

    def __init__(self, work: Path):
        self.work = work
        self._data: Path | None = None
        self._weights: dict | None = None

    @property
    def data(self) -> Path:
        if self._data is None:
            from moaspec.training import data as D

            cfg = D.DataConfig(model=MODEL, tokens=4000, prompts=60, max_new_tokens=16, engine="transformers",
                               parallel=4, val_fraction=0.25)
            D.Builder(cfg, self.work / "ref-data").run()
            self._data = self.work / "ref-data" / cfg.folder_name()
        return self._data

    @property
    def weights(self) -> dict:
        if self._weights is None:
            subprocess.run([sys.executable, "-m", "moaspec", *_train_cmd(self.data, self.work / "ref-run")],
                           env=_env(), check=True, stdout=subprocess.DEVNULL)
            self._weights = _weights(self.work / "ref-run")
        return self._weights


def run_job(fault: str, rng: random.Random, work: Path, refs: References) -> dict:
    job = rng.choice(["data", "train"]) if fault == "disk-full" else fault.split("-")[0]
    folder = Path(tempfile.mkdtemp(dir=work))
    cmd = _data_cmd(folder / "data") if job == "data" else _train_cmd(refs.data, folder / "run")
    if fault == "disk-full":
        cap = rng.randint(500, 20_000) if job == "data" else rng.randint(100_000, 4_000_000)  # hit mid-write
        first = _job(cmd, preexec_fn=_limit_file_size(cap))
        rc = first.wait(600)
        err = first.stderr.read().decode()
        clear = rc != 0 and ("File too large" in err or "No space" in err or "disk" in err.lower())
        out = {"job": job, "cap_bytes": cap, "first_rc": rc, "clear_error": clear or rc == 0,
               "message": err.strip().splitlines()[-1][:160] if err.strip() else ""}
    else:
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        delay = rng.uniform(2.0, 12.0 if job == "data" else 20.0)
        first = _job(cmd)
        try:
            first.wait(delay)
        except subprocess.TimeoutExpired:
            first.send_signal(sig)
            first.wait(300)
        out = {"job": job, "signal": sig.name, "after_s": round(delay, 1), "first_rc": first.returncode}
    second = _job(cmd)
    rc = second.wait(900)
    out["resume_rc"] = rc
    if rc != 0:
        out.update(ok=False, resume_error=second.stderr.read().decode()[-300:])
        return out
    if job == "data":
        out.update(_data_ok(folder / "data"))
    else:
        import torch

        got, want = _weights(folder / "run"), refs.weights
        same = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        history = [json.loads(x)["step"] for x in (folder / "run" / "history.jsonl").read_text().splitlines()
                   if x.strip() and "step" in json.loads(x)] if (folder / "run" / "history.jsonl").exists() else []
        out.update(ok=same, same_weights_as_a_run_never_stopped=same, history_steps_unique=len(history) == len(
            set(history)))
    if fault == "disk-full":
        out["ok"] = out["ok"] and out["clear_error"]
    shutil.rmtree(folder, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.faults", description=__doc__.splitlines()[0])
    ap.add_argument("--faults", default=",".join(CS_FAULTS + JOB_FAULTS),
                    help=f"among {', '.join(CS_FAULTS + JOB_FAULTS + ('replica-kill',))}")
    ap.add_argument("--runs", type=int, default=10, help="runs of each fault")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/faults.json")
    a = ap.parse_args(argv)
    faults = [f for f in a.faults.split(",") if f]
    unknown = set(faults) - set(CS_FAULTS + JOB_FAULTS + ("replica-kill",))
    if unknown:
        raise UserError(f"unknown faults: {', '.join(sorted(unknown))}")
    rng = random.Random(a.seed)
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, reconnect_timeout_s=120)
    results: dict[str, list[dict]] = {f: [] for f in faults}
    work = Path(tempfile.mkdtemp(prefix="moaspec-faults-"))

    def record(fault: str, fn: Callable[[], dict]) -> None:
        try:
            row = fn()
        except Exception as e:  # an unexpected failure is a failed run, written down
            row = {"ok": False, "exception": f"{type(e).__name__}: {e}"[:300], "trace": traceback.format_exc()[-800:]}
        results[fault].append(row)
        print(fault, json.dumps(row), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(summary(results) | {"runs": results}, indent=1) + "\n")

    try:
        cs = [f for f in faults if f in CS_FAULTS]
        if cs or "replica-kill" in faults:
            from moaspec.pipeline import SpecDecoder

            want = SpecDecoder(MODEL, weights="int8", warmup=False).generate(PROMPT, cfg).token_ids
        if cs:
            port = _free_port()
            server = [TargetProcess(port)]
            try:
                for _ in range(a.runs):
                    for f in cs:
                        record(f, lambda f=f: run_cs(f, rng, want, cfg, port, server))
            finally:
                server[0].kill()
        if "replica-kill" in faults:
            port = _free_port()
            proc = subprocess.Popen([sys.executable, "-m", "moaspec", "serve-target", "--model", MODEL, "--weights",
                                     "int8", "--replicas", "2", "--port", str(port), "--max-context", "1024",
                                     "--max-prompt-tokens", "512"],
                                    env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                time.sleep(5)
                probe = TargetProcess.__new__(TargetProcess)
                probe.port = port
                deadline = time.time() + 240
                while not probe.healthy() and time.time() < deadline:
                    time.sleep(1)
                for _ in range(a.runs):
                    record("replica-kill", lambda: run_replica_kill(rng, want, cfg, f"ws://127.0.0.1:{port}"))
                    time.sleep(5)  # Ray Serve replaces the replica
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(90)
                except subprocess.TimeoutExpired:
                    proc.kill()
        jobs = [f for f in faults if f in JOB_FAULTS]
        refs = References(work)
        for _ in range(a.runs):
            for f in jobs:
                record(f, lambda f=f: run_job(f, rng, work, refs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = summary(results)
    print(json.dumps(s, indent=1))
    return 1 if any(v["failed"] for v in s["summary"].values()) else 0


def summary(results: dict[str, list[dict]]) -> dict:
    return {"summary": {f: {"runs": len(rows), "failed": sum(not r.get("ok") for r in rows)}
                        for f, rows in results.items()}}


if __name__ == "__main__":
    raise SystemExit(main())
