"""The layer loop: the only module that sequences the others.

Every (re)start of the workers begins an epoch that fences off older workers. Then, for each
uncommitted layer: onload it from the checkpoint, calibrate (Hessians over this rank's chunks),
solve (GPTQ by the weight-parallel plan), propagate (the next layer's inputs, with the quantized
weights, kept in memory for the next layer), commit. Commits are written behind, in layer order: layer L
is committed while layer L+1 computes (rank 0 records L's weight files once every rank's are durable, and
the newest boundary whose every chunk is: boundaries are written behind too), so the loop waits for the
link only when it is slower than the computation. A kill loses the layer in flight and at most
COMMITS_BEHIND computed ones; a SIGTERM waits for those. The boundary a restart replays from is read ahead while
the epoch is set up (from the process's start, where the command line began it: read_ahead.py): a restart's cost is
bounded by its download.
"""

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from elastic_oneshot import events, metrics
from elastic_oneshot.distributed import signals
from elastic_oneshot.distributed.world import World
from elastic_oneshot.durability.boundaries import Boundaries, Priority, mtbf_from
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError, StaleEpochError, StorageError, UsageError
from elastic_oneshot.loop import model_check
from elastic_oneshot.loop.data import chunk_bounds, own_chunks
from elastic_oneshot.loop.inputs import DamagedLayer, LayerInputs, to_device
from elastic_oneshot.loop.job import Job
from elastic_oneshot.loop.layer_step import LayerStep, timed
from elastic_oneshot.loop.passes import Pass
from elastic_oneshot.models.content import Content
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.quantization.plan import Group

log = logging.getLogger("elastic_oneshot")
COMMITS_BEHIND = 1  # layers computed but not committed: their files upload while the next layer computes


def _io_thread() -> ThreadPoolExecutor:
    """A thread that only moves bytes, with one OpenMP thread (a second libgomp team throttles the main thread's
    spin-waits); computing stays on the main thread, so its bits never depend on the thread."""
    return ThreadPoolExecutor(max_workers=1, initializer=torch.set_num_threads, initargs=(1,))


@dataclasses.dataclass
class Computed:
    """A layer computed on this rank and not yet committed: what its commit needs. `reused`: the records of
    groups an earlier attempt solved; `writes`: futures of this rank's records of the others; `source`: the
    digest of the layer's content as this rank read it."""

    layer: int
    groups: list[str]
    reused: list[dict]
    writes: list[Future]
    notes: dict
    seconds: dict
    source: str


class _Redo(Exception):
    """Committed layers that a replay found damaged, on some rank: every rank begins a new epoch without them."""


class Again(Exception):
    """A committed layer of an earlier pass (`index`) that this one found damaged, on some rank: that pass runs again
    (it redoes the layer, to the same bits), then the passes after it."""

    def __init__(self, index: int):
        super().__init__(f"pass {index} runs again")
        self.index = index


