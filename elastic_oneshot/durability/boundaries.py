"""Activation boundaries: which layers' inputs also go to storage, written behind the computation.

Activations stay in each rank's host memory from one layer to the next. A layer's commit carries its
weights and the data cursor and never waits for a boundary: boundaries are written by their own I/O thread
while the next layers compute, at most one in flight per rank (a new one waits for it: bounded memory,
no queue), chunk by chunk, each chunk waiting while a commit's files upload (`Priority`: on a shared link
a commit never queues behind boundary bytes, only behind the chunk already started), and a boundary is
durable only once a commit records every chunk of it. A restart reads the
newest durable boundary and replays the committed layers after it (forward passes only).

How often (`--boundary-every`): every N layers; 0, never (a restart replays from the embeddings); or
auto: Young and Daly's interval sqrt(2 C M) for a write taking C seconds (as measured, sharing the link) and a
mean time between failures M, in layers, at most 1 + (the longer of a layer's compute and a write / a layer's
propagation): a restart's replay runs each chunk through the replayed layers as it arrives (inputs.py), so it
adds at most about one layer's compute to the boundary's download (read back at the rate it was written); and
at least the layers a write takes, so that writes never queue; a boundary due while a write is still in flight
anywhere is skipped, and so is one that could not be durable before the last layer is done. Until a boundary
write has been measured, C is estimated from the link as this rank's commits found it (the upload rate of its
solved records) and the bytes of its inputs: no boundary is written only to measure the link (at GPU speed, a
whole boundary's bytes on the link at the epoch's start, most often where a replay from the embeddings costs
less than a layer). When the job is done, a write in flight stops after its current chunk.
"""

import math
import threading
import time
from concurrent.futures import Executor, Future

import torch

from elastic_oneshot.durability import layout
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import UsageError
from elastic_oneshot.events import History

DEFAULT_MTBF_S = 3600.0


def parse_every(text: str | int) -> int | None:
    """`--boundary-every`: N >= 0 layers, or None for auto."""
    if str(text) == "auto":
        return None
    try:
        every = int(text)
    except ValueError:
        every = -1
    if every < 0:
        raise UsageError(f"--boundary-every {text}: expected auto, 0 (never) or a number of layers")
    return every


def auto_interval(write_s: float, layer_s: float, propagate_s: float, mtbf_s: float) -> int:
    """Young and Daly's optimal interval in layers, bounded so that a replay adds at most about one layer's
    compute to a restart beyond the boundary's download, which it overlaps; never less than the layers one write
    takes."""
    young = math.sqrt(2 * write_s * mtbf_s) / max(layer_s, 1e-9)
    bound = 1 + int(max(layer_s, write_s) / max(propagate_s, 1e-9))
    return max(1, math.ceil(write_s / max(layer_s, 1e-9)), min(round(young), bound))


def mtbf_from(events: list[dict], now: float) -> float:
    """The job's own mean time between failures (events.History.mtbf); DEFAULT_MTBF_S before any restart."""
    return History(events).mtbf(now, DEFAULT_MTBF_S)


class Priority:
    """Writes a commit waits for go first: `submit` runs one on an executor, and `wait` returns once none is
    queued or running."""

    def __init__(self):
        self._running = 0
        self._idle = threading.Condition()

    def submit(self, io: Executor, fn, *args) -> Future:
        with self._idle:
            self._running += 1
        return io.submit(self._run, fn, *args)

    def _run(self, fn, *args):
        try:
            return fn(*args)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def wait(self):
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0)


