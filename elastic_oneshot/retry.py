"""The one retry policy of every remote call (object store, etcd): jittered exponential backoff from 0.1 s, at
most 2 s apart, for a budget of seconds; each caller says which errors are transient for its service."""

from collections.abc import Callable

import tenacity


def retrying(seconds: float, transient: Callable[[BaseException], bool], before_sleep=None) -> tenacity.Retrying:
    """A tenacity.Retrying that retries while `transient(error)` for `seconds`, then raises the last error."""
    return tenacity.Retrying(stop=tenacity.stop_after_delay(seconds),
                             wait=tenacity.wait_random_exponential(multiplier=0.1, max=2),
                             retry=tenacity.retry_if_exception(transient), reraise=True, before_sleep=before_sleep)
