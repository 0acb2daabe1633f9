"""`moaspec serve-target`: the target model behind a WebSocket, verifying draft trees for remote drafters.

Why WebSockets on ASGI (FastAPI + uvicorn): a session lives exactly as long as its connection (the
target's KV cache is freed when the client goes away), a round is one small binary frame each way
with a few bytes of framing and no per-request headers, the bearer token is checked once in the
handshake, and the same stack serves the OpenAI-compatible HTTP API. gRPC would do too, at the cost
of generated stubs and an HTTP/2 stack that the shaping proxy and the API do not need.

One set of weights serves every session; each session has its own KV cache (`KVCache`) and sampling
state. Sessions' passes run together: a `Scheduler` stacks the waiting prompt chunks and draft trees of
all sessions into one forward pass (continuous batching; each session's logits are the bits of a pass
alone, so batching changes no token). A generation reserves the KV memory its prompt and
max_new_tokens can fill (`Admission`); one that does not fit waits in a bounded queue and hears so
("queued"), past that it is told to retry ("busy"), never refused for good. Every message is checked
(`link.protocol`) and bounded (`Limits`); a bad one gets an error frame, never a crash; a client can
only reach its own session, since a session is its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request, Response, WebSocket, WebSocketDisconnect

from moaspec.decoding.context import WIRE_DTYPES
from moaspec.decoding.context import encode as encode_context
from moaspec.decoding.prefix_cache import PrefixCache
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.scheduler import Scheduler
from moaspec.decoding.target import ContextEncoder, LocalTarget, Step
from moaspec.drafters import TRAINED, drafter_kind, drafter_spec, shipped_checkpoint
from moaspec.drafters.trained import encoder_id
from moaspec.errors import UserError
from moaspec.link.protocol import (
    ENDPOINT,
    Busy,
    Limits,
    ProtocolError,
    check_prompt,
    pack,
    sampling_from_wire,
    tree_from_wire,
    unpack,
)
from moaspec.models.runtime import KVCache, Transformer
from moaspec.serving.admission import Admission
from moaspec.serving.metrics import Rate, ServerCollector, exposition, prefix_gauges, registry
from moaspec.serving.runner import ConnectionLimits, warn_exposure
from moaspec.serving.runner import serve as run

log = logging.getLogger("moaspec.serve")


@dataclass
class Stats:
    """What the server has done, for /health and the benchmarks."""

    sessions_opened: int = 0
    sessions_open: int = 0
    calls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    by_token: Counter = field(default_factory=Counter)


def load_encoders(model: Transformer, name: str, fingerprint: str,
                  folders: dict[str, Path] | None = None) -> dict[str, ContextEncoder]:
    """The target-side encoders this server offers, by `encoder_id`: the given checkpoint folders
    (label -> folder), or every trained drafter shipped for the target."""
    if folders is None:
        folders = {k: shipped_checkpoint(k, name) for k in TRAINED}
        folders.update({f"moa-n{n}": shipped_checkpoint(f"moa-n{n}", name) for n in (1, 3)})
        folders = {k: f for k, f in folders.items() if (f / "config.json").exists()}
    out: dict[str, ContextEncoder] = {}
    for label, folder in folders.items():
        encoder = drafter_spec(drafter_kind(label)).load_encoder(folder, model, name, fingerprint)
        if encoder is not None:  # None: a drafter that needs token ids only (independent)
            out[encoder_id(encoder)] = encoder
    return out


class Session:
    """One client's generation state: its own KV cache over the shared weights, sized by its request."""

    def __init__(self, server: TargetServer, token: str = ""):
        self.server = server
        self.token = token  # whose share of the KV budget its generations draw on
        self.target: LocalTarget | None = None
        self.cache: KVCache | None = None
        self.reserved: tuple[int, float] | None = None  # (bytes, granted at) of the generation in progress
        self.wire = "fp16"

    def plan(self, header: dict[str, Any]) -> tuple[list[int], SamplingParams, ContextEncoder | None, int]:
        """Check a start message: (prompt, sampling, encoder, the cache slots the generation may fill)."""
        srv = self.server
        prompt = check_prompt(header, srv.model.cfg.vocab_size, srv.limits)
        params = sampling_from_wire(header.get("sampling", {}))
        wire = header.get("wire", "fp16")
        if wire not in WIRE_DTYPES:
            raise ProtocolError(f"unknown wire dtype {wire!r}; choose one of {', '.join(WIRE_DTYPES)}")
        encoder = None
        if header.get("encoder") is not None:
            eid = header["encoder"]
            if not isinstance(eid, str) or eid not in srv.encoders:
                raise ProtocolError(f"this server has no encoder {eid!r} for its target; it has "
                                    f"{', '.join(srv.encoders) or 'none'} (use a drafter checkpoint the server "
                                    "loads, or a token-only drafter)")
            encoder = srv.encoders[eid]
        limit = srv.limits.max_seq_len
        new = header.get("max_new_tokens")
        if new is not None and (type(new) is not int or new < 1):
            raise ProtocolError("'max_new_tokens' must be a positive integer")
        slots = limit if new is None else min(limit, len(prompt) + new + srv.limits.max_tree_tokens)
        self.wire = wire
        return prompt, params, encoder, slots

    def start(self, prompt: list[int], params: SamplingParams, encoder: ContextEncoder | None, slots: int) -> Step:
        srv = self.server
        self.cache = srv.model.new_cache(slots)
        self.target = LocalTarget(srv.model, encoder, cache=self.cache, scheduler=srv.scheduler, prefix=srv.prefix)
        return self.target.start(prompt, params)

    def verify(self, header: dict[str, Any]) -> Step:
        if self.target is None:
            raise ProtocolError("verify before start: send a 'start' message first")
        tree = tree_from_wire(header, self.server.model.cfg.vocab_size, self.server.limits)
        if self.cache.length + len(tree) > self.cache.size:
            raise ProtocolError(f"the session's context is full ({self.cache.length} + {len(tree)} tokens > "
                                f"{self.cache.size}): start a new generation")
        return self.target.verify(tree)

    def end(self) -> None:
        """The generation is over: its cache goes, its reservation returns to the server."""
        if self.target is not None:
            self.target.release()
        self.target = None
        if self.cache is not None:
            # kept for this session's next turn or, after a reconnect, its next session (within the budget)
            if self.server.prefix is not None:
                self.server.prefix.put(self.server.model, self.cache)
            else:
                self.cache.release()
            self.cache = None
        if self.reserved is not None:
            self.server.admission.release(*self.reserved)
            self.server.held_by_token[self.token] -= self.reserved[0]
            self.reserved = None

    def reply(self, step: Step) -> bytes:
        v = step.verdict
        self.server.tokens.add(len(v.new_tokens))
        body = encode_context(step.context, self.wire) if step.context is not None else b""
        return pack({"type": "step", "path": v.path, "accepted": v.accepted, "bonus": v.bonus,
                     "length": step.length, "target_ms": round(step.target_ms, 3), "cached": step.cached}, body)


