"""The layer loop: the only module that sequences the others.

Every (re)start of the workers begins an epoch that fences off older workers. Then, for each
uncommitted layer: onload it from the checkpoint, calibrate (Hessians over this rank's chunks),
solve (GPTQ by the weight-parallel plan), propagate (the next layer's inputs, with the quantized
weights), commit (rank 0 records the layer's files once every rank's writes are durable).
"""

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from compressed_tensors.compressors import PackedQuantizationCompressor

from . import gptq, signals
from .calibration import Calibration
from .data import chunk_bounds, partition
from .dist import World
from .errors import CorruptStateError, StaleEpochError
from .inputs import LayerInputs, to_device
from .job import Job
from .model import SourceModel
from .moe import experts_mode
from .plan import Group, layer_groups, make_plan
from .progress import LayerBar
from .state import StateStore

log = logging.getLogger("elastic_oneshot")


def _batches(items: list, key, size, limit: int = 2**27) -> list[list]:
    """Items of equal `key` in batches whose total `size` (elements) stays under `limit`, in order."""
    out, open_ = [], {}
    for item in items:
        batch = open_.get(key(item))
        if batch is None or sum(size(i) for i in batch) + size(item) > limit:
            batch = open_[key(item)] = []
            out.append(batch)
        batch.append(item)
    return out


def _wait(works):
    for w in works:
        if w is not None:
            w.wait()


