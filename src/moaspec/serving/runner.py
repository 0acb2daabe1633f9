"""Running a server process: HTTP on a thread of its own, the batched passes on the main thread.

The main thread loaded the model; its passes stay there (`decoding.scheduler`: one OpenMP team in the
process), and uvicorn's event loop, which does no torch work, runs beside it. Ctrl-C and SIGTERM end
both; so does uvicorn stopping on its own (a port in use).
"""

from __future__ import annotations

import ipaddress
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from moaspec.decoding.scheduler import Scheduler
from moaspec.threads import one_thread

T = TypeVar("T")


async def in_worker(fn: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter) -> T:
    """`fn(*args)` in a worker thread whose torch work runs on that thread alone (`threads.one_thread`):
    a session's own work beside the passes, which keep the process's one OpenMP team."""
    def call() -> T:
        one_thread()
        return fn(*args)

    return await anyio.to_thread.run_sync(call, limiter=limiter)


def serve(app: Any, scheduler: Scheduler | None, **config: Any) -> None:
    """Serve `app` with uvicorn (`config`: its settings) until interrupted; `scheduler`, if it has no
    thread of its own, runs its passes on this thread meanwhile."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, **config))
    if scheduler is None or scheduler.has_thread:
        server.run()
        return

    def http() -> None:
        try:
            server.run()
        finally:
            scheduler.close()  # uvicorn stopped: so do the passes

    thread = threading.Thread(target=http, name="moaspec-http", daemon=True)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    thread.start()
    try:
        scheduler.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.should_exit = True
        thread.join(timeout=15)
        scheduler.close()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


MIN_KEY_CHARS = 16


def exposure_warnings(host: str, token: str | None, tls: bool) -> list[str]:
    """What a server about to listen on `host` should warn of: plaintext on a non-loopback address (the key
    and every prompt travel in clear), a key short enough to guess."""
    out = []
    if not is_loopback(host) and not tls:
        out.append(f"serving plaintext HTTP on {host}: the key and every prompt and answer cross the network in "
                   "clear; pass --ssl-certfile and --ssl-keyfile, or put a TLS proxy in front")
    if token is not None and len(token) < MIN_KEY_CHARS:
        out.append(f"the key has {len(token)} characters; use at least {MIN_KEY_CHARS} random ones "
                   "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return out


def warn_exposure(host: str, tokens: list[str | None], tls: bool) -> None:
    """Say `exposure_warnings` on stderr (and the log) before a server starts listening."""
    import logging
    import sys

    for warning in dict.fromkeys(w for token in tokens for w in exposure_warnings(host, token, tls)):
        logging.getLogger("moaspec.serve").warning(warning)
        print(f"warning: {warning}", file=sys.stderr, flush=True)
