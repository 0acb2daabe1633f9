"""Stopping a long job cleanly: SIGTERM/SIGINT ask it to stop at its next safe point, saved, so that a
job spread over several sessions loses nothing when a session ends it (a second signal still kills)."""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """Catches SIGTERM and SIGINT (where they are not ignored, as in a background job started by a script)
    until `restore`; `requested` says whether one came. `listen=False`: a request that never comes."""

    def __init__(self, listen: bool = True) -> None:
        self.requested = False
        self._old: dict[int, object] = {}
        if listen and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            self.restore()
            signal.raise_signal(signum)
        self.requested = True

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)  # None: not set from Python
        self._old = {}
