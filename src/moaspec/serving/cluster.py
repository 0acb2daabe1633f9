"""Scale-out on Ray Serve: `moaspec serve --replicas N` and `moaspec serve-target --replicas N`.

Each replica is a Ray actor process that builds the same server the single-process commands run (its
own model copy, scheduler and KV caches: `builder` is evaluated on the replica) behind Ray Serve's
HTTP/WebSocket proxy on one address. Ray Serve spreads new requests and new WebSocket sessions over the
live replicas (power of two choices on their queue lengths); a WebSocket session stays on its replica for
its life, and when a replica dies its clients reconnect through the same address, land on another
replica and re-verify there (`RemoteTarget`'s resume path), while Ray Serve starts a replacement.

On a replica the batched passes run on a thread of their own (the actor's main thread belongs to Ray),
which costs about 1.5x per pass on few cores (see `serving.runner`); one replica per machine, or per
`--replica-cpus` group of cores, keeps that cost down. `ray start --head` on one machine and `ray start
--address HEAD:6379` on the others make a cluster; `--ray-address auto` joins it, without it a local
Ray is started for this command.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from moaspec.errors import UserError

APP_NAME = "moaspec"


def _ingress(builder: Callable[[], Any], threads: int) -> Callable[[], Any]:
    """The ASGI app a replica serves: `builder()` with torch on `threads` threads."""

    def build() -> Any:
        import torch

        torch.set_num_threads(threads)
        torch.set_grad_enabled(False)
        return builder()

    return build


class Replica:
    """A replica's deployment class (Ray Serve puts the ASGI app in `_asgi_app`). Ray calls `check_health`
    every few seconds: a replica whose batched passes stopped is replaced, not left hanging its requests."""

    def check_health(self) -> None:
        state = getattr(getattr(self, "_asgi_app", None), "state", None)
        scheduler = getattr(state, "scheduler", None)
        if scheduler is not None:
            scheduler.check_health()


def secure_ray(ray_address: str | None) -> None:
    """Ray's control plane (job submission: any shell command) is open to whoever reaches its ports unless token
    authentication is on, and Ray 2.60's gRPC servers listen on every interface whatever the node address. A Ray
    this command starts therefore runs with RAY_AUTH_MODE=token and a fresh random token (kept in this process
    tree's environment), on the loopback node address; joining a cluster without token authentication is warned
    of. Setting RAY_AUTH_MODE=disabled yourself turns it off, with a warning."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if ray_address is None and mode is None:
        os.environ["RAY_AUTH_MODE"] = "token"
        if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_urlsafe(32)
    elif os.environ.get("RAY_AUTH_MODE") != "token":
        where = f"the Ray cluster at {ray_address}" if ray_address else "the local Ray"
        warning = (f"{where} runs without token authentication: anyone who reaches its ports can run commands on "
                   "it; start it with RAY_AUTH_MODE=token (docs/scale-out.md)")
        logging.getLogger("moaspec.serve").warning(warning)
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def run(builder: Callable[[], Any], name: str, replicas: int, host: str, port: int, replica_cpus: float = 1.0,
        ray_address: str | None = None, max_ongoing_requests: int = 64, block: bool = True) -> None:
    """Deploy `replicas` copies of the app `builder` makes (a picklable callable, evaluated on each replica)
    as the Ray Serve application of this command, its proxy on `host:port`; with `block`, until SIGINT or
    SIGTERM, then shut Serve down."""
    if replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {replicas}")
    secure_ray(ray_address)  # before Ray is imported: it reads its authentication settings then
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UserError("scale-out needs Ray Serve: pip install 'ray[serve]==2.60.0' (make setup installs it)") \
            from None
    env = {k: v for k, v in os.environ.items() if k.startswith("MOASPEC_")}  # tokens, cache folder, threads
    env["OMP_NUM_THREADS"] = str(max(1, int(replica_cpus)))
    ray.init(address=ray_address, include_dashboard=False, logging_level="warning", ignore_reinit_error=True,
             runtime_env={"env_vars": env}, **({"_node_ip_address": "127.0.0.1"} if ray_address is None else {}))
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    deployment = serve.deployment(
        serve.ingress(_ingress(builder, max(1, int(replica_cpus))))(Replica), name=name, num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus}, max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5)
    serve.run(deployment.bind(), name=APP_NAME, route_prefix="/", blocking=False)
    if not block:
        return
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    finally:
        if ray_address is not None:  # a cluster others may use: take only this application down
            serve.delete(APP_NAME)
        ray.shutdown()  # a Ray this command started goes down with its actors
