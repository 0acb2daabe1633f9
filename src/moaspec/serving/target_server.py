"""`moaspec serve-target`: the target model behind a WebSocket, verifying draft trees for remote drafters.

Why WebSockets on ASGI (FastAPI + uvicorn): a session lives exactly as long as its connection (the
target's KV cache is freed when the client goes away), a round is one small binary frame each way
with a few bytes of framing and no per-request headers, the bearer token is checked once in the
handshake, and the same stack serves the OpenAI-compatible HTTP API. gRPC would do too, at the cost
of generated stubs and an HTTP/2 stack that the shaping proxy and the API do not need.

One set of weights serves every session; each session has its own KV cache (`KVCache`) and sampling
state. The model runs one call at a time (a lock; on two CPU cores parallel passes only slow each
other down), in a worker thread so the event loop keeps answering. Every message is checked
(`serving.protocol`) and bounded (`Limits`); a bad one gets an error frame, never a crash; a client can
only reach its own session, since a session is its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from moaspec.decoding.context import WIRE_DTYPES
from moaspec.decoding.context import encode as encode_context
from moaspec.decoding.target import ContextEncoder, LocalTarget, Step
from moaspec.drafters import TRAINED, shipped_checkpoint
from moaspec.drafters.trained import encoder_id
from moaspec.errors import UserError
from moaspec.models.runtime import Transformer
from moaspec.serving.protocol import (
    ENDPOINT,
    Limits,
    ProtocolError,
    check_prompt,
    pack,
    sampling_from_wire,
    tree_from_wire,
    unpack,
)

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
    import importlib

    if folders is None:
        folders = {k: shipped_checkpoint(k, name) for k in TRAINED}
        folders.update({f"moa-n{n}": shipped_checkpoint(f"moa-n{n}", name) for n in (1, 3)})
        folders = {k: f for k, f in folders.items() if (f / "config.json").exists()}
    out: dict[str, ContextEncoder] = {}
    for label, folder in folders.items():
        kind = label.split("-")[0]
        module = importlib.import_module(f"moaspec.drafters.{kind}")
        if not hasattr(module, "load_encoder"):
            continue  # a drafter that needs token ids only (independent)
        encoder = module.load_encoder(folder, model, name, fingerprint)
        out[encoder_id(encoder)] = encoder
    return out


class Session:
    """One client's generation state: its own KV cache over the shared weights."""

    def __init__(self, server: TargetServer):
        self.server = server
        self.target: LocalTarget | None = None
        self.cache = server.model.new_cache(server.limits.max_seq_len)
        self.wire = "fp16"

    def start(self, header: dict[str, Any]) -> Step:
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
        self.wire = wire
        self.target = LocalTarget(srv.model, encoder, cache=self.cache)
        return self.target.start(prompt, params)

    def verify(self, header: dict[str, Any]) -> Step:
        if self.target is None:
            raise ProtocolError("verify before start: send a 'start' message first")
        tree = tree_from_wire(header, self.server.model.cfg.vocab_size, self.server.limits)
        if self.cache.length + len(tree) > self.cache.size:
            raise ProtocolError(f"the session's context is full ({self.cache.length} + {len(tree)} tokens > "
                                f"{self.cache.size}): start a new generation")
        return self.target.verify(tree)

    def reply(self, step: Step) -> bytes:
        v = step.verdict
        body = encode_context(step.context, self.wire) if step.context is not None else b""
        return pack({"type": "step", "path": v.path, "accepted": v.accepted, "bonus": v.bonus,
                     "length": step.length, "target_ms": round(step.target_ms, 3)}, body)


