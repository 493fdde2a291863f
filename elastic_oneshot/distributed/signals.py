"""SIGTERM, the spot-preemption notice: stop at the next safe point, or leave after a grace period.

Every commit is atomic, so dying at any instant is safe; stopping at a safe point only avoids wasting
the layers computed but not yet committed (the runner asks every rank at each commit, and every rank
commits them before the ranks that received it stop), and says what happened. SIGTERM is blocked in every thread and
taken by a dedicated thread with sigwait, so it is seen even while the main thread waits in a
collective (where a Python signal handler would not run).
"""

import logging
import signal
import threading
import time

from elastic_oneshot.errors import exit_now, report

log = logging.getLogger("elastic_oneshot")
EXIT_CODE = 128 + signal.SIGTERM

_requested = threading.Event()
_ending = threading.Event()
_on_request = []


class Preempted(Exception):
    """Raised at a safe point after SIGTERM: nothing partial was committed."""


def install(grace_s: float = 20.0):
    """Call first thing in the process's main thread, before other threads exist."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait():
        signal.sigwait({signal.SIGTERM})
        if _ending.is_set():
            return
        log.warning("SIGTERM: stopping at the next safe point (at most %.0f s)", grace_s)
        for callback in _on_request:
            callback()
        _requested.set()
        time.sleep(grace_s)
        report(f"no safe point within {grace_s:.0f} s of SIGTERM: exiting now", after_bar=True)
        exit_now(EXIT_CODE)

    threading.Thread(target=wait, name="sigterm", daemon=True).start()


def ending():
    """The process is ending on its own, its error line out: a SIGTERM from now on (the agent's, once
    agent.end_restarts has ended it) changes nothing, and says nothing."""
    _ending.set()


def on_request(callback):
    _on_request.append(callback)


def requested() -> bool:
    """Whether SIGTERM was received: the runner asks every rank at each commit, so that all commit what they
    computed before the ranks that received it stop."""
    return _requested.is_set()


def check(where: str):
    if _requested.is_set():
        raise Preempted(f"stopped by SIGTERM {where}")
