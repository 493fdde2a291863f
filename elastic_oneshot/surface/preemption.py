"""The preemption model of `plan --fleet`: one history of a job on spot nodes, walked layer by layer, given each
layer's times at each node count (a `Timeline`, from fleet.timeline) and when preemptions come (drawn, or recorded
from a real run). Pure: no I/O, no model, no randomness but the generator it is given.

A preemption (no notice) loses the layer in flight, and the one before it while its commit is still being written.
The surviving nodes notice it, re-rendezvous and resume at one node fewer if MIN allows (else they wait for the
replacement), from the newest durable boundary, replaying the layers since (each chunk as its download arrives); a
replacement arrives a fixed time after each preemption and joins at the end of the layer in flight (a join costs a
restart and the replay, no lost work). Preemptions are exponential per node.
"""

import bisect
import collections
import dataclasses
import math
import random

FIRST_DUE = 3  # layers after an epoch's first before a boundary can be due: runner.COMMITS_BEHIND (1) + 2
# Restarts: torchrun as launch/env.sh configures it (RDZV_CONF; tests/test_fleet.py keeps these in step):
NOTICE_S = 1 * 3  # keep_alive_interval x keep_alive_max_attempt: survivors notice a lost node
RENDEZVOUS_S = 2  # last_call_timeout: the rendezvous waits this long for more nodes once MIN are in
# The Monte Carlo's bounds:
CAP_FACTOR = 100  # a trial past 100 x (its uninterrupted wall + one replacement) never finishes
CAP_EVENTS = 20000  # ... and so does one past this many preemptions and joins


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The layers at one node count, as the simulation walks them."""

    cum: list[float]  # start of each layer from the first (and the end of the last), uninterrupted
    commit: list[float]  # each layer's commit, written while the next one computes
    replay_cum: list[float]  # prefix sums of load + propagate: a replay through layers a..b
    interval: list[int]  # boundaries.auto_interval at each layer
    write_s: float  # one boundary, written (or read back) by every node in parallel
    chunks: int  # the busiest rank's: a replay runs each through the replayed layers as it arrives
    tail: float  # after the last layer: its commit, then the export (everything read back, written once)
    startup: float  # a start of the workers: interpreter, imports, skeleton, resume point


def restore(tl: Timeline, boundary: int, done: int) -> float:
    """Inputs of layer `done` from `boundary` (0: the embeddings): its download and the replay, a pipeline of two
    stages over the rank's chunks (each chunk is replayed as it arrives)."""
    read, replay = tl.write_s if boundary else 0.0, tl.replay_cum[done] - tl.replay_cum[boundary]
    return max(read, replay) + min(read, replay) / tl.chunks


def prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def uninterrupted(tl: Timeline) -> float:
    return tl.startup + tl.cum[-1] + tl.tail


def _durable(tl: Timeline, first: int, began: float, upto: int, when: float, boundary: int) -> int:
    """The newest boundary durable at `when` of an epoch that began layer `first` at `began`, after `boundary`
    (0: the embeddings): none is written before the epoch's first commit reports the layers' times (the inputs of
    its fourth layer are the first that can be), then one wherever `interval` layers have passed since the newest
    written or durable one, each durable a write's time after its layer starts."""
    written = boundary
    for layer in range(first + FIRST_DUE, min(upto, len(tl.interval) - 1) + 1):
        if layer - written >= tl.interval[layer]:
            written = layer
        if written == layer and began + tl.cum[layer] - tl.cum[first] + tl.write_s <= when:
            boundary = layer
    return boundary


