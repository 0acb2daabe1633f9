"""The client's view of a remote target: `TargetSide` over one WebSocket (`serving.target_server`).

The engine runs unchanged against it: `start` and `verify` become one frame each way, the drafter's
context arrives as safetensors bytes and is decoded here. It counts calls and bytes each way.
A connection that fails or times out raises `decoding.target.TargetUnavailable`, which the engine
turns into drafter-only generation while `reconnect_in_background` opens a new session.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from pathlib import Path
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from moaspec.decoding.context import decode as decode_context
from moaspec.decoding.logit_rules import LogitRules
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.target import Step, TargetUnavailable
from moaspec.decoding.tree import Tree
from moaspec.decoding.verify import Verdict
from moaspec.errors import UserError
from moaspec.link.protocol import ENDPOINT, Busy, pack, sampling_to_wire, tree_to_wire, unpack

TOKEN_ENV = "MOASPEC_TOKEN"


def read_tokens(token_file: str | None = None) -> list[str]:
    """Bearer tokens: the non-empty lines of `token_file` (a server may take several, each with its own
    session limit), else $MOASPEC_TOKEN; UserError if neither."""
    if token_file:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as e:
            raise UserError(f"cannot read the token file {token_file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise UserError(f"the token file {token_file} is not text") from None
        tokens = [line.strip() for line in lines if line.strip()]
        if not tokens:
            raise UserError(f"the token file {token_file} is empty")
        return tokens
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise UserError(f"no bearer token: pass --token-file or set {TOKEN_ENV}")
    return [token]


def read_token(token_file: str | None = None) -> str:
    """The bearer token a client sends: the first line of `token_file`, else $MOASPEC_TOKEN."""
    return read_tokens(token_file)[0]


def client_tls(ca_file: str | None) -> ssl.SSLContext | None:
    """The TLS context of a wss:// client that trusts `ca_file` (a private CA or a self-signed server
    certificate); None: the system's trust store."""
    if ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise UserError(f"cannot read the CA file {ca_file}: {e}") from None


def target_url(url: str) -> str:
    """A server address as the WebSocket URL of its target endpoint (http(s):// and ws(s):// both work)."""
    for a, b in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(a):
            url = b + url[len(a):]
    if not url.startswith(("ws://", "wss://")):
        raise UserError(f"a target server URL starts with ws://, wss://, http:// or https://; got {url!r}")
    return url if url.rstrip("/").endswith(ENDPOINT) else url.rstrip("/") + ENDPOINT