@contextlib.contextmanager
def _timed(seconds: dict, phase: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


class Runner:
    """One rank's part of the job. `quantized` lists each layer's quantized modules (names local to the
    layer)."""

    def __init__(self, job: Job, state: StateStore, source: SourceModel, world: World, quantized: list[list[str]]):
        self.job, self.state, self.source, self.world = job, state, source, world
        self.rank, self.device = world.rank, world.device
        self.epoch, self.committed = 0, {}  # set by begin_epoch(): this epoch, and layer -> epoch of its commit
        self.scheme = job.recipe.quant_scheme
        self.chunks = chunk_bounds(job.num_samples, job.chunk_size)
        self.layer_modules = quantized
        # The I/O thread only moves bytes (reads, checksums, writes), with one OpenMP thread: a second
        # libgomp team makes both throttle their spin-waits (small ops such as MoE experts slow down
        # several times); computing stays on the main thread, so its bits never depend on the thread.
        self.io = ThreadPoolExecutor(max_workers=1, initializer=torch.set_num_threads, initargs=(1,))
        own = list(partition(len(self.chunks), world.size, self.rank))
        self.inputs = LayerInputs(state, source, job.seq_len, self.scheme, quantized, self.chunks, own,
                                  self.device, self.io, self.manifest)

    def prefix(self, layer: int) -> str:
        return f"{self.source.layer_prefix}{layer}."

    # -- epochs ---------------------------------------------------------------------------------------
    def verified(self) -> dict[int, int]:
        """Rank 0: the committed layers (layer -> epoch) whose records and weight files check out."""
        valid = {}
        for layer, epoch in sorted(self.state.records.committed().items()):
            try:
                self.state.verify(layer, epoch)
                valid[layer] = epoch
            except CorruptStateError as e:
                log.warning("layer %d will be redone: %s", layer, e)
        return valid

    def begin_epoch(self):
        """Fence a new epoch on what verifies now; every rank learns the epoch and the committed layers."""
        start = None
        if self.rank == 0:
            valid = self.verified()
            try:
                start = {"epoch": self.state.records.begin_epoch(valid), "committed": valid}
            except StaleEpochError as e:
                start = {"error": str(e)}
        start = self.world.broadcast_object(start)
        if "error" in start:
            raise StaleEpochError(start["error"])
        self.epoch, self.committed = start["epoch"], start["committed"]
        if self.rank == 0:
            todo = [layer for layer in range(self.source.num_layers) if layer not in self.committed]
            self.state.append_event({"event": "start", "time": time.time(), "epoch": self.epoch,
                                     "world_size": self.world.size, "committed": len(self.committed),
                                     "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))})
            log.info("epoch %d, world size %d: %d of %d layers committed; next is layer %s", self.epoch,
                     self.world.size, len(self.committed), self.source.num_layers, todo[0] if todo else "none")

    def run(self):
        """Process every uncommitted layer; then check everything once more (a file can be damaged after
        its commit) and, if something fails, redo it in a new epoch."""
        self.begin_epoch()
        self.progress = LayerBar(self.source.num_layers, len(self.committed), show=self.rank == 0)
        with torch.inference_mode():
            while True:
                for layer in range(self.source.num_layers):
                    if layer not in self.committed:
                        signals.check(f"before layer {layer}")
                        self.process(layer)
                intact = self.world.broadcast_object(self.verified() == self.committed if self.rank == 0 else None)
                if intact:
                    return
                self.begin_epoch()

    def manifest(self, layer: int) -> dict:
        """The commit of a layer committed in this epoch's view."""
        return self.state.records.manifest(layer, self.committed[layer])

    # -- one layer ------------------------------------------------------------------------------------
    def process(self, layer: int):
        """One layer: calibrate, solve, propagate, commit."""
        t0, seconds = time.perf_counter(), {}
        if self.rank == 0:
            self.state.append_event({"event": "layer", "layer": layer, "time": time.time(), "epoch": self.epoch})
        with _timed(seconds, "load"):
            module = self.source.load_layer(layer).to(self.device)
            tensors, groups = self.reuse_solved(layer, module)
        calib = self.calibrate(layer, module, groups, seconds)
        with _timed(seconds, "gptq"):
            self._written, self._writes = set(), []  # groups persisted by this rank in this attempt, their writes
            solved, notes = self.solve(module, layer, calib, groups)
            tensors.update(solved)
        with _timed(seconds, "propagate"):
            boundary = self.propagate(layer, module, tensors)
        with _timed(seconds, "commit"):
            self.commit(layer, boundary, notes, seconds)
        if self.rank == 0:
            self.state.append_event({"event": "commit", "layer": layer, "time": time.time(), "epoch": self.epoch,
                                     "world_size": self.world.size, "seconds": seconds})
        log.info("layer %d/%d committed in %.1f s (%s)", layer + 1, self.source.num_layers,
                 time.perf_counter() - t0, ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()))
        self.progress.update(len(self.committed))

    def reuse_solved(self, layer: int, module) -> tuple[dict, list[Group]]:
        """Sub-layer progress: the compressed tensors of the groups an earlier attempt solved, and the
        groups still to solve."""
        groups = layer_groups(module, self.layer_modules[layer], self.job.moe_calibrate == "all")
        records = self.world.broadcast_object(self.state.solved(layer, self.epoch) if self.rank == 0 else None)
        tensors = {}
        for r in records:
            tensors.update(to_device(self.state.read_tensors(r["file"]), self.device))
        done = {name for r in records for name in r["groups"]}
        if done and self.rank == 0:
            log.info("layer %d: %d of %d groups were solved before this restart; solving the other %d", layer,
                     len(done), len(groups), len(groups) - len(done))
        return tensors, [g for g in groups if g.name not in done]

    def calibrate(self, layer: int, module, groups: list[Group], seconds: dict) -> Calibration:
        """Hessians of `groups` over this rank's chunks (not yet reduced across ranks)."""
        start = time.perf_counter()
        calib = Calibration(module, [[n for n, _ in g.modules] for g in groups], self.device, self.job.seq_len)
        with experts_mode(module, self.job.moe_calibrate == "all"):
            for _, x in self.inputs.each(layer):
                for sample in x.split(1):
                    calib.run(module, sample, self.inputs.kwargs(layer))
                calib.end_chunk()
        calib.remove()
        seconds["hessian"] = calib.seconds
        seconds["calibrate"] = time.perf_counter() - start - calib.seconds
        return calib

    def propagate(self, layer: int, module, tensors: dict) -> dict:
        """The next layer's inputs for this rank's chunks, through the quantized layer, written by the I/O
        thread; chunk -> the write's future."""
        self.inputs.unpack(module, layer, tensors)
        boundary = {}
        if layer < self.source.num_layers - 1:
            for chunk, x in self.inputs.each(layer):
                y = self.inputs.forward(module, layer, x).cpu()
                rel = f"boundaries/{layer + 1:05d}/e{self.epoch:05d}/chunk-{chunk:05d}.safetensors"
                boundary[chunk] = self.io.submit(self.state.write_tensors, rel, {"hidden_states": y})
        return boundary

    def solve(self, layer_module, layer: int, calib: Calibration, groups: list[Group]) -> tuple[dict, dict]:
        """GPTQ `groups` across ranks by the plan. Each Hessian is reduced to its owner; every rank walks the
        plan's steps in order, computes its own (whole groups in batches of equal shape, as experts are)
        and issues a broadcast for every step whose result others need, so that no rank waits on a later
        step. A shared group's factor (or Cholesky panels) and inverse pieces reach every rank; every rank
        ends with every quantized weight; each group's owner persists it at once.
        Returns the compressed tensors of these groups and this rank's notes."""
        modules = dict(layer_module.named_modules())
        plan = make_plan(groups, self.world.size)
        owners = plan.owners()
        me, args = self.rank, self.scheme.weights
        frac, block = self.job.recipe.dampening_frac, self.job.recipe.block_size
        spread = {s.group.name for s in plan.steps if s.kind == "panel"}  # every rank factors a piece
        _wait([self.world.all_reduce(calib.hessian[g.name]) if g.name in spread else
               self.world.reduce_to(calib.hessian[g.name], owners[g.name]) for g in groups])
        hessian = {g.name: calib.hessian[g.name] / self.job.num_samples for g in groups
                   if owners[g.name] == me or g.name in spread}
        calib.hessian.clear()

        def rows(s):
            return torch.cat([modules[n].weight[lo:hi] for n, lo, hi in s.pieces()])

        def empty(*shape, dtype=torch.float32):
            return torch.empty(*shape, dtype=dtype, device=self.device)

        def note(g, damping):
            self._report(layer, g, damping)
            notes.update({name: {"damping": damping} for name, _ in g.modules})

        wholes = [s for s in plan.steps if s.kind == "whole" and s.rank == me]
        batches = _batches(wholes, lambda s: (s.group.rows, s.group.cols),
                           lambda s: s.group.cols * (s.group.rows + s.group.cols))
        # shared groups: their factor and order (spread: also column pieces and panels by start column),
        # inverse pieces, and the inverse once assembled
        factors, pieces, prepared = {}, {}, {}
        results, pending, tensors, notes = {}, [], {}, {}

        def begin_spread(g):  # this rank's column pieces of a spread Cholesky, from the all-reduced Hessian
            h, perm, dead, _ = gptq.order(hessian[g.name][None], args.actorder)
            starts = [a for a, _ in gptq.cholesky_panels(g.cols)]
            columns = dict(zip(starts, gptq.reversed_columns(gptq.damp(h[0], frac))))
            chol = torch.zeros(g.cols, g.cols, device=self.device)
            factors[g.name] = (chol, gptq.Prepared(chol[None], perm, dead, [frac]), columns, {})

        def factor(g, end=None):  # a shared group's Cholesky factor (up to column `end`), and its order
            if g.name in spread:
                chol, meta, _, panels = factors[g.name]
                for start, (panel, work, copied) in list(panels.items()):
                    if start < (end or g.cols) and not copied:
                        _wait([work])
                        chol[start:, start:start + panel.shape[-1]] = panel
                        panels[start] = (panel, work, True)
                return chol, meta
            (chol, meta), works = factors[g.name]
            _wait(works)
            return chol, gptq.Prepared.unpack(chol[None], meta)

        def ready(g):  # a shared group's inverse, once its factor and every piece have arrived
            if g.name not in prepared:
                chol, meta = factor(g)
                mine = pieces.get(g.name, {})
                _wait([w for _, w in mine.values()])
                if g.name in spread and chol.isnan().any():  # not positive definite: every rank retries alone
                    prepared[g.name] = gptq.prepare(hessian[g.name][None], args.actorder, frac)
                else:
                    spans = gptq.inverse_pieces(g.cols)
                    hinv = gptq.assemble([mine[start][0] for start, _ in spans], g.cols) if spans else chol
                    prepared[g.name] = gptq.Prepared(hinv[None], meta.perm, meta.dead, meta.damping)
            return prepared[g.name]

        for s in plan.steps:
            g, mine = s.group, s.rank == me
            if s.kind == "factor":
                if mine:
                    f = gptq.factor(hessian.pop(g.name)[None], args.actorder, frac)
                    note(g, f.damping[0])
                    chol, meta = f.pack()
                else:
                    chol, meta = empty(1, g.cols, g.cols), empty(1, 2 * g.cols + 1, dtype=torch.float64)
                factors[g.name] = ((chol[0], meta), [self.world.broadcast(t, s.rank) for t in (chol, meta)])
                continue
            if s.kind in ("panel", "update"):
                if g.name not in factors:
                    begin_spread(g)
                _, _, columns, panels = factors[g.name]
                if s.kind == "panel":
                    panel = gptq.cholesky_panel(columns[s.start]) if mine else \
                        empty(g.cols - s.start, s.end - s.start, dtype=torch.float64)
                    panels[s.start] = (panel, self.world.broadcast(panel, s.rank), False)
                elif mine:  # update the column piece at `end` with the panel at `start`
                    panel, work, _ = panels[s.start]
                    _wait([work])
                    gptq.cholesky_update(columns[s.end], panel, s.end - s.start)
                continue
            if s.kind == "invert":
                if mine:
                    chol, _ = factor(g, s.end)
                    piece = gptq.inverse_rows(chol, s.start, s.end)
                else:
                    piece = empty(s.end - s.start, s.end)
                pieces.setdefault(g.name, {})[s.start] = (piece, self.world.broadcast(piece, s.rank))
                continue
            key = (g.name, s.start)
            if mine and s.kind == "whole":
                if key not in results:  # solved with an earlier step of its batch
                    batch = next(b for b in batches if s in b)
                    hs = torch.stack([hessian.pop(o.group.name) for o in batch])
                    prep = gptq.prepare(hs, args.actorder, frac)
                    r = gptq.solve(torch.stack([rows(o) for o in batch]), prep, args, block)
                    for i, o in enumerate(batch):
                        results[(o.group.name, 0)] = (r.weight[i], r.scale[i], r.zero_point[i])
                        note(o.group, prep.damping[i])
                    self._persist(layer, [o.group for o in batch], results, tensors)
            elif mine:
                r = gptq.solve(rows(s)[None], ready(g), args, block)
                results[key] = (r.weight[0], r.scale[0], r.zero_point[0])
            else:
                weight = modules[g.modules[0][0]].weight
                ngroups = g.cols // args.group_size if args.group_size else 1
                results[key] = (empty(s.end - s.start, g.cols, dtype=weight.dtype),
                                empty(s.end - s.start, ngroups, dtype=weight.dtype),
                                empty(s.end - s.start, ngroups, dtype=args.zp_dtype))
            pending += [self.world.broadcast(t, s.rank) for t in results[key]]
        _wait(pending)

        for g in groups:  # assemble row slices; persist the shared groups this rank owns
            if g.name in spread and owners[g.name] == me:
                note(g, ready(g).damping[0])
            if plan.shared(g):
                parts = [results[(g.name, s.start)] for s in sorted(plan.steps, key=lambda s: s.start)
                         if s.group is g and s.kind == "solve"]
                results[(g.name, 0)] = tuple(torch.cat(p) for p in zip(*parts))
        self._persist(layer, [g for g in groups if owners[g.name] == me and g.name not in self._written], results,
                      tensors)
        for g in groups:
            if g.name not in self._written:
                tensors.update(self._compress(layer, g, *results[(g.name, 0)]))
        return tensors, notes

    def _compress(self, layer: int, group: Group, weight, scale, zero_point) -> dict:
        """The group's stacked result split into its modules' compressed-tensors tensors."""
        out, row = {}, 0
        for name, rows in group.modules:
            part = {"weight": weight[row:row + rows], "weight_scale": scale[row:row + rows],
                    "weight_zero_point": zero_point[row:row + rows]}
            row += rows
            compressed = PackedQuantizationCompressor.compress(part, self.scheme)
            out.update({f"{self.prefix(layer)}{name}.{k}": v for k, v in compressed.items()})
        return out

    def _persist(self, layer: int, groups: list[Group], results: dict, tensors: dict):
        """Sub-layer progress: solved groups go to disk as soon as they are known (written by the I/O
        thread; the commit waits for them)."""
        if not groups:
            return
        mine = {}
        for g in groups:
            mine.update(self._compress(layer, g, *results[(g.name, 0)]))
            self._written.add(g.name)
        tensors.update(mine)
        name = f"r{self.rank}.b{len(self._writes):04d}"
        self._writes.append(self.io.submit(self.state.write_solved, layer, self.epoch, name, [g.name for g in groups],
                                           {k: v.cpu() for k, v in mine.items()}))

    def _report(self, layer, group: Group, damping: float | None):
        names = group.name + (f" (+{len(group.modules) - 1})" if len(group.modules) > 1 else "")
        if damping is None:
            log.error("!!! layer %d %s: Hessian not positive definite even with damping %.3g, or no calibration "
                      "token reached it: quantized with ROUND-TO-NEAREST, not GPTQ", layer, names,
                      max(self.job.recipe.dampening_frac, 0.01) * 10 ** gptq.DAMPING_RETRIES)
        elif damping != self.job.recipe.dampening_frac:
            log.warning("layer %d %s: Hessian not positive definite at damping %.3g; used %.3g", layer,
                        names, self.job.recipe.dampening_frac, damping)

    def commit(self, layer: int, boundary: dict, notes: dict, seconds: dict):
        """Once every rank's writes are durable, rank 0 commits the layer; then the layer counts as done."""
        for f in self._writes:
            f.result()
        mine = {"notes": notes,
                "boundary": {str(c): {**f.result(), "samples": list(self.chunks[c])} for c, f in boundary.items()}}
        everyone = self.world.gather_objects(mine)
        if self.rank == 0:
            self.state.records.commit(layer, self.epoch, {
                "layer": layer, "epoch": self.epoch, "world_size": self.world.size,
                "weights": [r["file"] for r in self.state.solved(layer, self.epoch)],
                "boundary": {c: r for m in everyone for c, r in sorted(m["boundary"].items())},
                "modules": {n: v for m in everyone for n, v in sorted(m["notes"].items())},
                "seconds": seconds,
            })
        self.world.barrier()
        self.committed[layer] = self.epoch
        if layer == 0:
            self.inputs.embedder.release()
        if self.rank == 0:
            self.state.prune_boundaries(below=layer, epoch=self.epoch)