def trial(tls: dict[int, Timeline], nodes: int, low: int, replacement_s: float, preemptions: "Drawn | Recorded",
          resume: bool = True) -> tuple[float, float] | None:
    """One history of the job on `nodes` nodes (`--nnodes low:nodes`) under `preemptions`, a node replaced
    `replacement_s` after each preemption: its wall seconds and the node-seconds paid, or None when it runs past the
    caps. Without `resume` every start is from layer 0 (low = nodes)."""
    last = len(tls[nodes].cum) - 1
    cap = CAP_FACTOR * (uninterrupted(tls[nodes]) + replacement_s)
    t, alive, done, boundary, events = 0.0, nodes, 0, 0, 0
    setup, preempted, pending = tls[nodes].startup, [], collections.deque()
    while t < cap and events < CAP_EVENTS:
        events += 1
        if alive < low:  # wait for replacements; the nodes left may be preempted meanwhile
            lost = preemptions.after(t, alive)
            if lost < pending[0]:
                t, alive = lost, alive - 1
                preempted.append(lost)
                pending.append(lost + replacement_s)
            else:
                t, alive = pending.popleft(), alive + 1
                t += RENDEZVOUS_S if alive >= low else 0.0
            continue
        tl = tls[alive]
        restoring = 0.0 if done == last or not resume else restore(tl, boundary, done)
        began = t + setup + restoring  # layer `done` starts
        end = began + tl.cum[last] - tl.cum[done] + tl.tail
        lost = preemptions.after(t, alive)
        join = max(t, _join_at(tl, began, done, pending[0])) if pending and alive < nodes else math.inf
        if min(lost, join) >= end:
            return end, _paid(end, nodes, preempted, replacement_s)
        if join < lost:
            done, boundary = _resumed(tl, done, began, join, boundary, resume, lost=False)
            while pending and pending[0] <= join and alive < nodes:
                pending.popleft()
                alive += 1
            t, setup = join + RENDEZVOUS_S, tls[nodes].startup
            continue
        done, boundary = _resumed(tl, done, began, lost, boundary, resume, lost=True)
        preempted.append(lost)
        pending.append(lost + replacement_s)
        t, alive, setup = lost + NOTICE_S + RENDEZVOUS_S, alive - 1, tls[nodes].startup
    return None


@dataclasses.dataclass
class Drawn:
    """Preemptions every `mtbp_s` seconds per node on average, drawn from `rng`: each live node's next one is
    exponential (memoryless)."""

    mtbp_s: float
    rng: random.Random

    def after(self, t: float, alive: int) -> float:
        """When the next preemption after `t` comes, with `alive` nodes running."""
        rate = alive / self.mtbp_s
        return t + self.rng.expovariate(rate) if rate > 0 else math.inf


@dataclasses.dataclass
class Recorded:
    """The preemptions of a real history (seconds from its start), to predict that very history; none while no
    node runs (there, a real kill found a node alive: the model has already parted from the history)."""

    times: list[float]

    def after(self, t: float, alive: int) -> float:
        return min((k for k in self.times if k > t), default=math.inf) if alive else math.inf


def _join_at(tl: Timeline, began: float, done: int, arrival: float) -> float:
    """When a node arriving at `arrival` joins: at the end of the layer then in flight (at once during start-up);
    never during the last layer (the job ends first)."""
    if arrival <= began:
        return arrival
    layer = bisect.bisect_right(tl.cum, arrival - began + tl.cum[done]) - 1
    return began + tl.cum[layer + 1] - tl.cum[done] if layer + 1 < len(tl.cum) - 1 else math.inf


def _resumed(tl: Timeline, done: int, began: float, when: float, boundary: int, resume: bool, lost: bool
             ) -> tuple[int, int]:
    """(first layer to compute, newest durable boundary) after an epoch that began layer `done` at `began` ends at
    `when`: by a loss (the layer in flight lost, and the one before it while its commit is written) or a join."""
    if not resume:
        return 0, 0
    if when <= began:
        return done, boundary
    layer = bisect.bisect_right(tl.cum, when - began + tl.cum[done]) - 1
    elapsed = when - began - (tl.cum[layer] - tl.cum[done])
    committed = layer - 1 if lost and layer > done and elapsed < tl.commit[layer - 1] else layer
    return committed, _durable(tl, done, began, committed, when, boundary)


def _paid(end: float, nodes: int, preempted: list[float], replacement_s: float) -> float:
    """Node-seconds paid: every node all along, less each preempted one until its replacement arrives."""
    return nodes * end - sum(min(end, p + replacement_s) - p for p in preempted)
