"""The job's history: the kinds of event, the one way each is made, and what its readers ask of it.

History for people and tools (`status`, the metrics, the boundaries' failure rate, the chaos harness), never the
truth of progress (the records are). An event is one JSON object: its kind under "event", Unix seconds under
"time", and its fields; the state stores them (events.jsonl, or one object each on an object store). A fault is
an event that ends a worker; a new kind of fault is one entry of FAULTS, plus the code that detects it.
"""

import enum
import time


class Kind(str, enum.Enum):
    START = "start"  # rank 0, when an epoch begins
    LAYER = "layer"  # rank 0, when a layer starts
    COMMIT = "commit"  # rank 0, after a layer committed


FAULTS = {  # kind -> what it means; written by the rank that met it, with its epoch, rank and host
    "sigterm": "a spot notice or a scheduler's stop",
    "liveness": "another rank or the store went silent",
    "stale": "a newer epoch began: this worker was fenced off",
}


def start(epoch: int, world_size: int, committed: int, restart: int) -> dict:
    """An epoch of `world_size` ranks began with `committed` layers (torchrun's per-agent `restart` count)."""
    return _event(Kind.START, epoch=epoch, world_size=world_size, committed=committed, restart=restart)


def layer(index: int, epoch: int) -> dict:
    return _event(Kind.LAYER, layer=index, epoch=epoch)


def commit(index: int, epoch: int, world_size: int, seconds: dict) -> dict:
    """Layer `index` committed, its phases having taken `seconds`."""
    return _event(Kind.COMMIT, layer=index, epoch=epoch, world_size=world_size, seconds=seconds)


def fault(kind: str, epoch: int, rank: int, host: str, **fields) -> dict:
    if kind not in FAULTS:
        raise ValueError(f"{kind!r} is not a fault kind (events.FAULTS)")
    return {"event": kind, "time": time.time(), "epoch": epoch, "rank": rank, "host": host, **fields}


def _event(kind: Kind, **fields) -> dict:
    return {"event": kind.value, "time": time.time(), **fields}


class History:
    """A job's events, oldest first, and the questions asked of them."""

    def __init__(self, events: list[dict]):
        self.events = events

    def of(self, kind: Kind) -> list[dict]:
        return [e for e in self.events if e.get("event") == kind.value]

    @property
    def starts(self) -> list[dict]:
        return self.of(Kind.START)

    @property
    def layers(self) -> list[dict]:
        return self.of(Kind.LAYER)

    @property
    def commits(self) -> list[dict]:
        return self.of(Kind.COMMIT)

    @property
    def faults(self) -> list[dict]:
        return [e for e in self.events if e.get("event") in FAULTS]

    @property
    def restarts(self) -> int:
        return max(len(self.starts) - 1, 0)

    def epoch_at(self, when: float) -> int:
        """The newest epoch begun at or before `when` (0 before the first)."""
        return max((e["epoch"] for e in self.starts if e["time"] <= when), default=0)

    def mtbf(self, now: float, default: float) -> float:
        """The job's own mean time between failures: its time since the first start over the restarts since (each
        start after the first is one); `default` before any time has passed."""
        starts = [e["time"] for e in self.starts]
        if not starts or now <= starts[0]:
            return default
        return (now - starts[0]) / len(starts)

    def lost_spans(self, total: int, now: float) -> list[tuple[float, float]]:
        """The time lost to failures, as merged spans: for every epoch after the first that still had work to do,
        from the last commit before it began (or the job's first layer start, if nothing was committed yet) to the
        first layer start after it began (or `now`, while none has). That covers the work in flight thrown away,
        noticing the fault, restarting and rendezvous; overlapping spans are counted once."""
        layers, commits, spans = self.layers, self.commits, []
        for s in self.starts[1:]:
            if s["committed"] >= total:
                continue  # run again after the end: nothing to lose
            before = [c["time"] for c in commits if c["time"] <= s["time"]] or \
                [layers[0]["time"] if layers else s["time"]]
            after = [e["time"] for e in layers if e["time"] >= s["time"]]
            spans.append((max(before), min(after) if after else now))
        merged: list[tuple[float, float]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged

    def redone(self) -> int:
        """Layers committed more than once (redone after a file was found damaged, or a changed model)."""
        seen: dict[int, int] = {}
        for c in self.commits:
            seen[c["layer"]] = seen.get(c["layer"], 0) + 1
        return sum(n - 1 for n in seen.values())
