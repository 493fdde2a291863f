"""Errors the command line reports as one line, without a traceback (docs/troubleshooting.md lists them)."""

import errno
import logging
import os
import sys


def report(message: str, after_bar: bool = False):
    """The one line every error ends in, on stderr: from the command line, or (`after_bar`: on a line of its own
    below a progress bar that may be mid-draw) from a thread that must end the process at once. Written in one
    call: torchrun's workers run unbuffered (`python -u`) on one shared stderr, where print's separate write of the
    newline let another worker's line in between."""
    sys.stderr.write(f"{chr(10) if after_bar else ''}elastic-oneshot: error: {message}\n")
    sys.stderr.flush()


def exit_now(code: int):
    """End the process at once, from a watchdog thread, once its one error line is out (`report`): logs flushed,
    then os._exit, which waits for nothing (not for a collective or a store that may be the silent peer's)."""
    logging.shutdown()
    os._exit(code)


class UsageError(Exception):
    """Bad input from the user: a missing model, a dataset too small, a foreign state directory..."""


class CorruptStateError(UsageError):
    """A state file does not match its recorded checksum or cannot be parsed."""


class StaleEpochError(Exception):
    """A newer epoch of workers has begun: this worker must not commit anything and should exit."""


class StorageError(Exception):
    """A state file could not be written (a full disk, a read-only or vanished directory). Nothing partial
    is committed, so the same command resumes once the cause is fixed; the path and errno say where to look."""

    def __init__(self, path: str, error: OSError):
        code = errno.errorcode.get(error.errno, str(error.errno))
        super().__init__(f"cannot write {path}: {error.strerror or error} ({code})")
