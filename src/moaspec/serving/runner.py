"""Running a server process: HTTP on a thread of its own, the scheduler's loop on the main thread.

The main thread loaded the model; its passes stay there (`decoding.scheduler`: one OpenMP team in the
process), and uvicorn's event loop, which does no torch work, runs beside it. Ctrl-C and SIGTERM end
both; so does uvicorn stopping on its own (a port in use).
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from moaspec.decoding.scheduler import Scheduler
from moaspec.errors import UserError
from moaspec.flags import flagged
from moaspec.threads import one_thread

T = TypeVar("T")


async def in_worker(fn: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter) -> T:
    """`fn(*args)` in a worker thread whose torch work runs on that thread alone (`threads.one_thread`): work
    beside the scheduler's loop (tokenizing, forking a decoder), which keeps the process's one OpenMP team."""
    def call() -> T:
        one_thread()
        return fn(*args)

    return await anyio.to_thread.run_sync(call, limiter=limiter)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may take before it sends a whole request: uvicorn times out none of it, so a
    client that trickles its headers (or a body) holds a connection, a descriptor and a place forever."""

    header_timeout_s: float = flagged(10.0, "--header-timeout", "a connection whose request headers are not all "
                                      "in by then is closed (slow clients hold no place)", metavar="S")
    body_timeout_s: float = flagged(60.0, "--body-timeout", "likewise for a request's body, from its headers",
                                    metavar="S")
    # WebSockets, once upgraded, are the server's
    per_client: int = flagged(64, "--max-client-connections", "open HTTP connections from one address; beyond, 503")

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise UserError(f"{name} must be a number > 0, got {value!r}")
        if not (isinstance(self.per_client, int) and self.per_client >= 1):
            raise UserError(f"per_client must be an integer >= 1, got {self.per_client!r}")


def guarded_http(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol with `limits`: a request whose headers or body come too slowly, or a client past its
    connection count, is cut off (the connection closed; over the count, after a 503). One class per server: the
    per-client counts are its own."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_by_client: dict[str, int] = {}

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_for: str | None = None  # "headers", "body", or None: the app has the request
        _counted: str | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            ip = self.client[0] if self.client else "?"
            if open_by_client.get(ip, 0) >= limits.per_client:
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
                                b"connection: close\r\ncontent-length: 27\r\n\r\ntoo many connections from you")
                transport.close()
                return
            open_by_client[ip] = open_by_client.get(ip, 0) + 1
            self._counted = ip
            self._arm("headers")

        def _arm(self, phase: str | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._waiting_for = phase
            seconds = {"headers": limits.header_timeout_s, "body": limits.body_timeout_s}.get(phase or "")
            self._deadline = None if seconds is None else self.loop.call_later(seconds, self._too_slow)

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def _uncount(self) -> None:
            if self._counted is not None:
                left = open_by_client.get(self._counted, 1) - 1
                if left > 0:
                    open_by_client[self._counted] = left
                else:
                    open_by_client.pop(self._counted, None)
                self._counted = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.SEND_BODY and self._waiting_for == "headers":  # now the body's deadline
                self._arm("body")
            elif state is not h11.IDLE and state is not h11.SEND_BODY and self._waiting_for:  # the app's turn
                self._arm(None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm("headers")  # the next request on this connection

        def handle_websocket_upgrade(self, event) -> None:
            self._arm(None)
            self._uncount()
            super().handle_websocket_upgrade(event)

        def connection_lost(self, exc: Exception | None) -> None:
            self._arm(None)
            self._uncount()
            super().connection_lost(exc)

    return Guarded


def serve(app: Any, scheduler: Scheduler | None, connections: ConnectionLimits | None = None, **config: Any) -> None:
    """Serve `app` with uvicorn (`config`: its settings) until interrupted, each connection held to `connections`;
    `scheduler`, if it has no thread of its own, runs its passes on this thread meanwhile."""
    import uvicorn

    config.setdefault("http", guarded_http(connections or ConnectionLimits()))
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