class Runner:
    """One rank's part of the job. `schemes`: each quantized module's (full name -> QuantizationScheme, the
    recipe's module_schemes); `boundary_every` and `mtbf_s` (None: the job's own, from its events) set how often
    boundaries are written (boundaries.py); `max_memory` (bytes; None: 80 % of what the device has free when an
    epoch begins, the least over ranks) bounds a layer's working set (plan.memory_batches). `model_changed`: what a
    start does when committed layers were computed from other model content than the files hold now (model_check):
    "refuse" in one line, or "redo" from the first changed layer. `progress` is told the layers committed, of all,
    when the run begins and after each commit. `passes` and `index`: the recipe's passes and the one this runner runs
    (default: GPTQ alone); `earlier`: the passes before it, with the protocols of their runs (their decisions are
    applied to every layer loaded)."""

    def __init__(self, job: Job, state: StateStore, records: Records, source: SourceModel, world: World,
                 schemes: dict, boundary_every: int | None = None, mtbf_s: float | None = None,
                 max_memory: int | None = None, model_changed: str = "refuse",
                 progress: Callable[[int, int], None] = lambda done, total: None, passes: list[Pass] | None = None,
                 index: int = 0, earlier: list[tuple[Pass, CommitProtocol]] = ()):
        self.job, self.state, self.source, self.world, self.progress = job, state, source, world, progress
        self.rank, self.device = world.rank, world.device
        self.protocol = CommitProtocol(state, records)
        self.epoch, self.committed = 0, {}  # set by begin_epoch(): this epoch, and layer -> epoch of its commit
        self.tag = ""  # this epoch's tag: what its workers write lives under it (layout.tag)
        self.began: set[int] = set()  # the epochs this process began
        self.content, self.model_changed = Content(source), model_changed
        self.stats: dict[str, str] = {}  # the model's shard stats when the epoch began: unchanged at every commit
        self.digests: dict[int, Future] = {}  # layer -> its content digest: committed ones' as their commits record
        # them (checked against the files when the epoch began), the others' as read this epoch, on their own thread
        self.hasher = ThreadPoolExecutor(max_workers=1)
        self.chunks = chunk_bounds(job.num_samples, job.chunk_size)
        self.step = LayerStep(source, schemes, job.recipe, world, world.device, job.seq_len, job.num_samples,
                              job.moe_calibrate == "all", passes, index, self.chunks)
        self.earlier = list(earlier)
        self.io = _io_thread()  # solved groups; boundaries have their own, so a commit never queues behind one
        self.priority = Priority()  # and their chunks wait while solved groups upload
        self.pending: list[Computed] = []  # layers computed, not yet committed, oldest first
        own = own_chunks(job.num_samples, job.chunk_size, world.size, self.rank)
        self.inputs = LayerInputs.tried(state, self.step, self.chunks, own, self.protocol, self.decisions)
        self.boundaries = Boundaries(state, _io_thread(), boundary_every, source.num_layers, len(self.chunks),
                                     self.priority)
        self.mtbf_s, self.max_memory, self.memory = mtbf_s, max_memory, 0
        self._solved: tuple[int, list[dict], dict] | None = None  # read_solved of the epoch's first layer

    # -- epochs ---------------------------------------------------------------------------------------
    def begin_epoch(self, valid: dict[int, int] | None = None):
        """Fence a new epoch on what verifies now (`valid`, if rank 0 just verified) and on the model's content
        (every rank checks its files); every rank learns the epoch, its tag and the committed layers."""
        vouched = None
        if self.rank == 0:
            began = time.perf_counter()
            valid = self.protocol.verified() if valid is None else valid
            log.info("%d committed layers verified in %.1f s", len(valid), time.perf_counter() - began)
            vouched = model_check.vouchers({layer: self.protocol.manifest_of(layer, epoch)
                                            for layer, epoch in valid.items()})
        vouched = self.world.broadcast_object(vouched)
        self.stats, self.digests = self.content.stats(), {}
        changes = [c for c in self.world.gather_objects(model_check.changed(self.content, vouched, self.stats)) if c]
        start = None
        if self.rank == 0:
            start = self._fence(valid, min(changes) if changes else None)
        start = self.world.broadcast_object(start)
        if "error" in start:
            raise (UsageError if start.get("usage") else StaleEpochError)(start["error"])
        self.epoch, self.tag, self.committed = start["epoch"], start["tag"], start["committed"]
        for layer in self.committed:
            self.digests[layer] = Future()
            self.digests[layer].set_result(vouched["layers"][layer][0])
        self.protocol.view = self.committed
        self.boundaries.restart([b for b, _ in self.protocol.durable(self.source.num_layers)], start["mtbf"])
        todo = [layer for layer in range(self.source.num_layers) if layer not in self.committed]
        if todo:  # the first layer's solved work, then its boundary, downloading while the epoch is set up
            self._solved = self.read_solved(todo[0])  # small reads first: behind a boundary they wait seconds
            self.inputs.prefetch(todo[0], self.io)
        self.memory = min(self.world.gather_objects(self.max_memory or int(0.8 * self.world.free_memory())))
        self.inputs.budget = self.memory
        metrics.epoch_began(self.epoch, self.world.size, self.source.num_layers, self.committed,
                            self.boundaries.durable)
        if self.rank == 0:
            self.state.append_event(events.start(self.epoch, self.world.size, len(self.committed),
                                                 int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))))
            metrics.history(self.state)
            log.info("epoch %d, world size %d: %d of %d layers committed; next is layer %s (%.1f s after this "
                     "process started)", self.epoch, self.world.size, len(self.committed), self.source.num_layers,
                     todo[0] if todo else "none", _process_age())

    def _fence(self, valid: dict[int, int], change: tuple[int, str] | None) -> dict:
        """Rank 0: the new epoch's start for every rank, on the `valid` commits less the layers from the first one
        whose content `change`d ({"error"} if the model changed and that is refused, or another process won)."""
        if change is not None:
            layer, files = change
            if self.model_changed != "redo":
                return {"usage": True, "error": f"model {self.source.path} has changed since layer {layer} was "
                        f"committed (its tensors in {files} differ): restore the model, or pass --model-changed "
                        f"redo to redo layers {layer}..{self.source.num_layers - 1} from it, or --restart"}
            log.warning("model %s has changed since layer %d was committed (%s): layers %d..%d will be redone",
                        self.source.path, layer, files, layer, self.source.num_layers - 1)
            valid = {k: v for k, v in valid.items() if k < layer}
        try:
            mtbf = self.mtbf_s or mtbf_from(self.state.events(), time.time())
            epoch = self.protocol.begin_epoch(valid)
        except StaleEpochError as e:
            return {"error": str(e)}
        self.began.add(epoch)
        return {"epoch": epoch, "tag": self.protocol.records.tag(epoch), "committed": valid, "mtbf": mtbf}

    def run(self, final: Callable[[CommitProtocol], None] | None):
        """Process every uncommitted layer; then rank 0 calls `final` (None for a pass before the last, whose layers
        the passes after it read, and redo where they find one damaged: Again), the export's weights, which reads every
        committed file back once, against its digest (a file can be damaged after its commit): if some fail, their
        layers are redone in a new epoch, and `final` is called again. Meanwhile the other ranks wait in collectives
        of a second each (one as long as the export would time out). If `final` fails otherwise, every rank leaves
        the process group and rank 0 raises its error. A storage error once a newer epoch has begun is this
        worker's fencing, not a storage failure: a worker frozen and woken after that epoch pruned the folder it
        was writing a boundary to is told that it was fenced off."""
        try:
            self._run(final)
        except StorageError as e:
            current = self.protocol.records.current_epoch()
            if current != self.epoch:
                raise StaleEpochError(f"epoch {self.epoch} is stale (epoch {current} has begun): {e}") from e
            raise

    def _run(self, final: Callable[[CommitProtocol], None] | None):
        def finished():  # rank 0: "done", or the layers that still verify if `final` found damaged ones
            try:
                final(self.protocol)
                return "done"
            except CorruptStateError:
                valid = self.protocol.verified()  # less the layers `final` found damaged
                if valid == self.committed:
                    raise
                return valid

        self.begin_epoch()
        self.progress(len(self.committed), self.source.num_layers)
        with torch.inference_mode():
            while True:
                try:
                    self._layers()
                except _Redo:
                    self.begin_epoch()
                    continue
                if final is None:  # a pass before the last: the passes after it read its layers
                    self.boundaries.drain()
                    return
                outcome = None
                if self.rank == 0:
                    with ThreadPoolExecutor(max_workers=1) as pool:  # outside inference mode, as a thread's own
                        work = pool.submit(finished)
                        while wait([work], timeout=1.0).not_done:
                            self.world.broadcast_object(None)  # still at it
                    try:
                        outcome = work.result()
                    except BaseException:
                        self.world.broadcast_object("failed")
                        self.world.close()  # with the others, which return; this rank reports the error
                        raise
                while (outcome := self.world.broadcast_object(outcome)) is None:
                    pass
                if outcome in ("done", "failed"):
                    self.boundaries.drain()
                    return
                self.begin_epoch(outcome)

    def _layers(self):
        """Every layer the epoch has not committed, in order, all committed at the end."""
        for layer in range(self.source.num_layers):
            if layer not in self.committed:
                if self.pending and self.pending[-1].layer != layer - 1:
                    self.settle()  # its inputs are replayed through the layers computed before it
                if not self.pending:  # else SIGTERM is asked of every rank at the next commit
                    signals.check(f"before layer {layer}")
                self.process(layer)
        self.settle()

    def restore(self, layer: int):
        """The inputs of `layer` from storage, on every rank at once (after a start or a gap; nothing is pending). A
        committed layer that the replay finds damaged, on any rank, is redone as a damaged commit is: _Redo, after
        which a new epoch begins without it (replaying from the newest durable input before it). One damaged again
        after this process committed it means that the storage damages what it is given: that stops the run."""
        damaged = None
        try:
            self.inputs.restore(layer)
        except DamagedLayer as e:
            damaged = (e.layer, str(e), e.index)
        self._damaged(damaged)

    def _damaged(self, damaged: tuple | None):
        """Every rank, from each rank's (layer, reason, pass index or None for this pass) or None: a damaged layer of
        an earlier pass is marked in its protocol and that pass runs again (Again), once this pass's computed layers
        are committed; this pass's own are redone in a new epoch (_Redo)."""
        found = sorted((d for d in self.world.gather_objects(damaged) if d), key=lambda d: (d[2] is None, d))
        if not found:
            return
        if found[0][2] is not None:
            protocols = {p.index: protocol for p, protocol in self.earlier}
            for layer, reason, index in found:
                if index is not None:
                    log.warning("layer %d of pass %d will be redone: %s", layer, index, reason)
                    protocols[index].damaged(layer, reason)
            self.settle()
            raise Again(min(d[2] for d in found if d[2] is not None))
        for index, reason, _ in found:
            log.warning("layer %d will be redone: %s", index, reason)
            if self.committed[index] in self.began:
                raise CorruptStateError(f"layer {index}, committed by this process, no longer reads back ({reason}): "
                                        "the state's storage damages what it stores")
            self.protocol.damaged(index, reason)
        raise _Redo()

    # -- one layer ------------------------------------------------------------------------------------
    def process(self, layer: int):
        """One layer: its steps (layer_step.py) on the layer as the earlier passes left it, its solved groups persisted
        as they are solved and earlier attempts' reused; then commit the layers computed before it but the newest
        COMMITS_BEHIND, whose files upload while the next layer computes."""
        seconds, step = {}, self.step
        if step.forwards and self.inputs.held_layer != layer:
            self.restore(layer)
        if self.rank == 0:
            self.state.append_event(events.layer(layer, self.epoch))
        source = self.digest(layer)  # read while the layer loads
        decisions = self.checked_decisions(layer)
        module, groups = step.load(layer, self.memory if self.job.moe_calibrate == "routed" else None, seconds,
                                   decisions)  # all-experts: their gate and up are one group, held whole
        with timed(seconds, "load"):
            tensors, reused, todo = self.reuse_solved(layer, groups)
        writes, notes, outputs = [], {}, None  # this rank's writes of solved groups in this attempt, and its notes
        persist = self.persist(layer, writes)
        if step.kind == "gptq":
            for batch in step.batches(layer, module, [g for g in todo if isinstance(g, Group)], self.memory):
                solved, more = step.compress(layer, module, batch, lambda: (x for _, x in self.inputs.each(layer)),
                                             self.inputs.kwargs(layer), seconds, persist)
                tensors.update(solved)
                notes.update(more)
        else:
            notes, outputs = step.decide(layer, module, todo, tensors, lambda: self.inputs.each(layer),
                                         lambda: self.inputs.kwargs(layer), seconds, persist, self.memory)
        step.keep_dense(layer, module, todo, tensors, persist)
        if step.forwards:
            self.propagate(layer, module, tensors, seconds, outputs)
        self.pending.append(Computed(layer, [g.name for g in groups], reused, writes, notes, seconds, source.result()))
        self.settle(keep=COMMITS_BEHIND)

    def decisions(self, layer: int) -> list[tuple[Pass, dict]]:
        """The earlier passes' committed decisions on `layer`, on the device; DamagedLayer (naming the pass) if one
        does not read back."""
        out = []
        for p, protocol in self.earlier:
            try:
                out.append((p, to_device(protocol.tensors(layer), self.device)))
            except CorruptStateError as e:
                raise DamagedLayer(layer, str(e), p.index) from None
        return out

    def checked_decisions(self, layer: int) -> list[tuple[Pass, dict]]:
        """`decisions`, read on every rank: where any rank finds one damaged, its pass runs again (Again)."""
        if not self.earlier:
            return []
        found, damaged = [], None
        try:
            found = self.decisions(layer)
        except DamagedLayer as e:
            damaged = (e.layer, str(e), e.index)
        self._damaged(damaged)
        return found

    def release(self):
        """Once the pass is done: let go of what it holds for its next layer (its inputs, the embedding table)."""
        self.inputs.keep(None, {})
        self.inputs.embedder.release()

    def persist(self, layer: int, writes: list) -> Callable[[list[str], dict], None]:
        """Sub-layer progress: this rank's owned groups go to storage as soon as they are solved (by the I/O thread,
        ahead of boundaries); `writes` gets their futures, which the commit waits for."""
        def write(groups: list[str], packed: dict):
            writes.append(self.priority.submit(self.io, self.write_solved, layer, f"r{self.rank}.b{len(writes):04d}",
                                               groups, {k: v.cpu() for k, v in packed.items()}))
        return write

    def digest(self, layer: int) -> Future:
        """The digest of `layer`'s content as this rank reads it (Content.digest), once an epoch, on its own thread."""
        if layer not in self.digests:
            self.digests[layer] = self.hasher.submit(self.content.digest, layer)
        return self.digests[layer]

    def lineage(self, layer: int) -> str:
        """What `layer`'s solved groups are computed from: the content of every layer up to it (its inputs come from
        the layers before it). Every layer before it is committed or computed in this epoch when it is solved."""
        return model_check.lineage([self.digest(index).result() for index in range(layer + 1)])

    def read_solved(self, layer: int) -> tuple[int, list[dict], dict]:
        """Sub-layer progress of `layer`: the records of the groups an earlier attempt solved from the same content,
        and their compressed tensors (rank 0 reads each file once)."""
        records = self.world.broadcast_object(
            self.protocol.solved(layer, self.tag, self.lineage(layer)) if self.rank == 0 else None)
        tensors = {}
        for r in records:
            tensors.update(to_device(self.protocol.read_tensors(r["file"]), self.device))
        return layer, records, tensors

    def reuse_solved(self, layer: int, groups: list[Group]) -> tuple[dict, list[dict], list[Group]]:
        """The compressed tensors of the groups an earlier attempt solved (read when the epoch began, for its first
        layer), their records, and the groups still to solve."""
        ahead, self._solved = self._solved, None
        _, records, tensors = ahead if ahead and ahead[0] == layer else self.read_solved(layer)
        done = {name for r in records for name in r["groups"]}
        if done and self.rank == 0:
            log.info("layer %d: %d of %d groups were solved before this restart; solving the other %d", layer,
                     len(done), len(groups), len(groups) - len(done))
        return tensors, records, [g for g in groups if g.name not in done]

    def propagate(self, layer: int, module, tensors: dict, seconds: dict, computed: dict | None = None):
        """The next layer's inputs for this rank's chunks, through the layer as the pass leaves it (or `computed`
        already, by chunk): kept in host memory, and handed to the I/O thread when a boundary is due (waiting for the
        one in flight counts as "commit": waiting for storage)."""
        if layer == self.source.num_layers - 1:
            return
        outputs = {}
        ys = computed.items() if computed is not None else self.step.propagate(
            layer, module, tensors, self.inputs.each(layer), self.inputs.kwargs(layer), seconds)
        for chunk, y in ys:
            with timed(seconds, "propagate"):
                outputs[chunk] = self.inputs.to_host(y)
        self.inputs.keep(layer + 1, outputs)
        if self.boundaries.due(layer + 1):
            with timed(seconds, "commit"):
                self.boundaries.submit(layer + 1, self.tag, outputs)

    def write_solved(self, layer: int, name: str, groups: list[str], tensors: dict) -> dict:
        """On the I/O thread: solved groups to storage, their upload timed (the link's rate, for `auto`)."""
        start = time.perf_counter()
        record = self.protocol.write_solved(layer, self.tag, name, groups, tensors, self.lineage(layer))
        self.boundaries.uploaded(record["file"]["size"], time.perf_counter() - start)
        return record

    def settle(self, keep: int = 0):
        """Commit computed layers, oldest first, until `keep` remain. A SIGTERM seen by any rank is learnt by all
        at a commit: then every computed layer is committed, and the ranks that received it stop there (the others
        go on, and find them gone at the next collective, as after a node loss)."""
        stop = False
        while len(self.pending) > (0 if stop else keep):
            stop = self.commit(self.pending.pop(0)) or stop
        if stop and signals.requested() and len(self.committed) < self.source.num_layers:
            raise signals.Preempted(f"stopped by SIGTERM once layer {max(self.committed)} was committed")

    def commit(self, c: Computed) -> bool:
        """Once every rank's files of layer `c.layer` are durable, rank 0 commits it (its records cover its
        groups), with the newest boundary that became durable since the last commit, and the layer's content as
        every rank read it, from files unchanged since the epoch began (else no rank commits: model_check); then the
        layer counts as done. Returns whether any rank was asked to stop (SIGTERM)."""
        with timed(c.seconds, "commit"):
            solved = [f.result() for f in c.writes]
            stats = self.content.stats()
            everyone = self.world.gather_objects({"notes": c.notes, "solved": solved, "stop": signals.requested(),
                                                  "source": c.source, "stats": stats, "changed": stats != self.stats,
                                                  **self.boundaries.report(c.seconds, self.inputs.held_bytes())})
            self._same_model(c.layer, everyone)
            boundary = self.boundaries.settle(everyone)
            if self.rank == 0:
                self.protocol.commit(c.layer, self.epoch, {
                    "layer": c.layer, "epoch": self.epoch, "world_size": self.world.size, "boundary": boundary,
                    "modules": {n: v for m in everyone for n, v in sorted(m["notes"].items())},
                    "source": model_check.record(c.source, [m["stats"] for m in everyone]),
                    "seconds": dict(c.seconds)}, c.groups, c.reused + [r for m in everyone for r in m["solved"]])
            self.world.barrier()
        self.committed[c.layer] = self.epoch
        if self.rank == 0:
            self.state.append_event(events.commit(c.layer, self.epoch, self.world.size, c.seconds))
        metrics.committed(c.seconds, self.committed, self.boundaries.durable)
        log.info("layer %d/%d committed (%.1f s: %s)", c.layer + 1, self.source.num_layers, sum(c.seconds.values()),
                 ", ".join(f"{k} {v:.2f}" for k, v in c.seconds.items()))
        self.progress(len(self.committed), self.source.num_layers)
        if c.layer == 0:
            self.inputs.embedder.release()
        if self.rank == 0 and boundary:
            self.protocol.prune(below=self.boundaries.prunable(), epoch=self.epoch)
        return any(m["stop"] for m in everyone)

    def _same_model(self, layer: int, everyone: list[dict]):
        """Every rank, from what all gathered at a commit: the same UsageError if some rank's model files changed
        since the epoch began, or some rank read other content for the layer than rank 0 (another copy of the
        model on its node)."""
        if changed := [r for r, m in enumerate(everyone) if m["changed"]]:
            raise UsageError(f"the model's files changed while the job ran (rank {changed[0]}: {self.source.path}): "
                             f"layer {layer} not committed; run again once they are settled: the committed layers "
                             "are checked against them")
        if other := [r for r, m in enumerate(everyone) if m["source"] != everyone[0]["source"]]:
            raise UsageError(f"rank {other[0]} reads another model than rank 0 ({self.source.path}: layer {layer}'s "
                             "tensors differ): give every node the same model")


