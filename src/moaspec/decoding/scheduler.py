"""Continuous batching: one model, many sequences, one forward pass at a time over all their rows.

The server's step is llama-server's `update_slots()` (docs/architecture.md). Every generation runs as a
*slot* on the scheduler's loop (`call`): a greenlet on the loop's thread that runs the ordinary blocking
code (`Engine.stream`, a target server's `verify`) until it needs a pass (`run`), where it parks. One turn
of the loop (`step`) starts the slots that came, gathers the rows of every parked slot into one
`Transformer.forward_batch` (bounded rows per pass, first come first served, so no sequence waits more
passes than there are sequences ahead of it), then hands each slot its slice of the outputs and runs it on
(verify, commit, draft, stream its tokens) until it parks on its next pass or ends. Batch invariance
(`Transformer.batch_invariant`) makes a sequence's outputs the same bits as alone, so batching never
changes a token.

All of it runs on one thread, the one that loaded the model: torch's OpenMP runtime keeps a team of worker
threads per thread that starts parallel work, and a second team on two cores made every pass ~1.5x slower
(Qwen 0.5B int8: 16 -> 25 ms a step), as libgomp throttles its spin-waits once it manages more threads
than there are cores. So a server runs `run_forever` on its main thread (`own_thread=False`) and its I/O
elsewhere.

Slots whose rows are not back after a pass (a target server's session, whose next tree crosses the network)
are waited for up to `gather_ms`, so that they share the next pass rather than alternate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from greenlet import greenlet

from moaspec.errors import UserError
from moaspec.models.runtime import ForwardOut, Rows, Transformer

log = logging.getLogger("moaspec.scheduler")

T = TypeVar("T")
_END = object()
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the histogram of rows per pass


@dataclass
class SchedulerStats:
    """What the scheduler has done (read by the servers' /metrics)."""

    passes: int = 0
    rows: int = 0
    sequences: int = 0  # sequence slots over all passes (a pass over 3 sequences counts 3)
    busy_s: float = 0.0  # time spent in passes
    rows_per_pass: Counter = field(default_factory=Counter)  # bucket (ROW_BUCKETS, +inf) -> passes
    seqs_per_pass: Counter = field(default_factory=Counter)
    max_wait_passes: int = 0  # the most passes any item waited in the queue before its own


class _Slot(greenlet):
    """One call (`Scheduler.call`) running on the scheduler's loop; `future` gets what it returns or raises."""

    def __init__(self, scheduler: Scheduler, fn: Callable[..., Any], args: tuple, future: Future):
        super().__init__(self._body, parent=scheduler._hub)
        self.scheduler, self.fn, self.args, self.future = scheduler, fn, args, future

    def _body(self) -> None:
        try:  # under the loop's no_grad (`step`, `_shut`): grad mode is the thread's, not the greenlet's
            result = self.fn(*self.args)
        except BaseException as e:
            self.future.set_exception(e)
            if not isinstance(e, Exception):  # Ctrl-C, SystemExit: the loop's to handle, not this call's
                raise
        else:
            self.future.set_result(result)


@dataclass(eq=False)
class _Item:
    rows: Rows
    owner: object
    model: Transformer
    slot: _Slot  # parked until its pass
    queued_at_pass: int = 0


class Scheduler:
    """Runs the forward passes of every sequence of one model in one loop, batched. Sequences of another
    model over the same process (the same weights in another mode) may submit theirs too (`run(model=)`):
    a pass then stacks the items of the first model waiting, and the others wait their turn in order."""

    def __init__(self, model: Transformer, max_rows: int = 256, gather_ms: float = 5.0, own_thread: bool = True):
        """`own_thread`: run the loop on a thread of its own (started here), else on the thread that calls
        `run_forever` (or `step`)."""
        if not isinstance(max_rows, int) or max_rows < 1:
            raise UserError(f"max_rows must be a positive integer, got {max_rows!r}")
        if not gather_ms >= 0:
            raise UserError(f"gather_ms must be >= 0, got {gather_ms!r}")
        self.model = model
        self.threads = torch.get_num_threads()  # the passes' kernels use the process's thread count
        self.max_rows = max_rows
        self.gather_s = gather_ms / 1e3
        self.stats = SchedulerStats()
        self._queue: deque[_Item] = deque()  # rows waiting for a pass
        self._arrivals: deque[tuple[Callable[..., Any], tuple, Future]] = deque()  # calls not started yet
        self._paused: list[_Slot] = []  # slots that let a pass go first (`pause`)
        self._expected: set[int] = set()  # owners served by the last pass, not back yet
        self._cond = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None  # what stopped the loop, if anything did
        self._hub: greenlet | None = None  # the loop's own greenlet (its thread's main one): slots park into it
        self._thread: threading.Thread | None = None
        if own_thread:
            self._thread = threading.Thread(target=self.run_forever, name="moaspec-scheduler", daemon=True)
            self._thread.start()

    @property
    def has_thread(self) -> bool:
        return self._thread is not None

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def batched(self) -> bool:
        """Whether passes really stack sequences (else they run one after another inside a pass)."""
        return self.model.batch_invariant()

    def call(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` as a slot on the loop; its passes (`run`) park it until the loop has run them."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise self._stopped()
            self._arrivals.append((fn, args, future))
            self._cond.notify_all()
        return future

    def completed(self, fn: Callable[[Any], T], items: Iterable[Any], parallel: int) -> Iterator[Future[T]]:
        """Run `fn(item)` for each of `items` as slots, at most `parallel` at once, driving the loop on this thread;
        yield each one's future as it finishes (a batch job's loop: `pipeline.generate_many`)."""
        todo, running = iter(items), []
        while True:
            while len(running) < parallel and (item := next(todo, _END)) is not _END:
                running.append(self.call(fn, item))
            if not running:
                return
            self.step(timeout_s=0.01)
            for f in [f for f in running if f.done()]:
                running.remove(f)
                yield f

    def run(self, rows: Rows, owner: object, model: Transformer | None = None) -> ForwardOut:
        """The outputs of `rows` (one sequence's, `owner` its session; `model` if not the scheduler's own),
        from the next pass that has room; the slot that asks (`call`) parks until then."""
        rows.cache.check_room(rows.n)  # here, not in the pass: one sequence's overflow must not fail a batch
        if rows.n > self.max_rows:
            raise UserError(f"{rows.n} rows in one pass; this scheduler runs at most {self.max_rows}")
        slot = greenlet.getcurrent()
        if not (isinstance(slot, _Slot) and slot.scheduler is self):
            raise RuntimeError("a scheduler runs the passes of its slots only: run the generation with "
                               "Scheduler.call")
        item = _Item(rows, owner, model or self.model, slot)
        with self._cond:
            if self._closed:
                raise self._stopped()
            item.queued_at_pass = self.stats.passes
            self._queue.append(item)
            self._expected.discard(id(owner))
            self._cond.notify_all()
        return self._hub.switch()

    def _pause(self, slot: _Slot) -> None:
        with self._cond:
            if self._closed:
                raise self._stopped()
            self._paused.append(slot)
            self._cond.notify_all()
        self._hub.switch()

    def leave(self, owner: object) -> None:
        """`owner` will send nothing more for now (its generation ended or paused): do not wait for it."""
        with self._cond:
            self._expected.discard(id(owner))
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the loop; what waits for it fails with the reason (slots unwind on the loop's thread)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self._hub is None or self._hub is greenlet.getcurrent():
            self._shut()

    def _stopped(self) -> UserError:
        if self.failure is None:
            return UserError("the scheduler is shut down")
        return UserError(f"the scheduler stopped ({type(self.failure).__name__}: {self.failure})")

    def _shut(self) -> None:
        with self._cond:
            waiting, self._queue = list(self._queue), deque()
            arrivals, self._arrivals = list(self._arrivals), deque()
            paused, self._paused = self._paused, []
        for _fn, _args, future in arrivals:
            future.set_exception(self._stopped())
        with torch.no_grad():  # as in `step`: the slots unwinding leave their no_grad blocks (grad mode is per thread)
            for item in waiting:
                self._hand(item, self._stopped())
            for slot in paused:
                if not slot.dead:
                    slot.throw(self._stopped())

    def check_health(self) -> None:
        """Raise if the passes stopped (their thread died, or the loop failed): a replica's health check, so that
        Ray Serve replaces a replica whose requests would otherwise wait forever."""
        if self.failure is not None:
            raise RuntimeError(f"the scheduler stopped: {type(self.failure).__name__}: {self.failure}")
        if self._thread is not None and not self._thread.is_alive() and not self._closed:
            raise RuntimeError("the scheduler's thread is gone")

    # ------------------------------------------------------------------ the loop
    def run_forever(self) -> None:
        """Run the loop until `close` (on the scheduler's own thread, or the caller's). If the loop itself fails,
        every waiting and later request fails at once with the reason, instead of waiting for passes that never
        come."""
        torch.set_num_threads(self.threads)
        try:
            while self.step():
                pass
        except BaseException as e:
            self.failure = self.failure or e
            log.error("the scheduler stopped", exc_info=e)
            self.close()
            if threading.current_thread() is not self._thread:  # the server's main loop: it ends too
                raise
        self._shut()

    def step(self, timeout_s: float | None = None) -> bool:
        """One turn of the loop (waiting up to `timeout_s` for work; None: until some comes or the scheduler
        is closed): start the slots that came, then one pass over the rows that wait, each slot running on
        until its next pass or its end. False once closed."""
        if self._hub is None:
            self._hub = greenlet.getcurrent()
        elif self._hub is not greenlet.getcurrent():
            raise RuntimeError("a scheduler's loop runs on one thread only")
        with self._cond:
            if not (self._queue or self._arrivals or self._paused or self._closed):
                self._cond.wait_for(lambda: self._queue or self._arrivals or self._paused or self._closed, timeout_s)
        with torch.no_grad():  # for good while slots run: one that leaves its own no_grad must not turn it off
            return self._turn()

    def _turn(self) -> bool:
        deadline = time.perf_counter() + self.gather_s
        while True:  # start what came; wait a little for the owners of the last pass
            self._start_arrivals()
            with self._cond:
                left = deadline - time.perf_counter()
                if self._closed or not self._queue or not self._expected or self._paused or left <= 0:
                    break
                self._cond.wait_for(lambda: self._arrivals or not self._expected or self._closed, left)
        batch = self._take_batch()
        if batch is None:
            return False
        try:
            if batch:
                self._pass(batch)
        except BaseException as e:  # the loop itself failed: this pass's requests learn why
            with self._cond:
                self.failure, self._closed = e, True
            for item in batch:
                self._hand(item, self._stopped())
            raise
        with self._cond:
            paused, self._paused = self._paused, []
        for slot in paused:  # the pass went first: they go on
            slot.switch()
        return True

    def _start_arrivals(self) -> None:
        with self._cond:
            arrivals, self._arrivals = list(self._arrivals), deque()
        for fn, args, future in arrivals:
            if future.set_running_or_notify_cancel():
                _Slot(self, fn, args, future).switch()  # runs until it parks on a pass or ends

    def _take_batch(self) -> list[_Item] | None:
        """The next pass's items: the first waiting model's, up to `max_rows` rows; None once closed."""
        with self._cond:
            if self._closed:
                return None
            batch, rows, later = [], 0, []
            model = self._queue[0].model if self._queue else None
            while self._queue and (not batch or rows + self._queue[0].rows.n <= self.max_rows):
                item = self._queue.popleft()
                if item.model is not model:
                    later.append(item)
                    continue
                batch.append(item)
                rows += item.rows.n
            self._queue.extendleft(reversed(later))
            if batch:
                self._expected = {id(item.owner) for item in batch}
            return batch

    def _pass(self, batch: list[_Item]) -> None:
        t = time.perf_counter()
        model = batch[0].model
        try:
            outs: list = model.forward_batch([item.rows for item in batch])
        except Exception:  # one sequence's bad rows must not fail the others: run each alone
            outs = []
            for item in batch:
                try:
                    outs.append(model.forward_batch([item.rows])[0])
                except Exception as e:
                    outs.append(e)
        s = self.stats
        s.busy_s += time.perf_counter() - t
        rows = sum(item.rows.n for item in batch)
        s.rows_per_pass[next((b for b in ROW_BUCKETS if rows <= b), float("inf"))] += 1
        s.seqs_per_pass[len(batch)] += 1
        s.max_wait_passes = max(s.max_wait_passes, *(s.passes - item.queued_at_pass for item in batch))
        s.passes += 1
        s.rows += rows
        s.sequences += len(batch)
        for item, out in zip(batch, outs, strict=True):
            if isinstance(out, ForwardOut):
                out.pass_rows = rows  # what a slot's rows shared the pass with (an adaptive tree prices by it)
            self._hand(item, out)

    def _hand(self, item: _Item, out: ForwardOut | BaseException) -> None:
        """Give `item`'s slot its outputs (or what failed): it runs on until it parks again or ends."""
        if not item.slot.dead:
            item.slot.throw(out) if isinstance(out, BaseException) else item.slot.switch(out)


def pause() -> None:
    """Let the loop run a pass for the other slots before going on: long work between two passes (a drafter
    taking in a whole prompt) calls it between pieces, so that it never stalls the others for long, as a
    thread of its own would not have. Outside a slot it does nothing."""
    slot = greenlet.getcurrent()
    if isinstance(slot, _Slot):
        slot.scheduler._pause(slot)
