"""The layer loop: the only module that sequences the others.

For each uncommitted layer: read its inputs (this rank's chunks of the last committed boundary),
onload the layer from the checkpoint, accumulate Hessians in a calibration pass, run GPTQ, then a
propagation pass with the quantized weights writes the next boundary, and a manifest commits it all.
"""

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from compressed_tensors.compressors import PackedQuantizationCompressor

from . import gptq, signals
from .data import chunk_bounds, partition
from .dist import World
from .errors import CorruptStateError, StaleEpochError, UsageError
from .job import Job
from .model import Embedder, SourceModel
from .moe import MoEBlock
from .plan import Group, layer_groups, make_plan
from .progress import LayerBar
from .recipe import check_divisible
from .state import StateStore

log = logging.getLogger("elastic_oneshot")


class _Stop(Exception):
    """Raised by the last hooked module: the calibration pass needs no layer output."""


class Calibration:
    """Hooks that accumulate one Hessian per input group while the layer runs on calibration chunks:
    in fp32 within a chunk, as the peer sums, then in fp64 across chunks (see gptq.hessian_add)."""

    def __init__(self, layer: torch.nn.Module, groups: list[list[str]], device, seq_len: int):
        modules = dict(layer.named_modules())
        self.hessian = {g[0]: torch.zeros(modules[g[0]].in_features, modules[g[0]].in_features,
                                          dtype=torch.float64, device=device) for g in groups}
        self.chunk = {g: torch.zeros_like(h, dtype=torch.float32) for g, h in self.hessian.items()}
        self.seconds, self.seq_len = 0.0, seq_len
        self.order: list[str] = []
        self.last = None
        self._inputs: dict = {}
        self._handles = [modules[name].register_forward_pre_hook(self._hook(name, g[0]))
                         for g in groups for name in g]

    def _hook(self, name, leader):
        def hook(module, args):
            x = args[0]
            if name == leader:
                t = time.perf_counter()
                gptq.hessian_add(self.chunk[leader], x, self.seq_len)
                self.seconds += time.perf_counter() - t
                self._inputs[leader] = x
            elif self._inputs.get(leader) is not x:
                raise RuntimeError(f"{name} was expected to share its input with {leader}")
            if self.last is None:
                self.order.append(name)
            elif self.last and name == self.last:
                raise _Stop
        return hook

    def run(self, layer, x, kwargs):
        try:
            layer(x, **kwargs)
        except _Stop:
            pass
        finally:
            self._inputs.clear()
        if self.last is None and self.order:
            # Stop early from now on only if every hooked module ran (routed experts may not).
            self.last = self.order[-1] if len(set(self.order)) == len(self._handles) else False

    def end_chunk(self):
        for leader, partial in self.chunk.items():
            self.hessian[leader] += gptq.symmetric(partial)
            partial.zero_()

    def remove(self):
        for h in self._handles:
            h.remove()
        self.chunk.clear()


def _output(y):
    return y[0] if isinstance(y, tuple) else y


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


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


@contextlib.contextmanager
def experts_mode(layer: torch.nn.Module, all_experts: bool):
    """Run every expert on every token (all-experts calibration) inside; routed outside."""
    blocks = [m for m in layer.modules() if isinstance(m, MoEBlock)]
    for b in blocks:
        b.all_experts = all_experts
    try:
        yield
    finally:
        for b in blocks:
            b.all_experts = False


def _wait(works):
    for w in works:
        if w is not None:
            w.wait()


