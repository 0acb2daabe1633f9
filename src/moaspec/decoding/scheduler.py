"""Continuous batching: one model, many sequences, one forward pass at a time over all their rows.

The server's step, after llama-server's `update_slots()` (docs/architecture.md): every
sequence with work (a prompt chunk, a draft tree, a single token) hands its rows to `Scheduler.run`
from its own thread and blocks; the scheduler's thread gathers what waits into one
`Transformer.forward_batch` (bounded rows per pass, first come first served, so no sequence waits more
passes than there are sequences ahead of it), and hands each sequence its slice of the outputs. Each
sequence then verifies, commits and drafts on its own thread while the next pass runs for the others.
Batch invariance (`Transformer.batch_invariant`) makes a sequence's outputs the same bits as alone, so
batching never changes a token.

After a pass, the sequences it served are expected back soon (they verify and draft, then submit
again): the next pass waits for them up to `gather_ms`, so that they share it rather than alternate.

Threads: the passes should run on the thread that loaded the model, and the sequences' threads should
run their own torch work on one thread each (`threads.one_thread`). torch's OpenMP runtime keeps a team
of worker threads per thread that starts parallel work; a second team on two cores made every pass
~1.5x slower (Qwen 0.5B int8: 16 -> 25 ms a step, and 19 ms even after the second thread ended), as
libgomp throttles its spin-waits once it manages more threads than there are cores. So a server runs
`run_forever` on its main thread (`own_thread=False`) and its I/O elsewhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from moaspec.errors import UserError
from moaspec.models.runtime import ForwardOut, Rows, Transformer

log = logging.getLogger("moaspec.scheduler")

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


@dataclass(eq=False)
class _Item:
    rows: Rows
    owner: object
    model: Transformer
    future: Future = field(default_factory=Future)
    queued_at_pass: int = 0


class Scheduler:
    """Runs the forward passes of every sequence of one model in one thread, batched. Sequences of another
    model over the same process (the same weights in another mode) may submit theirs too (`run(model=)`):
    a pass then stacks the items of the first model waiting, and the others wait their turn in order."""

    def __init__(self, model: Transformer, max_rows: int = 256, gather_ms: float = 5.0, own_thread: bool = True):
        """`own_thread`: run the passes on a thread of its own (started here), else on the thread that calls
        `run_forever`."""
        if not isinstance(max_rows, int) or max_rows < 1:
            raise UserError(f"max_rows must be a positive integer, got {max_rows!r}")
        if not gather_ms >= 0:
            raise UserError(f"gather_ms must be >= 0, got {gather_ms!r}")
        self.model = model
        self.threads = torch.get_num_threads()  # the passes' kernels use the process's thread count
        self.max_rows = max_rows
        self.gather_s = gather_ms / 1e3
        self.stats = SchedulerStats()
        self._queue: deque[_Item] = deque()
        self._expected: set[int] = set()  # owners served by the last pass, not back yet
        self._cond = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None  # what stopped the loop, if anything did
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

    def run(self, rows: Rows, owner: object, model: Transformer | None = None) -> ForwardOut:
        """The outputs of `rows` (one sequence's, `owner` its session; `model` if not the scheduler's own),
        from the next pass that has room."""
        return self.submit(rows, owner, model).result()

    def submit(self, rows: Rows, owner: object, model: Transformer | None = None) -> Future:
        rows.cache.check_room(rows.n)  # here, not in the pass: one sequence's overflow must not fail a batch
        if rows.n > self.max_rows:
            raise UserError(f"{rows.n} rows in one pass; this scheduler runs at most {self.max_rows}")
        item = _Item(rows, owner, model or self.model)
        with self._cond:
            if self._closed:
                raise self._stopped()
            item.queued_at_pass = self.stats.passes
            self._queue.append(item)
            self._expected.discard(id(owner))
            self._cond.notify_all()
        return item.future

    def leave(self, owner: object) -> None:
        """`owner` will send nothing more for now (its generation ended or paused): do not wait for it."""
        with self._cond:
            self._expected.discard(id(owner))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._cond:
            waiting, self._queue = list(self._queue), deque()
        for item in waiting:
            if not item.future.done():
                item.future.set_exception(self._stopped())

    def _stopped(self) -> UserError:
        if self.failure is None:
            return UserError("the scheduler is shut down")
        return UserError(f"the scheduler stopped ({type(self.failure).__name__}: {self.failure})")

    def check_health(self) -> None:
        """Raise if the passes stopped (their thread died, or the loop failed): a replica's health check, so that
        Ray Serve replaces a replica whose requests would otherwise wait forever."""
        if self.failure is not None:
            raise RuntimeError(f"the scheduler stopped: {type(self.failure).__name__}: {self.failure}")
        if self._thread is not None and not self._thread.is_alive() and not self._closed:
            raise RuntimeError("the scheduler's thread is gone")

    # ------------------------------------------------------------------ the loop
    def _gather(self, timeout_s: float | None = None) -> list[_Item] | None:
        """The next pass's items (waiting up to `timeout_s` for the first: [] if none came); None once closed."""
        with self._cond:
            if not self._queue and not self._closed:
                self._cond.wait_for(lambda: self._queue or self._closed, timeout_s)
            if self._closed:
                return None
            if not self._queue:
                return []
            deadline = time.perf_counter() + self.gather_s
            while self._expected and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            model = self._queue[0].model
            batch, rows, later = [], 0, []
            while self._queue and (not batch or rows + self._queue[0].rows.n <= self.max_rows):
                item = self._queue.popleft()
                if item.model is not model:
                    later.append(item)
                    continue
                batch.append(item)
                rows += item.rows.n
            self._queue.extendleft(reversed(later))
            return batch

    def run_forever(self) -> None:
        """Run passes until `close` (on the scheduler's own thread, or the caller's). If the loop itself fails, every
        waiting and later request fails at once with the reason, instead of waiting for passes that never come."""
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

    def step(self, timeout_s: float | None = None) -> bool:
        """Run one pass over what waits (waiting up to `timeout_s` for work: None, until some comes or the
        scheduler is closed). False once closed."""
        batch = self._gather(timeout_s)
        if batch is None:
            return False
        if not batch:
            return True
        try:
            self._pass(batch)
        except BaseException as e:  # the loop itself failed: this pass's requests learn why
            with self._cond:
                self.failure, self._closed = e, True
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(self._stopped())
            raise
        return True

    def _pass(self, batch: list[_Item]) -> None:
        t = time.perf_counter()
        model = batch[0].model
        try:
            outs = model.forward_batch([item.rows for item in batch])
        except Exception:  # one sequence's bad rows must not fail the others: run each alone
            outs = None
        for i, item in enumerate(batch):
            if outs is not None:
                item.future.set_result(outs[i])
                continue
            try:
                item.future.set_result(model.forward_batch([item.rows])[0])
            except Exception as e:
                item.future.set_exception(e)
        s = self.stats
        s.busy_s += time.perf_counter() - t
        rows = sum(item.rows.n for item in batch)
        s.rows_per_pass[next((b for b in ROW_BUCKETS if rows <= b), float("inf"))] += 1
        s.seqs_per_pass[len(batch)] += 1
        s.max_wait_passes = max(s.max_wait_passes, *(s.passes - item.queued_at_pass for item in batch))
        s.passes += 1
        s.rows += rows
        s.sequences += len(batch)
        with self._cond:
            self._expected = {id(item.owner) for item in batch} - {id(i.owner) for i in self._queue}