class Passes:
    """A recipe's passes (loop/passes.py), run in order, each by a runner of its own (`make(index, earlier)`, made
    when first reached, the first at once: `earlier` pairs the passes before it with their protocols). At every
    (re)start of the workers every pass begins an epoch of its own state: a finished one verifies its commits and ends
    at once. A pass
    that finds a committed layer of an earlier one damaged (Again) runs that pass again (which redoes the layer, to
    the same bits), then the passes after it."""

    def __init__(self, count: int, make: Callable[[int, list], Runner]):
        self.count, self.make = count, make
        self.runners: list[Runner] = [make(0, [])]  # now: its layer-0 trial refuses a model before any work
        self.current: Runner | None = None

    @property
    def epoch(self) -> int:
        """The epoch of the pass running now (0 before the first begins)."""
        return self.current.epoch if self.current else 0

    def run(self, final: Callable[[CommitProtocol], None]):
        """Every pass; the last one's `final` (the export's weights) as Runner.run."""
        index = 0
        while index < self.count:
            while len(self.runners) <= index:
                self.runners.append(self.make(len(self.runners), [(r.step.stage, r.protocol) for r in self.runners]))
            self.current = self.runners[index]
            if self.count > 1 and self.current.rank == 0:
                log.info("pass %d of %d: %s", index + 1, self.count, self.current.step.stage.modifier)
            try:
                self.current.run(final if index == self.count - 1 else None)
            except Again as e:
                index = e.index
                continue
            if index < self.count - 1:
                self.current.release()
            index += 1


def _process_age() -> float:
    """Seconds since this process started (a restart's time to work: imports, the model's checks, the epoch), from
    /proc; nan where there is none."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return float("nan")