class Runner:
    def __init__(self, job: Job, state: StateStore, source: SourceModel, world: World | None = None):
        self.job, self.state, self.source = job, state, source
        self.tokens = None  # the calibration samples, set once the state is claimed
        self.world = world or World()
        self.rank, self.device = self.world.rank, self.world.device
        self.epoch, self.committed = 0, {}  # set by run(): this epoch, and layer -> epoch of its commit
        self.scheme = job.recipe.quant_scheme
        self.chunks = chunk_bounds(job.num_samples, job.chunk_size)
        self.mine = list(partition(len(self.chunks), self.world.size, self.rank))
        self._kwargs: dict = {}
        self.embedder = Embedder(source)
        quantized = job.recipe.quantized_modules(source.skeleton)
        check_divisible(job.recipe, source.linear_shapes(quantized))
        self.layer_modules: list[list[str]] = [[] for _ in range(source.num_layers)]
        for name in quantized:
            index = self._layer_of(name)
            self.layer_modules[index].append(name[len(f"{source.layer_prefix}{index}."):])
        # The I/O thread only moves bytes (reads, checksums, writes), single-threaded: a second thread
        # team in libgomp makes it throttle its spin-waits, and then small ops (MoE experts) run 2-4x
        # slower; computing stays on the main thread, so its bits never depend on which thread ran it.
        self.io = ThreadPoolExecutor(max_workers=1, initializer=torch.set_num_threads, initargs=(1,))

    def _layer_of(self, name: str) -> int:
        prefix = self.source.layer_prefix
        if not name.startswith(prefix):
            raise UsageError(f"{name} is outside the decoder layers and cannot be quantized here: "
                             "add it to --ignore")
        return int(name[len(prefix):].split(".")[0])

    def prefix(self, layer: int) -> str:
        return f"{self.source.layer_prefix}{layer}."

    # -- the loop ------------------------------------------------------------------------------------
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
        return self.state.records.manifest(layer, self.committed[layer])

    # -- inputs -------------------------------------------------------------------------------------
    def kwargs(self, layer: int) -> dict:
        """What the layer takes besides hidden states (position embeddings, mask), for one sample."""
        if layer not in self._kwargs:
            self._kwargs[layer] = _to(self.embedder.layer_kwargs(layer, 1, self.job.seq_len), self.device)
        return self._kwargs[layer]

    def forward(self, module, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The layer on a chunk, one sample at a time, as the peer runs it: cache-friendly on CPU (a
        batch's attention scores outgrow the cache) and the same bits in every pass and replay."""
        return torch.cat([_output(module(sample, **self.kwargs(layer))) for sample in x.split(1)])

    def read_boundary(self, layer: int, chunk: int) -> torch.Tensor | CorruptStateError:
        """Chunk's committed inputs to `layer` > 0 as read from the state, or why they cannot be used
        (the read-ahead runs this in the I/O thread; any recomputing is left to the main thread)."""
        try:
            return self.state.read_tensors(self.manifest(layer - 1)["boundary"][str(chunk)])["hidden_states"]
        except CorruptStateError as e:
            return e

    def inputs(self, layer: int, chunk: int, read=None) -> torch.Tensor:
        """Chunk's inputs to `layer`: the embeddings, or the committed boundary (`read`, if read ahead);
        recomputed from an earlier boundary when the file is missing or fails its checksum."""
        if layer == 0:
            start, end = self.chunks[chunk]
            return self.embedder(self.tokens[start:end]).to(self.device)
        x = self.read_boundary(layer, chunk) if read is None else read
        if isinstance(x, CorruptStateError):
            log.warning("boundary %d chunk %d: %s; recomputing it from committed layers", layer, chunk, x)
            return self.replay(layer, chunk, self.manifest(layer - 1)["boundary"][str(chunk)])
        return x.to(self.device)

    def replay(self, layer: int, chunk: int, record: dict) -> torch.Tensor:
        start, x = layer - 1, None
        while start > 0 and x is None:
            try:
                record_in = self.manifest(start - 1)["boundary"][str(chunk)]
                x = self.state.read_tensors(record_in)["hidden_states"].to(self.device)
            except (CorruptStateError, KeyError, TypeError):
                start -= 1
        if x is None:
            x = self.inputs(0, chunk)
        for index in range(start, layer):
            x = self.forward(self.quantized_layer(index), index, x)
        rewritten = self.state.write_tensors(record["path"], {"hidden_states": x.cpu()})
        if rewritten["sha256"] != record["sha256"]:
            raise RuntimeError(f"recomputing {record['path']} from layers {start}..{layer - 1} did not "
                               "reproduce the committed file: the computation is not deterministic here")
        return x

    def each_input(self, layer: int):
        """This rank's chunks with their inputs, the next one read ahead in the background."""
        ahead = None
        for i, chunk in enumerate(self.mine):
            signals.check(f"in layer {layer}")
            x = self.inputs(layer, chunk, ahead.result() if ahead else None)
            ahead = self.io.submit(self.read_boundary, layer, self.mine[i + 1]) \
                if layer > 0 and i + 1 < len(self.mine) else None
            yield chunk, x

    # -- weights --------------------------------------------------------------------------------------
    def apply_quantized(self, layer_module, layer: int, tensors: dict):
        """Replace the layer's quantized weights by the committed ones, decompressed: the exact values
        the propagation pass (and any later recomputation) uses."""
        modules = dict(layer_module.named_modules())
        names = PackedQuantizationCompressor.compression_param_names(self.scheme)
        for name in self.layer_modules[layer]:
            full = self.prefix(layer) + name
            packed = {k.split(".")[-1]: tensors[f"{full}.{k}"] for k in names}
            weight = PackedQuantizationCompressor.decompress(packed, self.scheme)["weight"]
            modules[name].weight = torch.nn.Parameter(weight.to(modules[name].weight.dtype), requires_grad=False)

    def quantized_layer(self, layer: int):
        module = self.source.load_layer(layer).to(self.device)
        tensors = {}
        for record in self.manifest(layer)["weights"]:
            tensors.update(_to(self.state.read_tensors(record), self.device))
        self.apply_quantized(module, layer, tensors)
        return module

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

    # -- one layer ----------------------------------------------------------------------------------
    def reuse_solved(self, layer: int) -> tuple[dict, list[dict]]:
        """Groups of this layer solved by an earlier attempt (sub-layer progress): their tensors, records."""
        records = self.world.broadcast_object(self.state.solved(layer, self.epoch) if self.rank == 0 else None)
        tensors = {}
        for r in records:
            tensors.update(_to(self.state.read_tensors(r["file"]), self.device))
        return tensors, records

    def process(self, layer: int):
        t0 = time.perf_counter()
        seconds = {}
        if self.rank == 0:
            self.state.append_event({"event": "layer", "layer": layer, "time": time.time(), "epoch": self.epoch})
        module = self.source.load_layer(layer).to(self.device)
        all_experts = self.job.moe_calibrate == "all"
        groups = layer_groups(module, self.layer_modules[layer], all_experts)
        tensors, reused = self.reuse_solved(layer)
        done = {name for r in reused for name in r["groups"]}
        if done and self.rank == 0:
            log.info("layer %d: %d of %d groups were solved before this restart; solving the other %d", layer,
                     len(done), len(groups), len(groups) - len(done))
        groups = [g for g in groups if g.name not in done]
        calib = Calibration(module, [[n for n, _ in g.modules] for g in groups], self.device, self.job.seq_len)
        t = time.perf_counter()
        seconds["load"] = t - t0
        with experts_mode(module, all_experts):
            for chunk, x in self.each_input(layer):
                for sample in x.split(1):
                    calib.run(module, sample, self.kwargs(layer))
                calib.end_chunk()
        calib.remove()
        seconds["hessian"] = calib.seconds
        seconds["calibrate"] = time.perf_counter() - t - calib.seconds

        t = time.perf_counter()
        self._written, self._writes = set(), []  # groups persisted by this rank in this attempt, their writes
        solved, notes = self.solve(module, layer, calib, groups)
        tensors.update(solved)
        del calib
        seconds["gptq"] = time.perf_counter() - t

        t = time.perf_counter()
        self.apply_quantized(module, layer, tensors)
        boundary = {}
        if layer < self.source.num_layers - 1:
            for chunk, x in self.each_input(layer):
                y = self.forward(module, layer, x).cpu()
                rel = f"boundaries/{layer + 1:05d}/e{self.epoch:05d}/chunk-{chunk:05d}.safetensors"
                boundary[chunk] = self.io.submit(self.state.write_tensors, rel, {"hidden_states": y})
        seconds["propagate"] = time.perf_counter() - t

        t = time.perf_counter()
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
            self.embedder.release()
        if self.rank == 0:
            self.state.prune_boundaries(below=layer, epoch=self.epoch)
        seconds["commit"] = time.perf_counter() - t
        if self.rank == 0:
            self.state.append_event({"event": "commit", "layer": layer, "time": time.time(), "epoch": self.epoch,
                                     "world_size": self.world.size, "seconds": seconds})
        log.info("layer %d/%d committed in %.1f s (%s)", layer + 1, self.source.num_layers,
                 time.perf_counter() - t0, ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()))
        self.progress.update(len(self.committed))
