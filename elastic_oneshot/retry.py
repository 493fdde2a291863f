"""The one retry policy of every remote call (object store, etcd): jittered exponential backoff from 0.1 s, at
most 2 s apart, for a budget of seconds; each caller says which errors are transient for its service. Every retry
counts in the metrics (metrics.retried)."""

from collections.abc import Callable

import tenacity

from elastic_oneshot import metrics


def retrying(service: str, seconds: float, transient: Callable[[BaseException], bool],
             before_sleep=None) -> tenacity.Retrying:
    """A tenacity.Retrying of calls to `service` ("storage", "etcd") that retries while `transient(error)` for
    `seconds`, then raises the last error."""
    def counted(attempt):
        metrics.retried(service)
        if before_sleep:
            before_sleep(attempt)

    return tenacity.Retrying(stop=tenacity.stop_after_delay(seconds),
                             wait=tenacity.wait_random_exponential(multiplier=0.1, max=2),
                             retry=tenacity.retry_if_exception(transient), reraise=True, before_sleep=counted)