class Boundaries:
    """This rank's side of the job's boundaries: its writes, when the next one is due, and which are
    durable. Every decision is taken from what all ranks gathered at the last commit (`settle`), so every
    rank takes the same one. `every`: N layers, 0 never, None auto."""

    def __init__(self, state: StateStore, io: Executor, every: int | None, num_layers: int, num_chunks: int,
                 priority: Priority | None = None):
        self.state, self.io, self.every, self.priority = state, io, every, priority or Priority()
        self.num_layers, self.num_chunks = num_layers, num_chunks
        self._flight: tuple[int, Future] | None = None
        self._write_s: float | None = None  # this rank's last finished write (all its chunks)
        self._uploaded = (0, 0.0)  # bytes and seconds of this rank's solved records' uploads: the link's rate
        self._done = False  # the job is done: writes stop
        self.restart([], DEFAULT_MTBF_S)

    def restart(self, durable: list[int], mtbf_s: float):
        """A new epoch: `durable` are the boundary layers its commits record, `mtbf_s` the expected time
        between failures."""
        self.durable, self.mtbf_s = sorted(durable), mtbf_s
        self.last = self.durable[-1] if self.durable else 0  # the newest boundary written or durable
        self._pending: dict[int, dict] = {}  # chunk records of boundaries not yet complete
        self._written: dict[int, dict] = {}  # this rank's finished writes not yet reported at a commit
        self._gathered: list[dict] | None = None

    def due(self, layer: int) -> bool:
        """Whether every rank writes its chunks' inputs of `layer` now."""
        if layer >= self.num_layers or self.every == 0:
            return False
        if self.every is not None:
            return layer % self.every == 0
        if self._gathered is None:
            return False  # the epoch's first commit brings the layers' times and the link's rate
        if any(g["busy"] for g in self._gathered):
            return False  # skip rather than queue behind a write in flight
        costs = [g["write_s"] if g["write_s"] is not None else g["estimate_s"] for g in self._gathered]
        if all(c is None for c in costs):
            return False  # nothing uploaded yet: the link's rate is not known
        write_s = max(c for c in costs if c is not None)
        layer_s = max(sum(v for k, v in g["seconds"].items() if k != "commit") for g in self._gathered)
        propagate_s = max(g["seconds"].get("propagate", 0.0) for g in self._gathered)
        if (self.num_layers - layer) * layer_s < write_s:
            return False  # the job would be done before it is durable
        return layer - self.last >= auto_interval(write_s, layer_s, propagate_s, self.mtbf_s)

    def submit(self, layer: int, tag: str, chunks: dict[int, torch.Tensor]):
        """Write `chunks` (this rank's inputs of `layer`, host tensors never changed afterwards) behind the
        computation, once the write in flight (if any) has finished: one in flight, bounded memory. The
        finished write's records wait for the next commit, which makes that boundary durable."""
        if self._flight is not None:
            self._flight[1].result()
            self._land()
        self._flight = (layer, self.io.submit(self._write, layer, tag, chunks))
        self.last = layer

    def _land(self):
        """Move the write in flight, finished, to the records the next commit reports."""
        layer, future = self._flight
        self._flight = None
        self._written[layer] = future.result()

    def _write(self, layer: int, tag: str, chunks: dict[int, torch.Tensor]) -> dict:
        start, records = time.perf_counter(), {}
        for c, x in sorted(chunks.items()):
            self.priority.wait()
            if self._done:
                break
            records[str(c)] = self.state.write_tensors(layout.boundary(layer, tag, c), {"hidden_states": x})
        self._write_s = time.perf_counter() - start
        return records

    def uploaded(self, nbytes: int, seconds: float):
        """A commit's file of `nbytes` took `seconds` to upload (on the I/O thread): the link as commits find it."""
        done, took = self._uploaded
        self._uploaded = (done + nbytes, took + seconds)

    def report(self, seconds: dict, nbytes: int) -> dict:
        """This rank's part of a commit: its finished writes (a failed one raises: the state is not
        writable), whether one is still in flight, what its layer and last write took, and what a write of
        its `nbytes` of inputs would take at the rate its commits' files uploaded (None before any did)."""
        if self._flight is not None and self._flight[1].done():
            self._land()
        written, self._written = self._written, {}
        done, took = self._uploaded
        return {"written": written, "busy": self._flight is not None, "write_s": self._write_s,
                "estimate_s": nbytes * took / done if done else None, "seconds": seconds}

    def settle(self, reports: list[dict]) -> dict | None:
        """Every rank's reports at a commit: the boundary that became durable with it, {"layer", "chunks"},
        or None."""
        self._gathered = reports
        for r in reports:
            for layer, records in r["written"].items():
                self._pending.setdefault(layer, {}).update(records)
        complete = [layer for layer, records in self._pending.items() if len(records) == self.num_chunks]
        if not complete:
            return None
        layer = max(complete)
        chunks = dict(sorted(self._pending[layer].items()))
        self._pending = {k: v for k, v in self._pending.items() if k > layer}
        self.durable.append(layer)
        return {"layer": layer, "chunks": chunks}

    def prunable(self) -> int:
        """Boundaries below this layer are no longer needed: the two newest durable ones are kept, so that
        a damaged one can be replayed around."""
        return self.durable[-2] if len(self.durable) > 1 else 0

    def drain(self):
        """The job is done: no boundary is needed any more. The write in flight, if any, stops after its current
        chunk, and is waited for, so that no thread outlives the job."""
        self._done = True
        if self._flight is not None:
            self._flight[1].exception()
