"""The shaping proxy over real loopback sockets: an echo server behind it, measured bytes and times.

Timing assertions are lower bounds (the shaping must really happen) with loose upper bounds: the test machine
has two shared, loaded cores.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from experiments.shaping import PROFILES, LinkProfile, ShapingProxy, Traffic, get_profile
from moaspec.errors import UserError

pytestmark = pytest.mark.filterwarnings("error")  # an unclosed socket or transport fails its test


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        pass  # the proxy resets connections on purpose


@pytest.fixture(scope="module")
def echo() -> Iterator[tuple[str, int]]:
    server = _EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(autouse=True)
def no_asyncio_complaints(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """asyncio logs leaked tasks and unretrieved exceptions rather than raising them."""
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        yield
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def connect(proxy: ShapingProxy, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(min(n - got, 1 << 20))
        if not part:
            raise AssertionError(f"EOF after {got} of {n} bytes")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def echo_through(proxy: ShapingProxy, payload: bytes) -> bytes:
    """Send the payload from a thread while reading its echo here (neither side blocks the other)."""
    with connect(proxy, timeout=30) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        back = recv_exactly(sock, len(payload))
        sender.join()
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # the echo server's EOF comes through after the data
    return back


def round_trip(sock: socket.socket, message: bytes = b"ping") -> float:
    start = time.perf_counter()
    sock.sendall(message)
    assert recv_exactly(sock, len(message)) == message
    return time.perf_counter() - start


def assert_cut(sock: socket.socket) -> None:
    """The peer reset or closed the connection: an EOF or a reset, never data or a timeout."""
    sock.settimeout(5)
    try:
        sock.sendall(b"after the cut")
        assert sock.recv(100) == b""
    except (ConnectionResetError, BrokenPipeError):
        pass


@pytest.mark.parametrize("name", sorted(set(PROFILES) - {"poor"}))  # "poor" is "satellite"
def test_bytes_round_trip_intact_under_every_profile(echo, name):
    profile = PROFILES[name]
    # ~0.25 s of the link's bandwidth each way (1 MB where that is fast enough), so the test stays quick.
    size = 1 << 20 if not profile.bandwidth_mbps else min(1 << 20, int(profile.bandwidth_mbps * 1e6 / 8 / 4))
    payload = os.urandom(size)
    with ShapingProxy(echo, profile) as proxy:
        start = time.perf_counter()
        assert echo_through(proxy, payload) == payload
        assert (
            time.perf_counter() - start
            >= (profile.rtt_ms / 1000 + size * 8 / (profile.bandwidth_mbps or 1e12) / 1e6) * 0.99
        )


def test_jitter_and_loss_never_reorder_a_megabyte(echo):
    rough = LinkProfile(delay_ms=1, jitter_ms=20, loss=0.1, seed=7)  # every chunk lands out of its own order
    payload = os.urandom(1 << 20)
    with ShapingProxy(echo, rough) as proxy:
        assert echo_through(proxy, payload) == payload


def test_round_trip_time_is_twice_the_one_way_delay(echo):
    wifi = PROFILES["wifi"]
    with ShapingProxy(echo, wifi) as proxy, connect(proxy) as sock:
        rtts = [round_trip(sock) for _ in range(7)]
    floor = wifi.rtt_ms / 1000
    assert min(rtts) >= floor * 0.99, rtts
    assert statistics.median(rtts) < floor + 2 * wifi.jitter_ms / 1000 + 0.05, rtts


def test_loss_delays_chunks_by_a_retransmission_and_is_reproducible(echo):
    lossy = LinkProfile(loss=0.3, seed=4)

    def slow_pings() -> list[bool]:
        with ShapingProxy(echo, lossy) as proxy, connect(proxy) as sock:
            return [round_trip(sock) >= lossy.retransmit_ms / 1000 * 0.99 for _ in range(6)]

    first = slow_pings()
    assert any(first) and not all(first), first  # this seed loses some chunks, not all
    assert slow_pings() == first


def test_set_profile_applies_to_live_connections(echo):
    with ShapingProxy(echo, "none") as proxy, connect(proxy) as sock:
        fast = min(round_trip(sock) for _ in range(3))
        proxy.set_profile(LinkProfile(delay_ms=60))
        slow = round_trip(sock)
        assert proxy.profile.delay_ms == 60
    assert slow >= 0.12 * 0.99
    assert fast < 0.06  # unshaped loopback, with room for a loaded machine


def test_bandwidth_cap_sets_the_transfer_time(echo):
    rate = 20.0  # Mbit/s
    payload = os.urandom(1 << 20)
    with ShapingProxy(echo, LinkProfile(bandwidth_mbps=rate)) as proxy:
        start = time.perf_counter()
        assert echo_through(proxy, payload) == payload
        elapsed = time.perf_counter() - start
    least = len(payload) * 8 / (rate * 1e6)  # 0.42 s; both directions overlap, so not twice that
    assert least * 0.99 <= elapsed < 2 * least + 2.0


def test_cut_resets_live_connections_and_the_link_stays_up(echo):
    with ShapingProxy(echo, "lan") as proxy:
        with connect(proxy) as first, connect(proxy) as second:
            round_trip(first)
            round_trip(second)
            proxy.cut()
            assert_cut(first)
            assert_cut(second)
        assert proxy.mode == "up"
        with connect(proxy) as again:
            round_trip(again)


def test_down_refuse_refuses_then_up_accepts_on_the_same_port(echo):
    with ShapingProxy(echo, "lan") as proxy:
        port = proxy.port
        with connect(proxy) as live:
            round_trip(live)
            proxy.down("refuse")
            assert proxy.mode == "refuse"
            assert_cut(live)
        with pytest.raises(ConnectionRefusedError):
            connect(proxy)
        proxy.up()
        assert proxy.port == port and proxy.mode == "up"
        with connect(proxy) as sock:
            round_trip(sock)


def test_down_blackhole_times_out_then_flows_after_up(echo):
    with ShapingProxy(echo, "lan") as proxy:
        with connect(proxy) as stalled:
            round_trip(stalled)
            proxy.down("blackhole", cut=False)
            with connect(proxy, timeout=0.3) as held:  # accepted: an outage, not a dead server
                held.sendall(b"hello?")
                with pytest.raises(TimeoutError):
                    held.recv(10)
                stalled.settimeout(0.3)
                stalled.sendall(b"anyone?")
                with pytest.raises(TimeoutError):
                    stalled.recv(10)
                proxy.up()
                # What the outage held flows on, as TCP's retransmissions would deliver it.
                held.settimeout(10)
                stalled.settimeout(10)
                assert recv_exactly(held, 6) == b"hello?"
                assert recv_exactly(stalled, 7) == b"anyone?"


def test_down_blackhole_with_cut_resets_live_connections(echo):
    with ShapingProxy(echo, "none") as proxy:
        with connect(proxy) as live:
            round_trip(live)
            proxy.down("blackhole")
            assert_cut(live)


def test_down_for_a_while_comes_back_by_itself(echo):
    with ShapingProxy(echo, "none") as proxy:
        proxy.down("refuse", duration_s=0.2)
        with pytest.raises(ConnectionRefusedError):
            connect(proxy)
        deadline = time.monotonic() + 10
        while proxy.mode != "up":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with connect(proxy) as sock:
            round_trip(sock)


def test_traffic_counts_bytes_each_way_and_connections(echo):
    with ShapingProxy(echo, "wifi") as proxy:
        assert proxy.traffic() == Traffic(0, 0, 0)
        with connect(proxy) as sock:
            sock.sendall(b"x" * 1000)
            recv_exactly(sock, 1000)
            assert proxy.traffic() == Traffic(to_server=1000, to_client=1000, connections=1)
            assert proxy.traffic(reset=True).to_server == 1000
            assert proxy.traffic() == Traffic(0, 0, 0)
            round_trip(sock, b"abc")
        assert echo_through(proxy, b"y" * 5000) == b"y" * 5000
        assert proxy.traffic() == Traffic(to_server=5003, to_client=5003, connections=1)
        proxy.reset_traffic()
        assert proxy.traffic() == Traffic(0, 0, 0)


def test_close_leaves_no_thread_and_refuses(echo):
    # only the threads this proxy started count: other tests' threads may start or end meanwhile
    before = set(threading.enumerate())
    proxy = ShapingProxy(echo, "4g")
    with proxy, connect(proxy) as sock:
        round_trip(sock)
        port = proxy.port
        ours = [t for t in threading.enumerate() if t not in before and t.name.startswith("shaping-proxy")]
        assert ours
    assert not any(t.is_alive() for t in ours)
    assert not [t for t in threading.enumerate() if t not in before and t.name.startswith(("shaping-proxy", "asyncio"))]
    assert proxy.mode == "closed"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    proxy.close()  # idempotent
    with pytest.raises(UserError, match="not running"):
        proxy.cut()


def test_upstream_gone_resets_the_client():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nobody = unused.getsockname()
    with ShapingProxy(nobody, "none") as proxy:
        try:
            sock = connect(proxy)
        except ConnectionResetError:
            return  # the reset came before connect() read the handshake's outcome (a loaded machine)
        with sock:
            assert_cut(sock)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"delay_ms": -1}, "delay_ms"),
        ({"delay_ms": float("nan")}, "delay_ms"),
        ({"jitter_ms": "3"}, "jitter_ms"),
        ({"bandwidth_mbps": -5}, "bandwidth_mbps"),
        ({"bandwidth_mbps": float("inf")}, "bandwidth_mbps"),
        ({"loss": 1.0}, "loss"),
        ({"loss": -0.1}, "loss"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_profile_values_are_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        replace(PROFILES["4g"], **changes)
    with pytest.raises(UserError, match=message):
        LinkProfile(**changes)


def test_profiles_and_names():
    assert get_profile("satellite").rtt_ms == 600 and get_profile("poor") == get_profile("satellite")
    assert PROFILES["lan"].rtt_ms == 1 and PROFILES["wifi"].rtt_ms == 10
    assert PROFILES["none"] == LinkProfile(name="none")
    assert LinkProfile(bandwidth_mbps=0).bandwidth_mbps == 0  # unlimited
    assert PROFILES["4g"].retransmit_ms == 200 + 35 and PROFILES["satellite"].retransmit_ms == 600 + 300
    with pytest.raises(UserError, match="unknown network profile 'dialup'; known: none, lan"):
        get_profile("dialup")
    with ShapingProxy(("127.0.0.1", 9), "none") as proxy, pytest.raises(UserError, match="down mode"):
        proxy.down("sideways")  # type: ignore[arg-type]
