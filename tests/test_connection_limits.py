"""Connections held to deadlines and a per-client count (`serving.runner.guarded_http`, what `moaspec serve` and
`serve-target` run): a client that trickles its headers or body is cut off instead of holding a connection, a
descriptor and a place forever; one address cannot open more than its share; a slow answer is never cut."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from fastapi import FastAPI
from servers import Running

from moaspec.errors import UserError
from moaspec.serving.runner import ConnectionLimits, guarded_http


@pytest.fixture(scope="module")
def server():
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return body

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(1.5)  # longer than the header deadline: the app's own time is not cut
        return {"ok": True}

    run = Running(app, http=guarded_http(ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.8, per_client=4)))
    yield run
    run.stop()


def _connect(run: Running) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", run.port), timeout=5)
    return s


def _closed_within(s: socket.socket, seconds: float) -> float:
    """Seconds until the server closed `s` (reading what it sent); fails if it stayed open."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {seconds} s")
    return time.monotonic() - t0


def test_headers_that_never_end_are_cut_off(server):
    s = _connect(server)
    s.sendall(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1\r\n")  # never the blank line
    assert _closed_within(s, 4) < 2.5


def test_a_body_that_never_ends_is_cut_off(server):
    s = _connect(server)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
              b"\r\n{\"a\": ")
    assert _closed_within(s, 4) < 2.5


def test_a_slow_answer_is_not_cut_and_keep_alive_requests_get_the_deadline_again(server):
    s = _connect(server)
    s.sendall(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    s.settimeout(5)
    got = b""
    while b'{"ok":true}' not in got:
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /slow HTTP/1.1\r\n")  # the next request on the same connection, never finished
    assert _closed_within(s, 4) < 2.5


def test_one_address_has_a_bounded_number_of_connections(server):
    held = [_connect(server) for _ in range(4)]
    for s in held:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # counted while they last
    extra = _connect(server)
    extra.settimeout(3)
    assert extra.recv(4096).startswith(b"HTTP/1.1 503")
    for s in held:
        s.close()
    time.sleep(0.2)
    fresh = _connect(server)
    fresh.sendall(b'POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 8\r\n'
                  b'\r\n{"a": 1}')
    fresh.settimeout(3)
    assert fresh.recv(4096).startswith(b"HTTP/1.1 200")


def test_limits_are_checked():
    for kw in ({"header_timeout_s": 0}, {"body_timeout_s": -1}, {"per_client": 0}):
        with pytest.raises(UserError):
            ConnectionLimits(**kw)
