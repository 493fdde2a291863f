"""The watchdogs' one loop: a daemon thread that checks something every interval, and leaves when it fails.

A worker must leave on its own when it can no longer take part safely (a silent peer, a lost etcd lease), even while
its main thread waits in a collective: the thread calls `lost` with the reason, which reports it and ends the
process at once (errors.exit_now)."""

import threading
from collections.abc import Callable


class Watchdog:
    """Calls `step()` every `interval` seconds, on a daemon thread named `name`, until `stop()`. The first reason
    `step` returns, or error it raises, goes to `lost(reason)` (unless stopped meanwhile), and the thread ends."""

    def __init__(self, name: str, step: Callable[[], str | None], interval: float, lost: Callable[[str], None]):
        self._step, self._interval, self._lost = step, interval, lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self):
        """No further step; waits for the one under way (a step is short)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self):
        while True:
            try:
                reason = self._step()
            except Exception as e:
                reason = str(e) or type(e).__name__
            if self._stop.is_set():
                return
            if reason is not None:
                self._lost(reason)
                return
            if self._stop.wait(self._interval):
                return
