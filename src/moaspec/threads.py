"""How many threads decoding uses, chosen so that other work on the machine does not collapse it.

Decoding is a long series of short parallel matmuls; every one ends in a barrier. When another
process holds one of the cores, a thread that waits there for a descheduled sibling spins away its
time slice (with two threads beside one busy process: SmolLM2 26 tok/s, against 72 with one thread).
So the default is the number of cores idle at start (sampled from /proc/stat for a fifth of a
second). Letting waiting threads sleep instead (`OMP_WAIT_POLICY=PASSIVE`) was measured and left as the
user's choice: it keeps 57 tok/s beside the busy process, but on a quiet machine every kernel call pays
the wake-up (a 9728x896 fp16 layer: 0.43 instead of 0.30 ms).
"""

from __future__ import annotations

import os
import time

from moaspec.errors import UserError

MAX_THREADS = 256


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])


def idle_cores(sample_s: float = 0.2) -> float | None:
    """Cores idle over the next `sample_s` seconds, machine-wide (None where /proc/stat is missing)."""
    a = _cpu_times()
    time.sleep(sample_s)
    b = _cpu_times()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


def default_threads() -> int:
    """The cores idle now, rounded, at least one and at most the usable ones."""
    usable = usable_cores()
    idle = idle_cores()
    if idle is None:
        return usable
    return max(1, min(usable, int(idle + 0.5)))


def set_threads(n: int | None) -> int:
    """Use `n` threads for the model's kernels (None: `default_threads()`); returns the number set."""
    import torch

    if n is None:
        n = default_threads()
    if not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise UserError(f"threads must be an integer from 1 to {MAX_THREADS} (this machine has {usable_cores()} "
                        f"usable cores), not {n!r}")
    torch.set_num_threads(n)
    return n


def one_thread() -> None:
    """Run this thread's torch work on this thread alone: for worker threads beside a `Scheduler`'s loop
    (tokenizing, forking a decoder, a remote target's generations), so that they start no OpenMP team of their
    own beside the one of the passes (see `decoding.scheduler`)."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