class TargetServer:
    """The target model, its encoders, the limits and the bearer token, served as an ASGI app."""

    def __init__(self, model: Transformer, name: str, fingerprint: str, token: str,
                 encoders: dict[str, ContextEncoder] | None = None, limits: Limits | None = None,
                 pass_costs: dict[int, float] | None = None):
        if not token:
            raise UserError("the target server needs a bearer token: pass --token-file or set MOASPEC_TOKEN")
        self.model, self.name, self.fingerprint, self.token = model, name, fingerprint, token
        self.encoders = encoders or {}
        self.limits = limits or Limits()
        if self.limits.max_seq_len > model.max_seq_len:
            raise UserError(f"max_seq_len {self.limits.max_seq_len} exceeds the model's context {model.max_seq_len}")
        self.pass_costs = pass_costs or {}
        self.stats = Stats()
        self.lock = asyncio.Lock()
        self.app = self._build_app()

    def ready(self) -> dict[str, Any]:
        return {"type": "ready", "model": self.name, "fingerprint": self.fingerprint,
                "max_seq_len": self.limits.max_seq_len, "eos": list(self.model.cfg.eos_token_ids),
                "vocab_size": self.model.cfg.vocab_size,
                "pass_costs": {str(k): v for k, v in self.pass_costs.items()},
                "encoders": sorted(self.encoders), "limits": asdict(self.limits)}

    def authorised(self, header: str | None) -> str | None:
        """The token of a valid `Authorization: Bearer <token>` header, else None."""
        if not header or not header.startswith("Bearer "):
            return None
        given = header[len("Bearer "):].strip()
        return given if hmac.compare_digest(given.encode(), self.token.encode()) else None

    async def _compute(self, fn, *args):
        async with self.lock:
            return await anyio.to_thread.run_sync(fn, *args)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="moaspec target server", docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            s = self.stats
            return {"status": "ok", "model": self.name, "sessions_open": s.sessions_open, "calls": s.calls}

        @app.websocket(ENDPOINT)
        async def session(ws: WebSocket) -> None:
            token = self.authorised(ws.headers.get("authorization"))
            if token is None:
                await ws.close(code=1008, reason="a valid bearer token is required")
                return
            if self.stats.by_token[token] >= self.limits.max_sessions:  # in a frame: a 403 reads as a bad token
                await ws.accept()
                await self._send(ws, pack({"type": "error", "fatal": True, "message": f"this server allows at most "
                                           f"{self.limits.max_sessions} open sessions per token; close one first"}))
                await ws.close(code=1013)
                return
            self.stats.by_token[token] += 1
            self.stats.sessions_open += 1
            self.stats.sessions_opened += 1
            try:
                await ws.accept()
                await self._serve(ws)
            finally:
                self.stats.by_token[token] -= 1
                self.stats.sessions_open -= 1

        return app

    async def _send(self, ws: WebSocket, frame: bytes) -> None:
        self.stats.bytes_out += len(frame)
        await ws.send_bytes(frame)

    async def _serve(self, ws: WebSocket) -> None:
        sess: Session | None = None
        await self._send(ws, pack(self.ready()))
        while True:
            try:
                msg = await asyncio.wait_for(ws.receive(), timeout=self.limits.idle_timeout_s)
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
                if kind not in ("start", "verify"):
                    raise ProtocolError(f"unknown message type {kind!r}: expected start, verify or ping")
                if sess is None:
                    sess = await self._compute(Session, self)
                t0 = time.perf_counter()
                step = await self._compute(sess.start if kind == "start" else sess.verify, header)
                self.stats.calls += 1
                log.debug("%s in %.1f ms", kind, (time.perf_counter() - t0) * 1e3)
                await self._send(ws, sess.reply(step))
            except UserError as e:  # ProtocolError, ContextLengthError, bad settings: the client's mistake
                self.stats.errors += 1
                await self._send(ws, pack({"type": "error", "message": str(e), "fatal": False}))
            except WebSocketDisconnect:
                return
            except Exception as e:  # a bug must not take the server down, nor leak details to the client
                log.exception("session failed")
                self.stats.errors += 1
                with contextlib.suppress(Exception):
                    await self._send(ws, pack({"type": "error", "message": f"internal error ({type(e).__name__})",
                                               "fatal": True}))
                    await ws.close(code=1011)
                return


def serve(server: TargetServer, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Run the server until interrupted (uvicorn; messages bounded by `Limits.max_message_bytes`)."""
    import uvicorn

    torch.set_grad_enabled(False)
    uvicorn.run(server.app, host=host, port=port, ws_max_size=server.limits.max_message_bytes,
                log_level="warning", ws_ping_interval=20.0, ws_ping_timeout=20.0)
