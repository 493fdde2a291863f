"""torchrun's agent, seen from its worker: a usage error is final, so the worker ends its agent rather than let it
restart workers that would refuse the same way.

torchrun restarts a failed worker group up to --max-restarts times (launch/ and the README set 100), whatever the
exit code: a bad recipe, or a model edited mid-run, would be refused again after every restart's start and
rendezvous, on every node, each worker printing its line. torchrun has no exit code for "do not retry", so the worker
sends its agent the SIGTERM a scheduler would: the agent stops its workers and ends (non-zero), leaving the
rendezvous open, so that other nodes, whose input may be sound, go on without this one.
"""

import logging
import os
import signal

log = logging.getLogger("elastic_oneshot")


def end_restarts() -> bool:
    """SIGTERM to this worker's torchrun agent (its parent), where the agent has restarts left; whether it was sent."""
    try:
        left = int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) - int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    except (KeyError, ValueError):
        return False  # not a worker of torchrun's
    agent = os.getppid()
    try:
        with open(f"/proc/{agent}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    if left <= 0 or not any(a.endswith(b"torchrun") or a == b"torch.distributed.run" for a in args):
        return False
    if not _first(os.environ.get("TORCHELASTIC_ERROR_FILE")):
        return True  # another worker of this attempt has ended it: a second signal would break its shutdown
    log.warning("a usage error is not retried: ending torchrun's agent (pid %d), which would restart the workers "
                "%d more times to be refused the same way", agent, left)
    os.kill(agent, signal.SIGTERM)
    return True


def _first(error_file: str | None) -> bool:
    """Whether this is the first worker of the agent's attempt to end it: a file made exclusively in the attempt's
    folder, the parent of each worker's (TORCHELASTIC_ERROR_FILE: .../attempt_N/LOCAL_RANK/error.json)."""
    if not error_file:
        return True
    try:
        os.close(os.open(os.path.join(os.path.dirname(os.path.dirname(error_file)), "elastic-oneshot-ended"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True
