"""Scale-out on Ray Serve with real processes: two replicas of the target server behind one address; the
replica serving a device's session is killed mid-generation, the device reconnects through the same
address to the other replica, re-verifies there, and its text is the target's own greedy text."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

from experiments.soak import Server
from moaspec.decoding.engine import GenerationConfig

SMOL = "smollm2-135m"
TOKEN = "cluster-token"

pytest.importorskip("ray.serve", reason="scale-out needs ray[serve] (make setup installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("cluster") / "tokens"
    tokens.write_text(TOKEN + "\n")
    port = _free_port()
    env = {**os.environ, "MOASPEC_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    server = Server(["serve-target", "--model", SMOL, "--weights", "int8", "--replicas", "2", "--token-file",
                     str(tokens), "--max-context", "512", "--max-prompt-tokens", "256"], port, env)
    yield f"ws://127.0.0.1:{port}"
    server.close()


@pytest.mark.slow  # two Ray replicas started and one killed: ~50 s
def test_a_killed_replica_hands_its_devices_to_the_other(replicas):
    from moaspec.pipeline import SpecDecoder

    prompt = "Write a Python function that returns the squares of a list of numbers."
    cfg = GenerationConfig(max_new_tokens=64, reconnect_timeout_s=120)
    want = SpecDecoder(SMOL, weights="int8", warmup=False).generate(prompt, cfg).token_ids

    device = SpecDecoder(SMOL, drafter="lookup", target_url=replicas, token=TOKEN, warmup=False,
                         target_timeout_s=10)
    instances, deadline = set(), time.time() + 30
    while len(instances) < 2 and time.time() < deadline:  # sessions spread over the replicas once both are up
        probe = SpecDecoder(SMOL, drafter="none", target_url=replicas, token=TOKEN, warmup=False)
        instances.add(probe.remote.info["instance"])
        probe.remote.shutdown()
    # (with one replica up so far, the device waits for Ray Serve's replacement instead: the promise is the same)

    first = device.remote.info["instance"]
    killed = threading.Event()

    def kill_mid_generation() -> None:
        while device.remote.calls < 6:
            time.sleep(0.005)
        os.kill(int(first.rsplit(":", 1)[1]), signal.SIGKILL)  # the replica serving this device
        killed.set()

    threading.Thread(target=kill_mid_generation, daemon=True).start()
    got = device.generate(prompt, cfg)
    assert killed.is_set() and got.finish_reason in ("stop", "length")
    assert got.token_ids == want
    assert device.remote.info["instance"] != first  # it re-verified on the other replica
    assert device.engine.metrics.unverified_in_output == 0
    device.remote.shutdown()


@pytest.mark.slow  # ~85 s
def test_soak_short(tmp_path):
    """The load test in short (`python -m experiments.soak` runs it for minutes): 4 API users and 4
    devices against two replicas each, through a shaped link; every answer is its lone answer."""
    from experiments import soak

    out = tmp_path / "soak.json"
    rc = soak.main(["--clients", "4", "--minutes", "0.15", "--prompts", "3", "--max-tokens", "12", "--replicas", "2",
                    "--idle-timeout", "3", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert [p["part"] for p in report["phases"]] == ["api", "devices"]
    api, devices = report["phases"]
    assert api["requests"] > 4 and api["failures"] == 0 and api["p99_ms"] >= api["p50_ms"] > 0
    assert devices["generations"] >= 4 and devices["failures"] == 0


@pytest.mark.slow  # the Ray of `--replicas`: its proxy, its GCS's token; one refused connection (~20 s)
def test_the_ray_it_starts_needs_a_token_and_its_proxy_listens_on_loopback(replicas):
    """Found in review: `--replicas` started a Ray whose control plane (job submission: any shell command) took
    anyone on the network. Now that Ray runs with token authentication (a fresh token in the command's process
    tree): a client without it cannot join; the proxy listens where --host says (loopback here)."""
    import subprocess
    import sys
    from pathlib import Path

    port = int(replicas.rsplit(":", 1)[1])
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    proxy = [line.split()[3] for line in listening if line.split()[3].endswith(f":{port}")]
    assert proxy and all(a.startswith("127.0.0.1:") for a in proxy), proxy
    gcs = [line for line in listening if "gcs_server" in line]
    pid = int(gcs[0].split("pid=")[1].split(",")[0])
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"RAY_AUTH_MODE=token" in env and any(e.startswith(b"RAY_AUTH_TOKEN=") and len(e) > 30 for e in env)
    address = "127.0.0.1:" + gcs[0].split()[3].rsplit(":", 1)[1]
    outsider = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    token = next(e for e in env if e.startswith(b"RAY_AUTH_TOKEN=")).split(b"=", 1)[1].decode()

    def join(extra: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={address!r}, "
                               "logging_level='error'); print('JOINED')"], env={**outsider, **extra},
                              capture_output=True, text=True, timeout=120)

    assert "JOINED" in join({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}).stdout  # the address is right
    refused = join({})
    assert refused.returncode != 0 and "JOINED" not in refused.stdout
    # refused for the token (Ray's AuthenticationError from the GCS), not for any other failure to join
    assert "ray.exceptions.AuthenticationError" in refused.stderr, refused.stderr[-3000:]
    assert "InvalidAuthToken: Authentication token is missing or incorrect" in refused.stderr, refused.stderr[-3000:]
