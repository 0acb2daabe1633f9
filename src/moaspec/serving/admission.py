"""Admission of generations by memory: capacity follows from what their KV caches may fill, not from a
constant. Each generation reserves its bytes for its life; one that does not fit waits in a bounded
first-come-first-served queue, and beyond that the caller is told when to retry (`Busy`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

from moaspec.link.protocol import Busy, ProtocolError


class Admission:
    """`budget` bytes shared by the generations in progress (one event loop's), at most `max_holders` of
    them at once (None: as many as fit)."""

    def __init__(self, budget: int, max_waiting: int, max_holders: int | None = None):
        self.budget, self.max_waiting, self.max_holders = budget, max_waiting, max_holders
        self.used = 0
        self.holders = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._hold_s = 5.0  # moving average of how long a reservation is held

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def retry_after(self) -> int:
        """Seconds after which a refused caller may find room: the queue ahead of it drained at the rate
        reservations have been given back."""
        rate = max(1, self.holders) / max(self._hold_s, 0.1)
        return int(min(60, max(1, math.ceil((self.waiting + 1) / rate))))

    async def acquire(self, nbytes: int, on_wait: Callable[[int], Awaitable[None]] | None = None,
                      every_s: float = 5.0) -> float:
        """Reserve `nbytes`, waiting for room (FIFO); `on_wait(position)` is awaited when the wait begins
        and every `every_s` while it lasts. Returns the time of the grant (for `release`)."""
        if nbytes > self.budget:
            raise ProtocolError(f"this generation needs {nbytes / 2**20:.0f} MiB of KV cache; the server has "
                                f"{self.budget / 2**20:.0f} MiB in all: ask for fewer tokens")
        if not self._waiters and self._fits(nbytes):
            return self._grant(nbytes)
        if self.full():
            wait = self.retry_after()
            raise Busy(f"the server is busy: {self.waiting} generations are waiting for memory; retry after "
                       f"{wait} s", wait)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (nbytes, fut)
        self._waiters.append(entry)
        try:
            while True:
                if on_wait is not None:
                    await on_wait(self._waiters.index(entry) + 1 if entry in self._waiters else 0)
                done, _ = await asyncio.wait({fut}, timeout=every_s)
                if done:
                    return fut.result()
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():  # granted while we were going away: give it back
                self.release(nbytes, fut.result())
            self._wake()
            raise

    def full(self) -> bool:
        """Whether a caller that cannot run at once would be refused (the queue is full)."""
        return len(self._waiters) >= self.max_waiting

    def _fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.budget and (self.max_holders is None or self.holders < self.max_holders)

    def _grant(self, nbytes: int) -> float:
        self.used += nbytes
        self.holders += 1
        return time.monotonic()

    def release(self, nbytes: int, granted_at: float) -> None:
        self.used -= nbytes
        self.holders -= 1
        self._hold_s = 0.8 * self._hold_s + 0.2 * (time.monotonic() - granted_at)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(self._grant(nbytes))
