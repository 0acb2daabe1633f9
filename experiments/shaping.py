"""A network-shaping TCP proxy: run the client-server mode through realistic links on loopback.

This kernel has no netem (`tc qdisc ... netem`), so delay, jitter, bandwidth and loss are imposed by a small
asyncio proxy that sits between the client and the server and forwards every connection in both directions.
It runs in a background thread with its own event loop, so synchronous code (tests, benchmarks, a blocking
client) can use it:

    with ShapingProxy(upstream=("127.0.0.1", server_port), profile="4g") as proxy:
        client = connect(f"ws://127.0.0.1:{proxy.port}/...")

Shaping works on the chunks the proxy reads (up to CHUNK bytes), the same in both directions:

- a chunk of n bytes occupies its direction of the link for n*8/rate seconds after the previous chunk has
  finished (a serialisation queue shared by all connections), then arrives one-way delay plus a uniform random
  jitter in [0, jitter] later, and never before the previous chunk of its connection and direction: TCP
  delivers bytes in order, so jitter delays but never reorders;
- loss is the probability that a chunk is "lost": TCP never loses bytes, so it arrives late instead, by
  LinkProfile.retransmit_ms (one retransmission timeout, at least Linux's 200 ms floor and one RTT, then one
  more crossing of the link). A chunk is up to ~11 packets, so this loss is per burst, not per packet.

Cuts simulate the server going away: `cut()` resets live connections; `down("refuse")` is a dead server
process (connections are refused), `down("blackhole")` a network outage (connections are accepted, nothing is
delivered, clients time out); `up()` brings the link back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import random
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from moaspec.errors import UserError

CHUNK = 16 * 1024  # the read size: the unit that is delayed, jittered and "lost"
QUEUE_CHUNKS = 16  # chunks in flight per direction and connection before the sender feels backpressure
MIN_RTO_MS = 200.0  # Linux's floor on TCP's retransmission timeout
TO_SERVER, TO_CLIENT = 0, 1  # the two directions, as indices
Mode = Literal["refuse", "blackhole"]


class ProfileError(UserError, ValueError):
    """A link profile with an impossible value (a UserError for the CLI, a ValueError for everyone else)."""


@dataclass(frozen=True)
class LinkProfile:
    """A network link, the same in both directions; see the module docstring for how each value is applied."""

    delay_ms: float = 0.0  # one-way: a round trip takes at least 2 x delay_ms
    jitter_ms: float = 0.0  # extra delay per chunk, uniform in [0, jitter_ms]
    bandwidth_mbps: float | None = None  # per direction, Mbit/s; None or 0 is unlimited
    loss: float = 0.0  # per-chunk probability of a retransmission delay, in [0, 1)
    seed: int = 0  # the jitter and loss draws are reproducible for a given seed and chunking
    name: str = "custom"

    def __post_init__(self) -> None:
        for field, value in (("delay_ms", self.delay_ms), ("jitter_ms", self.jitter_ms)):
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ProfileError(f"{field} must be a finite number of milliseconds >= 0, got {value!r}")
        bw = self.bandwidth_mbps
        if bw is not None and (not _is_number(bw) or not math.isfinite(bw) or bw < 0):
            raise ProfileError(
                f"bandwidth_mbps must be a finite number of Mbit/s >= 0 (0 or None: unlimited), got {bw!r}"
            )
        if not _is_number(self.loss) or not 0 <= self.loss < 1:
            raise ProfileError(f"loss must be a probability in [0, 1), got {self.loss!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ProfileError(f"seed must be an integer, got {self.seed!r}")

    @property
    def rtt_ms(self) -> float:
        """The round-trip time of an empty exchange, without jitter or loss."""
        return 2 * self.delay_ms

    @property
    def retransmit_ms(self) -> float:
        """The extra delay of a lost chunk: one retransmission timeout, then one more crossing of the link."""
        return max(MIN_RTO_MS, self.rtt_ms) + self.delay_ms


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_SATELLITE = LinkProfile(delay_ms=300, jitter_ms=30, bandwidth_mbps=2, loss=0.01, name="satellite")
PROFILES: dict[str, LinkProfile] = {
    "none": LinkProfile(name="none"),
    "lan": LinkProfile(delay_ms=0.5, bandwidth_mbps=1000, name="lan"),
    "wifi": LinkProfile(delay_ms=5, jitter_ms=1, bandwidth_mbps=100, name="wifi"),
    "5g": LinkProfile(delay_ms=15, jitter_ms=3, bandwidth_mbps=50, name="5g"),
    "4g": LinkProfile(delay_ms=35, jitter_ms=8, bandwidth_mbps=10, loss=0.002, name="4g"),
    "satellite": _SATELLITE,
    "poor": _SATELLITE,  # an alias: the worst link we benchmark
}


def get_profile(profile: LinkProfile | str) -> LinkProfile:
    """A profile, or the named one from PROFILES."""
    if isinstance(profile, LinkProfile):
        return profile
    if profile not in PROFILES:
        raise ProfileError(f"unknown network profile {profile!r}; known: {', '.join(PROFILES)}")
    return PROFILES[profile]


@dataclass(frozen=True)
class Traffic:
    """Bytes handed on in each direction and connections accepted, since the start or the last reset."""

    to_server: int
    to_client: int
    connections: int


class ShapingProxy:
    """A TCP proxy to `upstream` that shapes its traffic like `profile`; a context manager that starts and stops
    its own thread. The methods are thread-safe; `port` is the bound port (pick a free one with port=0)."""

    def __init__(
        self,
        upstream: tuple[str, int],
        profile: LinkProfile | str = "none",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.upstream = upstream
        self.host = host
        self.port = port
        self._profile = get_profile(profile)
        self._lock = threading.Lock()  # guards the counters, read from other threads
        self._bytes = [0, 0]
        self._connections = 0
        self._accepted = 0  # never reset: numbers the connections for their random streams
        self._mode = "up"
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Loop-thread state, created in _main.
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # one per live connection
        self._flowing: asyncio.Event
        self._stop: asyncio.Event
        self._auto_up: asyncio.Task[None] | None = None
        self._free_at = [0.0, 0.0]  # when each direction of the link finishes sending what it was given

    # -- the public, thread-safe interface --------------------------------------------------------------

    @property
    def profile(self) -> LinkProfile:
        return self._profile

    @property
    def mode(self) -> str:
        """The state: "up", "refuse" or "blackhole" ("closed" once closed)."""
        return self._mode

    def set_profile(self, profile: LinkProfile | str) -> None:
        """Shape from now on like `profile` (chunks already scheduled keep their times)."""
        self._profile = get_profile(profile)

    def traffic(self, reset: bool = False) -> Traffic:
        """The counters now; with reset, they restart from zero at the same instant."""
        with self._lock:
            now = Traffic(self._bytes[TO_SERVER], self._bytes[TO_CLIENT], self._connections)
            if reset:
                self._bytes = [0, 0]
                self._connections = 0
        return now

    def reset_traffic(self) -> None:
        self.traffic(reset=True)

    def cut(self) -> None:
        """Reset every live connection now (both sides see a connection reset); the link stays up."""
        self._call(self._cut_all())

    def down(self, mode: Mode = "refuse", *, cut: bool = True, duration_s: float | None = None) -> None:
        """The server goes away. "refuse": its process died, new connections are refused. "blackhole": the
        network is gone, new connections are accepted but nothing is delivered either way until up(), so clients
        time out (traffic held by then flows on after up(), as TCP's retransmissions would). With cut, live
        connections are reset; without, they go on ("refuse") or stall ("blackhole"). With duration_s, the link
        comes back up by itself after that many seconds."""
        if mode not in ("refuse", "blackhole"):
            raise UserError(f"down mode must be 'refuse' or 'blackhole', got {mode!r}")
        if duration_s is not None and not (_is_number(duration_s) and duration_s >= 0):
            raise UserError(f"duration_s must be a number of seconds >= 0, got {duration_s!r}")
        self._call(self._go_down(mode, cut, duration_s))

    def up(self) -> None:
        """Accept and forward connections again, on the same port."""
        self._call(self._set_state("up", cut=False))

    def start(self) -> ShapingProxy:
        """Bind and start forwarding in a background thread; returns when the port is bound."""
        if self._thread is not None:
            raise UserError("the shaping proxy is already running")
        ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="shaping-proxy", daemon=True)
        self._thread.start()
        try:
            self.port = ready.result(timeout=30)
        except BaseException:
            self._thread.join(timeout=30)
            self._thread = None
            raise
        return self

    def close(self) -> None:
        """Reset every connection, stop listening and join the thread; idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:  # the loop has already finished
            pass
        thread.join(timeout=30)
        self._thread = None

    def __enter__(self) -> ShapingProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a coroutine on the proxy's loop and wait for it, so its effect is complete when we return."""
        if self._thread is None or self._loop is None or not self._thread.is_alive():
            coro.close()
            raise UserError("the shaping proxy is not running: use it in a `with` block or call start()")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    # -- the loop thread ----------------------------------------------------------------------------------

    def _run(self, ready: concurrent.futures.Future[int]) -> None:
        try:
            asyncio.run(self._main(ready))
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            if not ready.done():
                ready.set_exception(exc)

    async def _main(self, ready: concurrent.futures.Future[int]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._mode = "up"
        await self._listen()
        ready.set_result(self.port)
        await self._stop.wait()
        await self._set_state("refuse", cut=True)
        self._mode = "closed"

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Forward in a task of our own: asyncio's task for this callback must not end cancelled (it would log).
        task = asyncio.get_running_loop().create_task(self._forward(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _go_down(self, mode: Mode, cut: bool, duration_s: float | None) -> None:
        await self._set_state(mode, cut=cut)
        if duration_s is not None:
            self._auto_up = asyncio.get_running_loop().create_task(self._up_after(duration_s))

    async def _up_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self._auto_up = None  # so that _set_state does not cancel this task
        await self._set_state("up", cut=False)

    async def _set_state(self, mode: str, *, cut: bool) -> None:
        if self._auto_up is not None:
            self._auto_up.cancel()
            await asyncio.gather(self._auto_up, return_exceptions=True)
            self._auto_up = None
        listening = mode in ("up", "blackhole")
        if listening and self._server is None:
            await self._listen()
        if not listening and self._server is not None:
            self._server.close()  # no wait_closed: it would wait for the connections we keep
            self._server = None
        if mode == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()
        self._mode = mode
        if cut:
            await self._cut_all()

    async def _cut_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()  # each resets both its sockets on the way out
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the aborted transports close their sockets on the next loop turn

    async def _forward(self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        with self._lock:
            self._connections += 1
        self._accepted += 1
        streams = f"{self._profile.seed}:{self._accepted}"
        server: asyncio.StreamWriter | None = None
        clean = False
        try:
            await self._flowing.wait()  # a black hole: accepted, never connected onwards
            server_reader, server = await asyncio.open_connection(*self.upstream)
            await _together(
                self._direction(client_reader, server, TO_SERVER, random.Random(f"{streams}:up")),
                self._direction(server_reader, client, TO_CLIENT, random.Random(f"{streams}:down")),
            )
            for writer in (client, server):  # both directions ended with an EOF, delivered: a clean close
                writer.close()
            for writer in (client, server):
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            clean = True
        except OSError:  # a peer reset, or the upstream refused: pass the reset on
            pass
        finally:  # after an error, a cut or a shutdown: reset both sides
            for writer in (client, server):
                if not clean and writer is not None:
                    _reset(writer)

    async def _direction(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, link: int, rng: random.Random
    ) -> None:
        """Forward one direction: a reader schedules each chunk's arrival, a writer delivers it then."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=QUEUE_CHUNKS)
        await _together(self._read(src, queue, link, rng), self._write(queue, dst, link))

    async def _read(
        self, src: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]], link: int, rng: random.Random
    ) -> None:
        while True:
            data = await src.read(CHUNK)
            await queue.put((self._arrival(len(data), link, rng), data))
            if not data:  # EOF travels like a chunk, after the data
                return

    def _arrival(self, size: int, link: int, rng: random.Random) -> float:
        """When a chunk of `size` bytes read now arrives at the other end (loop time)."""
        p = self._profile
        sent = max(asyncio.get_running_loop().time(), self._free_at[link])
        if p.bandwidth_mbps:
            sent += size * 8 / (p.bandwidth_mbps * 1e6)
        self._free_at[link] = sent
        jitter = rng.uniform(0.0, p.jitter_ms)  # drawn always, so the streams do not depend on the profile
        lost = rng.random() < p.loss
        delay_ms = p.delay_ms + jitter + (p.retransmit_ms if lost else 0.0)
        return sent + delay_ms / 1000

    async def _write(self, queue: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter, link: int) -> None:
        loop = asyncio.get_running_loop()
        while True:  # in queue order: a chunk jittered early waits for the one before it, never overtakes it
            at, data = await queue.get()
            wait = at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._flowing.wait()
            if not data:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            with self._lock:  # counted before the write, so a reader that has the bytes sees them counted
                self._bytes[link] += len(data)
            dst.write(data)
            await dst.drain()


async def _together(*coros: Coroutine[Any, Any, None]) -> None:
    """Run coroutines concurrently; the first error (or a cancellation) cancels the rest, then is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
    errors = [t.exception() for t in tasks if not t.cancelled()]
    for error in errors:
        if error is not None:
            raise error


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed peer or a cut link would, not with a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