class RemoteTarget:
    """`decoding.target.TargetSide` for a target served by `moaspec serve-target`."""

    def __init__(self, url: str, token: str, encoder: str | None = None, wire: str = "fp16",
                 timeout_s: float = 30.0, connect_timeout_s: float = 10.0, busy_timeout_s: float = 300.0,
                 fingerprint: str | None = None, ssl_context: ssl.SSLContext | None = None):
        """`timeout_s`: a call unanswered this long counts as the server gone (a start waiting in the
        server's queue is not: the server says so every few seconds); `busy_timeout_s`: how long to keep
        asking a full server; `fingerprint`: the target weights this client drafts for, checked on every
        (re)connection; `ssl_context`: for wss:// with a private CA (default: the system's)."""
        self.url, self.token, self.encoder, self.wire = target_url(url), token, encoder, wire
        self.timeout_s, self.connect_timeout_s, self.busy_timeout_s = timeout_s, connect_timeout_s, busy_timeout_s
        self.expected_fingerprint = fingerprint
        self.ssl_context = ssl_context
        self.ws: ClientConnection | None = None
        self.info: dict[str, Any] = {}
        self.calls = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.reconnects = 0
        self.queued = 0  # "queued" notes received (starts that waited for the server's memory)
        self.generating = False  # a generation is in progress: a new session must run the same weight mode
        self._retry: threading.Thread | None = None
        self._fresh: tuple[ClientConnection, dict[str, Any]] | None = None
        self._failed: Exception | None = None  # why reconnecting stopped for good
        self._stopping = threading.Event()
        self.connect()

    # ---------------------------------------------------------------- connection
    def connect(self) -> None:
        """Open a session; checks the server's target and that it offers this drafter's encoder. A full
        server is asked again when it says, for up to `busy_timeout_s`."""
        self.close()
        self.ws, header = self._when_not_busy(self._open)
        self._ready(header)

    def _when_not_busy(self, call):
        until = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                return call()
            except Busy as e:
                if time.monotonic() + e.retry_after > until:
                    raise
                self._stopping.wait(e.retry_after)
                if self._stopping.is_set():
                    raise

    def _open(self) -> tuple[ClientConnection, dict[str, Any]]:
        try:
            tls = {"ssl": self.ssl_context} if self.ssl_context is not None and self.url.startswith("wss://") else {}
            opening = connect(self.url, additional_headers={"Authorization": f"Bearer {self.token}"},
                              open_timeout=self.connect_timeout_s, max_size=64 << 20, compression=None, **tls)
            ws = opening.__enter__()  # a connection that outlives this call; `close` ends it
        except InvalidStatus as e:
            code = e.response.status_code
            if code in (401, 403):
                raise UserError(f"the target server at {self.url} refused the bearer token (HTTP {code})") from None
            raise TargetUnavailable(f"the target server at {self.url} answered HTTP {code}") from None
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as e:
            raise TargetUnavailable(f"cannot reach the target server at {self.url}: {e}") from None
        try:
            frame = ws.recv(timeout=self.connect_timeout_s)
        except (TimeoutError, ConnectionClosed, OSError) as e:
            ws.close()
            raise TargetUnavailable(f"the target server at {self.url} did not open a session: {e}") from None
        self.bytes_in += len(frame)
        header, _ = unpack(frame)
        if header.get("type") != "ready":
            ws.close()
            if header.get("busy"):
                raise Busy(f"the target server at {self.url} is full: {header.get('message', '')}",
                           _retry_after(header))
            raise UserError(f"{self.url} did not open a target session (got {header.get('type')!r}: "
                            f"{header.get('message', '')})")
        return ws, header

    def _ready(self, header: dict[str, Any]) -> None:
        expected = self.expected_fingerprint or self.info.get("fingerprint")  # a reconnection: the same target
        if expected is not None and header.get("fingerprint") != expected:
            raise UserError(f"the server at {self.url} now serves {header.get('model')!r} with weights "
                            f"{header.get('fingerprint')}, not the {expected} this client drafts for")
        if self.generating and header.get("weights") != self.info.get("weights"):
            raise UserError(f"the server at {self.url} now runs its target in {header.get('weights')} weights, not "
                            f"{self.info.get('weights')} as when this generation began: its tokens would differ from "
                            "those verified so far; start the generation again, or the server in "
                            f"{self.info.get('weights')}")
        self.info = header
        self.check_encoder()
        self.eos_token_ids = tuple(header["eos"])
        self.max_seq_len = int(header["max_seq_len"])

    def reconnect_in_background(self, retry_s: float = 0.25, max_retry_s: float = 5.0) -> None:
        """Drop the broken session and keep trying to open a new one in a thread (`available` picks it up):
        backing off from `retry_s` to `max_retry_s`, waiting as long as a full server asks, and giving up
        on an answer that will not change (a refused token, another target): `available` then raises it."""
        self.close()
        if self._retry is not None and self._retry.is_alive():
            return
        self._fresh = None
        self._failed = None

        def retry() -> None:
            wait = retry_s
            while not self._stopping.is_set():
                try:
                    ws, header = self._open()
                except Busy as e:
                    self._stopping.wait(e.retry_after)
                    continue
                except TargetUnavailable:  # unreachable, reset by a proxy, a server still starting: again
                    self._stopping.wait(wait)
                    wait = min(max_retry_s, 2 * wait)
                    continue
                except Exception as e:  # a refusal that retrying cannot change
                    self._failed = e
                    return
                if self._stopping.is_set():
                    ws.close()
                else:
                    self._fresh = (ws, header)
                return

        self._retry = threading.Thread(target=retry, name="moaspec-reconnect", daemon=True)
        self._retry.start()

    def available(self) -> bool:
        if self.ws is None and self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        if self.ws is None and self._fresh is not None:
            ws, header = self._fresh
            self._fresh = None
            self.ws = ws
            try:
                self._ready(header)
            except UserError:
                self.close()
                raise
            self.reconnects += 1
        return self.ws is not None

    def check_encoder(self) -> None:
        """UserError unless the server offers the encoder of this client's drafter."""
        offered = self.info.get("encoders", [])
        if self.encoder is not None and self.encoder not in offered:
            raise UserError(f"the server's target ({self.info.get('model')}) has no encoder for this drafter "
                            f"({self.encoder}); it offers {', '.join(offered) or 'none'}: use a drafter checkpoint "
                            "the server loads, or a token-only drafter (lookup, suffix)")

    def close(self) -> None:
        if self.ws is not None:
            try:
                self.ws.close()
            except Exception:  # closing a broken connection may fail in several ways; it is gone either way
                pass
            self.ws = None

    def __enter__(self) -> RemoteTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Close the session and stop any reconnection attempts (joining their thread: no session opened
        after this returns)."""
        self._stopping.set()
        self.close()
        if self._retry is not None:
            self._retry.join(timeout=self.connect_timeout_s + 1)
        if self._fresh is not None:
            self._fresh[0].close()
            self._fresh = None

    @property
    def model(self) -> str:
        return self.info.get("model", "")

    @property
    def fingerprint(self) -> str:
        return self.info.get("fingerprint", "")

    def pass_costs(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in self.info.get("pass_costs", {}).items()}

    # ---------------------------------------------------------------- calls
    def _send(self, frame: bytes) -> None:
        if self.ws is None:
            raise TargetUnavailable("not connected to the target server")
        try:
            self.ws.send(frame)
        except (ConnectionClosed, OSError) as e:
            self.close()
            raise TargetUnavailable(f"the target server connection broke: {e}") from None
        self.bytes_out += len(frame)

    def _recv(self) -> tuple[dict[str, Any], bytes]:
        while True:
            if self.ws is None:
                raise TargetUnavailable("not connected to the target server")
            try:
                frame = self.ws.recv(timeout=self.timeout_s)
            except TimeoutError:
                self.close()
                raise TargetUnavailable(f"the target server did not answer within {self.timeout_s:.1f} s") from None
            except (ConnectionClosed, OSError) as e:
                self.close()
                raise TargetUnavailable(f"the target server connection broke: {e}") from None
            self.bytes_in += len(frame)
            header, body = unpack(frame)
            if header["type"] == "queued":  # a start waiting for room: the server is there, keep waiting
                self.queued += 1
                continue
            if header["type"] == "error":
                if header.get("fatal"):
                    self.close()
                if header.get("busy"):
                    raise Busy(f"target server: {header.get('message')}", _retry_after(header))
                raise UserError(f"target server: {header.get('message')}")
            return header, body

    def _step(self, frame: bytes) -> Step:
        self._send(frame)
        header, body = self._recv()
        if header["type"] != "step":
            raise UserError(f"unexpected reply {header['type']!r} from the target server")
        self.calls += 1
        context = decode_context(body) if body else None
        verdict = Verdict(list(header["path"]), list(header["accepted"]), int(header["bonus"]))
        return Step(verdict, context, int(header["length"]), float(header["target_ms"]), int(header.get("cached", 0)))

    def start(self, prompt: list[int], params: SamplingParams, max_new_tokens: int | None = None,
              resume: bool = False, logprobs: int | None = None, rules: LogitRules | None = None) -> Step:
        if logprobs is not None:
            raise UserError("log-probabilities need the target's logits, which stay on the target server: "
                            "ask for them from a local target (or the server's own API)")
        if rules is not None and rules.active:
            raise UserError("logit bias, penalties and grammars act on the target's logits, which stay on the "
                            "target server: use a local target (or the server's own API)")
        if not resume:  # a new generation may find the server in another weight mode than the last one did
            self.generating = False
        if not self.available():
            self.connect()
        header = {"type": "start", "prompt": list(prompt), "sampling": sampling_to_wire(params),
                  "encoder": self.encoder, "wire": self.wire}
        if max_new_tokens is not None:
            header["max_new_tokens"] = max_new_tokens
        if resume:
            header["resume"] = True
        frame = pack(header)
        try:
            step = self._when_not_busy(lambda: self._step(frame))
        except TargetUnavailable:  # e.g. the server closed the session while it sat idle: one new one
            self.connect()
            step = self._when_not_busy(lambda: self._step(frame))
        self.generating = True
        return step

    def verify(self, tree: Tree) -> Step:
        return self._step(pack(tree_to_wire(tree)))

    def release(self) -> None:
        """Tell the server the generation ended, so it frees the session's memory now (no answer comes)."""
        self.generating = False
        if self.ws is not None:
            try:
                self._send(pack({"type": "end"}))
            except TargetUnavailable:
                pass

    def ping(self) -> float:
        """One round trip, in ms."""
        t = time.perf_counter()
        self._send(pack({"type": "ping"}))
        self._recv()
        return (time.perf_counter() - t) * 1e3


def _retry_after(header: dict[str, Any]) -> float:
    value = header.get("retry_after", 1.0)
    return float(value) if isinstance(value, (int, float)) and 0 < value <= 600 else 1.0
