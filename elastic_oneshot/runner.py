"""The layer loop: the only module that sequences the others.

For each uncommitted layer: read its inputs (this rank's chunks of the last committed boundary),
onload the layer from the checkpoint, accumulate Hessians in a calibration pass, run GPTQ, then a
propagation pass with the quantized weights writes the next boundary, and a manifest commits it all.
"""

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
from .plan import Group, input_groups, layer_groups, make_plan
from .recipe import check_divisible
from .state import StateStore

log = logging.getLogger("elastic_oneshot")

class _Stop(Exception):
    """Raised by the last hooked module: the calibration pass needs no layer output."""


class Calibration:
    """Hooks that accumulate one Hessian per input group while the layer runs on calibration chunks."""

    def __init__(self, layer: torch.nn.Module, groups: list[list[str]], device):
        modules = dict(layer.named_modules())
        self.hessian = {g[0]: torch.zeros(modules[g[0]].in_features, modules[g[0]].in_features,
                                          dtype=torch.float64, device=device) for g in groups}
        self.sequences = {g[0]: 0 for g in groups}
        self.seconds = 0.0
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
                self.sequences[leader] += gptq.hessian_add(self.hessian[leader], x)
                self.seconds += time.perf_counter() - t
                self._inputs[leader] = x
            elif self._inputs.get(leader) is not x:
                raise RuntimeError(f"{name} was expected to share its input with {leader}")
            if self.last is None:
                self.order.append(name)
            elif name == self.last:
                raise _Stop
        return hook

    def run(self, layer, x, kwargs):
        try:
            layer(x, **kwargs)
        except _Stop:
            pass
        finally:
            self._inputs.clear()
        if self.last is None:
            self.last = self.order[-1]

    def remove(self):
        for h in self._handles:
            h.remove()


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
        self.io = ThreadPoolExecutor(max_workers=1)

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
    def kwargs(self, layer: int, batch: int) -> dict:
        if (layer, batch) not in self._kwargs:
            self._kwargs[(layer, batch)] = _to(self.embedder.layer_kwargs(layer, batch, self.job.seq_len),
                                               self.device)
        return self._kwargs[(layer, batch)]

    @torch.inference_mode()  # also when called from the read-ahead thread
    def inputs(self, layer: int, chunk: int) -> torch.Tensor:
        """Chunk's inputs to `layer`: the embeddings, or the committed boundary; recomputed from an
        earlier boundary when the file is missing or fails its checksum."""
        if layer == 0:
            start, end = self.chunks[chunk]
            return self.embedder(self.tokens[start:end]).to(self.device)
        record = self.manifest(layer - 1)["boundary"][str(chunk)]
        try:
            return self.state.read_tensors(record)["hidden_states"].to(self.device)
        except CorruptStateError as e:
            log.warning("boundary %d chunk %d: %s; recomputing it from committed layers", layer, chunk, e)
            return self.replay(layer, chunk, record)

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
            x = _output(self.quantized_layer(index)(x, **self.kwargs(index, x.shape[0])))
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
            x = ahead.result() if ahead else self.inputs(layer, chunk)
            if i + 1 < len(self.mine):
                ahead = self.io.submit(self.inputs, layer, self.mine[i + 1])
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

    def solve(self, layer_module, layer: int, calib: Calibration) -> tuple[dict, dict, dict]:
        """GPTQ the layer's input groups across ranks by the plan: Hessians are reduced to the rank that
        prepares each group's inverse, row slices of split groups receive it from there, and every
        result is broadcast as soon as it is solved, so all ranks end with every quantized weight.
        Returns all compressed tensors, those this rank writes (its prepared groups'), and its notes."""
        modules = dict(layer_module.named_modules())
        groups = layer_groups(layer_module, self.layer_modules[layer])
        plan = make_plan(groups, self.world.size)
        owners = plan.owners()
        me, args = self.rank, self.scheme.weights
        _wait([self.world.reduce_to(calib.hessian[g.name], owners[g.name]) for g in groups])

        prepared, transfers, notes = {}, [], {}
        for g in groups:
            if owners[g.name] == me:
                h = (calib.hessian[g.name] / self.job.num_samples).to(torch.float32)
                p = prepared[g.name] = gptq.prepare(h, args.actorder, self.job.recipe.dampening_frac)
                self._report(layer, g, p)
                notes.update({name: {"damping": p.damping} for name, _ in g.modules})
                for w in plan.work:
                    if w.group == g and w.rank != me:
                        transfers += [self.world.send(t, w.rank) for t in p.pack()]
        received = {}
        for w in plan.work:
            if w.rank == me and w.prep_rank != me and w.group.name not in received:
                d = w.group.cols
                bufs = (torch.empty(d, d, device=self.device), torch.empty(2 * d + 1, dtype=torch.float64,
                                                                            device=self.device))
                transfers += [self.world.recv(t, w.prep_rank) for t in bufs]
                received[w.group.name] = bufs
        _wait(transfers)
        prepared.update({name: gptq.Prepared.unpack(*bufs) for name, bufs in received.items()})

        results, pending = {}, []
        for w in plan.work:
            g, rows = w.group, w.end - w.start
            weight = torch.cat([modules[n].weight for n, _ in g.modules])[w.start:w.end]
            if w.rank == me:
                r = gptq.solve(weight, prepared[g.name], args, self.job.recipe.block_size)
                bufs = (r.weight.contiguous(), r.scale.contiguous(), r.zero_point.contiguous())
            else:
                groups_n = g.cols // args.group_size if args.group_size else 1
                bufs = (torch.empty_like(weight), torch.empty(rows, groups_n, dtype=weight.dtype, device=self.device),
                        torch.empty(rows, groups_n, dtype=args.zp_dtype, device=self.device))
            pending += [self.world.broadcast(t, w.rank) for t in bufs]
            results[(g.name, w.start)] = bufs
        _wait(pending)

        tensors, written = {}, {}
        for g in groups:
            slices = [results[(g.name, w.start)] for w in sorted(plan.work, key=lambda w: w.start) if w.group == g]
            weight, scale, zp = (torch.cat(parts) for parts in zip(*slices))
            row = 0
            for name, rows in g.modules:
                part = {"weight": weight[row:row + rows], "weight_scale": scale[row:row + rows],
                        "weight_zero_point": zp[row:row + rows]}
                row += rows
                compressed = PackedQuantizationCompressor.compress(part, self.scheme)
                compressed = {f"{self.prefix(layer)}{name}.{k}": v for k, v in compressed.items()}
                tensors.update(compressed)
                if owners[g.name] == me:
                    written.update(compressed)
        return tensors, written, notes

    def _report(self, layer, group: Group, r: gptq.Prepared):
        names = "+".join(n.rsplit(".", 1)[-1] for n, _ in group.modules)
        if r.damping is None:
            log.error("!!! layer %d %s: Hessian not positive definite even with damping %.3g: quantized "
                      "with ROUND-TO-NEAREST, not GPTQ", layer, names,
                      max(self.job.recipe.dampening_frac, 0.01) * 10 ** gptq.DAMPING_RETRIES)
        elif r.damping != self.job.recipe.dampening_frac:
            log.warning("layer %d %s: Hessian not positive definite at damping %.3g; used %.3g", layer,
                        names, self.job.recipe.dampening_frac, r.damping)

    # -- one layer ----------------------------------------------------------------------------------
    def process(self, layer: int):
        t0 = time.perf_counter()
        seconds = {}
        if self.rank == 0:
            self.state.append_event({"event": "layer", "layer": layer, "time": time.time(), "epoch": self.epoch})
        module = self.source.load_layer(layer).to(self.device)
        calib = Calibration(module, input_groups(self.layer_modules[layer]), self.device)
        t = time.perf_counter()
        seconds["load"] = t - t0
        for chunk, x in self.each_input(layer):
            calib.run(module, x, self.kwargs(layer, x.shape[0]))
        calib.remove()
        seconds["hessian"] = calib.seconds
        seconds["calibrate"] = time.perf_counter() - t - calib.seconds

        t = time.perf_counter()
        tensors, written, notes = self.solve(module, layer, calib)
        del calib
        seconds["gptq"] = time.perf_counter() - t

        t = time.perf_counter()
        writes = [self.io.submit(self.state.write_tensors,
                                 f"layers/{layer:05d}/e{self.epoch:05d}.r{self.rank}.safetensors",
                                 {k: v.cpu() for k, v in written.items()})] if written else []
        self.apply_quantized(module, layer, tensors)
        boundary = {}
        if layer < self.source.num_layers - 1:
            for chunk, x in self.each_input(layer):
                y = _output(module(x, **self.kwargs(layer, x.shape[0]))).cpu()
                rel = f"boundaries/{layer + 1:05d}/e{self.epoch:05d}/chunk-{chunk:05d}.safetensors"
                boundary[chunk] = self.io.submit(self.state.write_tensors, rel, {"hidden_states": y})
        seconds["propagate"] = time.perf_counter() - t

        t = time.perf_counter()
        mine = {"weights": [w.result() for w in writes], "notes": notes,
                "boundary": {str(c): {**f.result(), "samples": list(self.chunks[c])} for c, f in boundary.items()}}
        everyone = self.world.gather_objects(mine)
        if self.rank == 0:
            self.state.records.commit(layer, self.epoch, {
                "layer": layer, "epoch": self.epoch, "world_size": self.world.size,
                "weights": [w for m in everyone for w in m["weights"]],
                "boundary": {c: r for m in everyone for c, r in sorted(m["boundary"].items())},
                "modules": {n: v for m in everyone for n, v in sorted(m["notes"].items())},
                "seconds": seconds,
            })
        self.world.barrier()
        self.committed[layer] = self.epoch
        if self.rank == 0:
            self.state.prune_boundaries(below=layer, epoch=self.epoch)
        seconds["commit"] = time.perf_counter() - t
        if self.rank == 0:
            self.state.append_event({"event": "commit", "layer": layer, "time": time.time(), "epoch": self.epoch,
                                     "world_size": self.world.size, "seconds": seconds})
        log.info("layer %d/%d committed in %.1f s (%s)", layer + 1, self.source.num_layers,
                 time.perf_counter() - t0, ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()))