class TargetServer:
    """The target model, its encoders, the limits and the bearer tokens, served as an ASGI app."""

    def __init__(self, model: Transformer, name: str, fingerprint: str, token: str | list[str],
                 encoders: dict[str, ContextEncoder] | None = None, limits: Limits | None = None,
                 pass_costs: dict[int, float] | None = None, scheduler_thread: bool = True):
        """`scheduler_thread`: run the batched passes on a thread of their own (in-process use, tests);
        False: on the thread that calls `serve` (the CLI's main thread, which loaded the model)."""
        tokens = [token] if isinstance(token, str) else list(token)
        if not tokens or not all(tokens):
            raise UserError("the target server needs a bearer token: pass --token-file or set MOASPEC_TOKEN")
        self.model, self.name, self.fingerprint, self.tokens_allowed = model, name, fingerprint, tokens
        self.encoders = encoders or {}
        self.limits = limits or Limits()
        if self.limits.max_seq_len > model.max_seq_len:
            raise UserError(f"max_seq_len {self.limits.max_seq_len} exceeds the model's context {model.max_seq_len}")
        self.pass_costs = pass_costs or {}
        self.stats = Stats()
        self.scheduler = Scheduler(model, self.limits.max_batch_rows, self.limits.gather_ms,
                                   own_thread=scheduler_thread)
        self.admission = Admission(self.limits.kv_memory_mb << 20, self.limits.max_waiting)
        self.held_by_token: Counter = Counter()  # KV bytes each token's generations reserved (or wait for)
        self.prefix = PrefixCache(self.limits.cache_ram_mb << 20) if self.limits.cache_ram_mb else None
        self.tokens = Rate()
        self.registry = registry(ServerCollector(self.scheduler, self.tokens, self._gauges))
        self.app = self._build_app()

    def _gauges(self) -> dict[str, tuple[str, float]]:
        a = self.admission
        return {"moaspec_sessions": ("open sessions (connections)", self.stats.sessions_open),
                "moaspec_generations": ("generations in progress (holding memory)", a.holders),
                "moaspec_generations_waiting": ("generations waiting for memory", a.waiting),
                "moaspec_kv_reserved_bytes": ("KV-cache memory reserved by generations", a.used),
                "moaspec_kv_budget_bytes": ("KV-cache memory for generations", a.budget),
                **prefix_gauges(self.prefix)}

    def close(self) -> None:
        self.scheduler.close()
        if self.prefix is not None:
            self.prefix.clear()

    def ready(self) -> dict[str, Any]:
        return {"type": "ready", "model": self.name, "fingerprint": self.fingerprint, "weights": self.model.weights,
                "max_seq_len": self.limits.max_seq_len, "eos": list(self.model.cfg.eos_token_ids),
                "vocab_size": self.model.cfg.vocab_size,
                "pass_costs": {str(k): v for k, v in self.pass_costs.items()},
                "encoders": sorted(self.encoders), "limits": asdict(self.limits),
                "instance": f"{socket.gethostname()}:{os.getpid()}"}  # which process (a replica, behind a proxy)

    def authorised(self, header: str | None) -> str | None:
        """The token of a valid `Authorization: Bearer <token>` header, else None."""
        if not header or not header.startswith("Bearer "):
            return None
        given = header[len("Bearer "):].strip().encode()
        ok = [t for t in self.tokens_allowed if hmac.compare_digest(given, t.encode())]
        return ok[0] if ok else None

    async def _compute(self, fn, *args):
        """`fn(*args)`, a session's start or verify, as a slot of the scheduler's loop (its pass batched with the
        other sessions')."""
        return await asyncio.wrap_future(self.scheduler.call(fn, *args))

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="moaspec target server", docs_url=None, redoc_url=None, openapi_url=None)
        app.state.scheduler = self.scheduler  # a replica's health check reads it

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            if self.authorised(request.headers.get("authorization")) is None:
                return Response("a valid bearer token is required\n", status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
            body, kind = exposition(self.registry)
            return Response(body, media_type=kind)

        @app.websocket(ENDPOINT)
        async def session(ws: WebSocket) -> None:
            token = self.authorised(ws.headers.get("authorization"))
            if token is None:
                await ws.close(code=1008, reason="a valid bearer token is required")
                return
            full = None
            if self.stats.by_token[token] >= self.limits.max_sessions:
                full = f"this token has {self.limits.max_sessions} sessions open, the most it may"
            elif self.stats.sessions_open >= self.limits.max_connections:
                full = f"{self.limits.max_connections} sessions are open, the most this server takes"
            if full is not None:  # in a frame: a 403 would read as a bad token
                await ws.accept()
                await self._send(ws, busy_frame(f"{full}; retry later", 5, fatal=True))
                await ws.close(code=1013)
                return
            self.stats.by_token[token] += 1
            self.stats.sessions_open += 1
            self.stats.sessions_opened += 1
            try:
                await ws.accept()
                await self._serve(ws, token)
            finally:
                self.stats.by_token[token] -= 1
                self.stats.sessions_open -= 1

        return app

    async def _send(self, ws: WebSocket, frame: bytes) -> None:
        self.stats.bytes_out += len(frame)
        await ws.send_bytes(frame)

    def token_share(self) -> int:
        """KV bytes one token's generations may hold together."""
        share = self.limits.token_kv_share
        if share is None:
            share = 1.0 if len(set(self.tokens_allowed)) == 1 else 0.5
        return int(self.admission.budget * share)

    async def _start(self, ws: WebSocket, sess: Session, header: dict[str, Any]) -> Step:
        """A new generation: checked, admitted by memory (waiting, and saying so, while there is none)."""
        sess.end()
        prompt, params, encoder, slots = sess.plan(header)
        need = self.model.new_cache(1).bytes_for(slots)

        async def queued(position: int) -> None:
            await self._send(ws, pack({"type": "queued", "position": position}))

        share = self.token_share()
        held = self.held_by_token[sess.token] if share < self.admission.budget else 0  # one token: the queue's
        if need > share:
            raise ProtocolError(f"this generation needs {need / 2**20:.0f} MiB of KV cache; a token's share of the "
                                f"server's is {share / 2**20:.0f} MiB: ask for fewer tokens")
        if held + need > share:
            raise Busy(f"this token's generations hold {held / 2**20:.0f} of its {share / 2**20:.0f} MiB share of "
                       "the KV cache; retry when one ends", self.admission.retry_after())
        self.held_by_token[sess.token] += need  # counted while it waits too: its queued starts share the share
        try:
            granted = await self.admission.acquire(need, queued)
        except BaseException:
            self.held_by_token[sess.token] -= need
            raise
        sess.reserved = (need, granted)
        try:
            return await self._compute(sess.start, prompt, params, encoder, slots)
        except BaseException:  # no generation began: its memory goes back at once
            sess.end()
            raise

    async def _serve(self, ws: WebSocket, token: str = "") -> None:
        sess = Session(self, token)
        await self._send(ws, pack(self.ready()))
        idle_from = time.monotonic()  # pings do not count: an idle session ends whatever it pings
        try:
            while True:
                left = self.limits.idle_timeout_s - (time.monotonic() - idle_from)
                try:
                    if left <= 0:
                        raise asyncio.TimeoutError
                    msg = await asyncio.wait_for(ws.receive(), timeout=left)
                except asyncio.TimeoutError:
                    await ws.close(code=1000, reason=f"idle for {self.limits.idle_timeout_s:.0f} s")
                    return
                except WebSocketDisconnect:
                    return
                if msg["type"] == "websocket.disconnect":
                    return
                frame = msg.get("bytes") if msg.get("bytes") is not None else msg.get("text")
                self.stats.bytes_in += len(frame or b"")
                try:
                    header, _ = unpack(frame)
                    kind = header["type"]
                    if kind == "ping":
                        await self._send(ws, pack({"type": "pong", "t": time.time()}))
                        continue
                    idle_from = time.monotonic()
                    if kind == "end":
                        sess.end()
                        continue
                    if kind not in ("start", "verify"):
                        raise ProtocolError(f"unknown message type {kind!r}: expected start, verify, end or ping")
                    t0 = time.perf_counter()
                    if kind == "start":
                        step = await self._start(ws, sess, header)
                    else:
                        step = await self._compute(sess.verify, header)
                    self.stats.calls += 1
                    log.debug("%s in %.1f ms", kind, (time.perf_counter() - t0) * 1e3)
                    idle_from = time.monotonic()
                    await self._send(ws, sess.reply(step))
                except Busy as e:
                    self.stats.errors += 1
                    await self._send(ws, busy_frame(str(e), e.retry_after))
                except UserError as e:  # ProtocolError, ContextLengthError, bad settings: the client's mistake
                    self.stats.errors += 1
                    await self._send(ws, pack({"type": "error", "message": str(e), "fatal": False}))
                except WebSocketDisconnect:
                    return
                except Exception as e:  # a bug must not take the server down, nor leak details to the client
                    log.exception("session failed")
                    self.stats.errors += 1
                    with contextlib.suppress(Exception):
                        await self._send(ws, pack({"type": "error", "message": f"internal error "
                                                   f"({type(e).__name__})", "fatal": True}))
                        await ws.close(code=1011)
                    return
        finally:
            sess.end()


def build(model: str, weights: str, tokens: list[str], limits: Limits, drafter_paths: dict[str, Path] | None = None,
          scheduler_thread: bool = True) -> TargetServer:
    """The server `moaspec serve-target` runs: `model` in `weights`, a session's context `limits.max_seq_len`,
    the encoders of `drafter_paths` (label -> checkpoint; None: every drafter shipped for the target)."""
    from moaspec.models.store import weights_fingerprint
    from moaspec.pipeline import SpecDecoder

    dec = SpecDecoder(model, drafter="none", weights=weights, max_seq_len=limits.max_seq_len)
    fp = weights_fingerprint(dec.folder)
    encoders = load_encoders(dec.target, model, fp, drafter_paths)
    return TargetServer(dec.target, model, fp, tokens, encoders, limits, dec.pass_costs(),
                        scheduler_thread=scheduler_thread)


def build_app(*args: Any, **kwargs: Any) -> FastAPI:
    """A Ray Serve replica's ASGI app (`serving.cluster`): `build`'s server, its passes on a thread of their own."""
    return build(*args, **kwargs, scheduler_thread=True).app


def busy_frame(message: str, retry_after: float, fatal: bool = False) -> bytes:
    return pack({"type": "error", "message": message, "fatal": fatal, "busy": True, "retry_after": retry_after})


def serve(server: TargetServer, host: str = "127.0.0.1", port: int = 8765, ssl_certfile: str | None = None,
          ssl_keyfile: str | None = None, connections: ConnectionLimits | None = None) -> None:
    """Run the server until interrupted (uvicorn; messages bounded by `Limits.max_message_bytes`, connections
    by `max_connections`: past that uvicorn answers 503 before any handshake work); the batched passes run
    on this thread unless the scheduler has its own."""
    torch.set_grad_enabled(False)
    warn_exposure(host, server.tokens_allowed, bool(ssl_certfile))
    try:
        run(server.app, server.scheduler, host=host, port=port, ws_max_size=server.limits.max_message_bytes,
            log_level="warning", ws_ping_interval=20.0, ws_ping_timeout=20.0,
            limit_concurrency=server.limits.max_connections + 16, timeout_keep_alive=5,
            ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, connections=connections)
    finally:
        server.close()
