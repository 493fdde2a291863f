"""Prometheus metrics from every rank (`--metrics-port`): fleets are watched in Prometheus and Grafana, and paged on,
not by reading `status` on a shared volume.

Until `serve` serves a port, every hook returns at once, so the loop, the state, the retries and the watchdog
call them freely. The values are plain numbers kept here, under one lock; a scrape reads them through one
collector, labelled with the job (the first 16 hex digits of its fingerprint), the rank, the node (the host name)
and the epoch as they are at that moment. prometheus_client serves them from daemon threads: a scrape never waits
for the loop, the loop never waits for a scrape, and the server dies with the worker. docs/operations.md lists
every metric; launch/alerts.rules.yml alerts on them.
"""

import os
import socket
import threading
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from elastic_oneshot.errors import UsageError
from elastic_oneshot.events import History

PORT_ENV = "ELASTIC_ONESHOT_METRICS_PORT"
PREFIX = "elastic_oneshot_"
METRICS = {  # name: (type, label besides job_id, rank, node and epoch, help)
    "layers": ("gauge", None, "decoder layers of the model"),
    "layers_committed": ("gauge", None, "layers committed, as this epoch sees them"),
    "commits": ("counter", None, "layers this process committed"),
    "last_commit_timestamp_seconds": ("gauge", None, "when this process last committed a layer (Unix time)"),
    "layer_phase_seconds": ("gauge", "phase", "seconds of each phase of the last committed layer "
                                              "(commit: waiting for storage and for the other ranks)"),
    "storage_wait_seconds": ("counter", None, "seconds the layer loop waited for storage (the commit phases)"),
    "epoch": ("gauge", None, "the epoch these workers began"),
    "world_size": ("gauge", None, "ranks in this epoch"),
    "restarts": ("gauge", None, "restarts of the workers since the job began (rank 0)"),
    "lost_seconds": ("gauge", None, "time lost to failures when this epoch began, as status counts it (rank 0)"),
    "durable_boundary": ("gauge", None, "the newest durable boundary a restart would start from (a layer)"),
    "replay_layers": ("gauge", None, "layers a restart now would replay from that boundary"),
    "storage_written_bytes": ("counter", "store", "bytes written to the state"),
    "storage_read_bytes": ("counter", "store", "bytes read from the state"),
    "retries": ("counter", "service", "retries of remote calls after transient errors (storage, etcd)"),
    "peer_silence_seconds": ("gauge", "peer", "seconds since the liveness watchdog last heard from each peer rank"),
}

_on = False
_lock = threading.Lock()
_values: dict[str, dict[str, float]] = {name: {} for name in METRICS}  # name -> {its own label's value: value}
_labels = {"job_id": "", "rank": os.environ.get("RANK", "0"), "node": socket.gethostname(), "epoch": "0"}
_layers = 0


def serve(port: int | None = None):
    """Serve the metrics on `port` (None: ELASTIC_ONESHOT_METRICS_PORT; 0 or unset: off) plus this worker's
    LOCAL_RANK, on every interface. A port taken is a UsageError, before any work."""
    global _on
    where = "--metrics-port"
    if port is None:
        where, text = PORT_ENV, os.environ.get(PORT_ENV) or "0"
        if not text.isdigit():
            raise UsageError(f"{PORT_ENV}={text}: expected a port number, or 0 for no metrics")
        port = int(text)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if port == 0 or _on:
        return
    if not 0 < port + local < 65536:
        raise UsageError(f"{where} {port}: expected a port from 1 to 65535 (local rank {local} serves on "
                         f"{port + local}), or 0 for no metrics")
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Collector())
    try:
        start_http_server(port + local, registry=registry)
    except OSError as e:
        raise UsageError(f"cannot serve metrics on port {port + local} of {_labels['node']} ({where} {port} + local "
                         f"rank {local}): {e.strerror or e}; choose a free port") from None
    _on = True


def job(fingerprint: str):
    """The job being run, by its fingerprint (job.json)."""
    _labels["job_id"] = fingerprint[:16]


def epoch_began(epoch: int, world_size: int, layers: int, committed: dict, durable: list[int]):
    """A new epoch of `world_size` ranks, on the `committed` layers (of `layers`) and the `durable` boundaries."""
    global _layers
    if not _on:
        return
    with _lock:
        _labels["epoch"], _layers = str(epoch), layers
        _set("epoch", epoch)
        _set("world_size", world_size)
        _set("layers", layers)
        _progress(committed, durable)


def history(state):
    """Rank 0, once an epoch has begun: the job's restarts and the time lost to failures, from the events of
    `state` (a StateStore), read only when the metrics are served."""
    if not _on:
        return
    history = History(state.events())
    lost = history.lost_spans(_layers, time.time())
    with _lock:
        _set("restarts", history.restarts)
        _set("lost_seconds", sum(b - a for a, b in lost))


def committed(seconds: dict[str, float], layers: dict, durable: list[int]):
    """A layer was committed, its phases having taken `seconds`; `layers` are the committed layers now, `durable`
    the durable boundaries."""
    if not _on:
        return
    with _lock:
        _add("commits", 1)
        _set("last_commit_timestamp_seconds", time.time())
        _values["layer_phase_seconds"] = dict(seconds)
        _add("storage_wait_seconds", seconds.get("commit", 0.0))
        _progress(layers, durable)


def bytes_written(store: str, n: int):
    if _on:
        with _lock:
            _add("storage_written_bytes", n, store)


def bytes_read(store: str, n: int):
    if _on:
        with _lock:
            _add("storage_read_bytes", n, store)


def retried(service: str):
    """A remote call of `service` failed transiently and is tried again."""
    if _on:
        with _lock:
            _add("retries", 1, service)


def silence(peer: int, seconds: float):
    """The liveness watchdog last heard from rank `peer` `seconds` ago."""
    if _on:
        with _lock:
            _set("peer_silence_seconds", seconds, str(peer))


def _set(name: str, value: float, label: str = ""):
    _values[name][label] = value


def _add(name: str, value: float, label: str = ""):
    _values[name][label] = _values[name].get(label, 0.0) + value


def _progress(layers: dict, durable: list[int]):
    """Layers committed, the newest durable boundary at or below the first layer to do, and the layers between."""
    following = next((layer for layer in range(_layers) if layer not in layers), _layers)
    boundary = max((b for b in durable if b <= following), default=0)
    _set("layers_committed", len(layers))
    _set("durable_boundary", boundary)
    _set("replay_layers", following - boundary)


class _Collector:
    """Every metric as it is now, with the labels as they are now."""

    def collect(self):
        with _lock:
            values, labels = {name: dict(v) for name, v in _values.items()}, dict(_labels)
        for name, (kind, own, text) in METRICS.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                PREFIX + name, text, labels=[*labels, *([own] if own else [])])
            for label, value in sorted(values[name].items()):
                family.add_metric([*labels.values(), *([label] if own else [])], value)
            yield family
