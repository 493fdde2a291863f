"""The layer loop: the only module that sequences the others.

For each uncommitted layer: read its inputs (this rank's chunks of the last committed boundary),
onload the layer from the checkpoint, accumulate Hessians in a calibration pass, run GPTQ, then a
propagation pass with the quantized weights writes the next boundary, and a manifest commits it all.
"""

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from compressed_tensors.compressors import PackedQuantizationCompressor

from . import gptq
from .data import chunk_bounds, partition
from .errors import CorruptStateError, UsageError
from .job import Job
from .model import Embedder, SourceModel
from .recipe import check_divisible
from .state import StateStore

log = logging.getLogger("elastic_oneshot")

# Sibling modules that read the same input tensor, and so share one Hessian.
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def input_groups(names: list[str]) -> list[list[str]]:
    groups: dict = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        key = next(((parent, s) for s in SHARED_INPUTS if leaf in s), name)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


class _Stop(Exception):
    """Raised by the last hooked module: the calibration pass needs no layer output."""


class Calibration:
    """Hooks that accumulate one Hessian per input group while the layer runs on calibration chunks."""

    def __init__(self, layer: torch.nn.Module, groups: list[list[str]]):
        modules = dict(layer.named_modules())
        self.hessian = {g[0]: torch.zeros(modules[g[0]].in_features, modules[g[0]].in_features,
                                          dtype=torch.float64) for g in groups}
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

    def normalized(self, leader: str) -> torch.Tensor:
        """The peer's Hessian: 2/n * sum x x^T over n sequences."""
        return (self.hessian[leader] / self.sequences[leader]).to(torch.float32)

    def remove(self):
        for h in self._handles:
            h.remove()


def _output(y):
    return y[0] if isinstance(y, tuple) else y


class Runner:
    def __init__(self, job: Job, state: StateStore, source: SourceModel, tokens: torch.Tensor,
                 rank: int = 0, world_size: int = 1, epoch: int = 1):
        self.job, self.state, self.source, self.tokens = job, state, source, tokens
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.scheme = job.recipe.quant_scheme
        self.chunks = chunk_bounds(job.num_samples, job.chunk_size)
        self.mine = list(partition(len(self.chunks), world_size, rank))
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
    def todo(self) -> list[int]:
        """Layers to (re)do: uncommitted ones, and committed ones whose files fail verification."""
        todo = []
        for layer in range(self.source.num_layers):
            try:
                if self.state.verify_layer(layer) is not None:
                    continue
            except CorruptStateError as e:
                log.warning("layer %d will be redone: %s", layer, e)
            todo.append(layer)
        return todo

    def run(self):
        todo = self.todo()
        done = self.source.num_layers - len(todo)
        if done:
            log.info("resuming: %d of %d layers committed; next is layer %d", done,
                     self.source.num_layers, todo[0] if todo else self.source.num_layers)
        with torch.inference_mode():
            for layer in todo:
                self.process(layer)

    # -- inputs -------------------------------------------------------------------------------------
    def kwargs(self, layer: int, batch: int) -> dict:
        return self.embedder.layer_kwargs(layer, batch, self.job.seq_len)

    @torch.inference_mode()  # also when called from the read-ahead thread
    def inputs(self, layer: int, chunk: int) -> torch.Tensor:
        """Chunk's inputs to `layer`: the embeddings, or the committed boundary; recomputed from an
        earlier boundary when the file is missing or fails its checksum."""
        if layer == 0:
            start, end = self.chunks[chunk]
            return self.embedder(self.tokens[start:end])
        record = self.state.manifest(layer - 1)["boundary"][str(chunk)]
        try:
            return self.state.read_tensors(record)["hidden_states"]
        except CorruptStateError as e:
            log.warning("boundary %d chunk %d: %s; recomputing it from committed layers", layer, chunk, e)
            return self.replay(layer, chunk, record)

    def replay(self, layer: int, chunk: int, record: dict) -> torch.Tensor:
        start = layer - 1
        while start > 0:
            try:
                x = self.state.read_tensors(self.state.manifest(start - 1)["boundary"][str(chunk)])["hidden_states"]
                break
            except (CorruptStateError, KeyError, TypeError):
                start -= 1
        if start == 0:
            x = self.inputs(0, chunk)
        for index in range(start, layer):
            x = _output(self.quantized_layer(index)(x, **self.kwargs(index, x.shape[0])))
        rewritten = self.state.write_tensors(record["path"], {"hidden_states": x})
        if rewritten["sha256"] != record["sha256"]:
            raise RuntimeError(f"recomputing {record['path']} from layers {start}..{layer - 1} did not "
                               "reproduce the committed file: the computation is not deterministic here")
        return x

    def each_input(self, layer: int):
        """This rank's chunks with their inputs, the next one read ahead in the background."""
        ahead = None
        for i, chunk in enumerate(self.mine):
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
        module = self.source.load_layer(layer)
        tensors = {}
        for record in self.state.manifest(layer)["weights"]:
            tensors.update(self.state.read_tensors(record))
        self.apply_quantized(module, layer, tensors)
        return module

    def solve(self, layer_module, layer: int, calib: Calibration) -> tuple[dict, dict]:
        """GPTQ every input group of the layer; return the compressed tensors and per-module notes."""
        modules = dict(layer_module.named_modules())
        tensors, notes = {}, {}
        for group in input_groups(self.layer_modules[layer]):
            weight = torch.cat([modules[n].weight for n in group])
            r = gptq.quantize(weight, calib.normalized(group[0]), self.scheme.weights,
                              self.job.recipe.block_size, self.job.recipe.dampening_frac)
            self._report(layer, group, r)
            row = 0
            for name in group:
                rows = modules[name].out_features
                part = {"weight": r.weight[row:row + rows], "weight_scale": r.scale[row:row + rows],
                        "weight_zero_point": r.zero_point[row:row + rows]}
                row += rows
                compressed = PackedQuantizationCompressor.compress(part, self.scheme)
                tensors.update({f"{self.prefix(layer)}{name}.{k}": v for k, v in compressed.items()})
                notes[name] = {"damping": r.damping, "loss": r.loss}
        return tensors, notes

    def _report(self, layer, group, r: gptq.Result):
        names = "+".join(n.rsplit(".", 1)[-1] for n in group)
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
        module = self.source.load_layer(layer)
        groups = input_groups(self.layer_modules[layer])
        calib = Calibration(module, groups)
        t = time.perf_counter()
        seconds["load"] = t - t0
        for chunk, x in self.each_input(layer):
            calib.run(module, x, self.kwargs(layer, x.shape[0]))
        calib.remove()
        seconds["hessian"] = calib.seconds
        seconds["calibrate"] = time.perf_counter() - t - calib.seconds

        t = time.perf_counter()
        tensors, notes = self.solve(module, layer, calib)
        del calib
        seconds["gptq"] = time.perf_counter() - t

        t = time.perf_counter()
        writes = [self.io.submit(self.state.write_tensors,
                                 f"{StateStore.layer_dir('layers', layer)}/weights.r{self.rank}.safetensors",
                                 tensors)]
        self.apply_quantized(module, layer, tensors)
        boundary = {}
        last = layer == self.source.num_layers - 1
        if not last:
            for chunk, x in self.each_input(layer):
                y = _output(module(x, **self.kwargs(layer, x.shape[0])))
                rel = f"{StateStore.layer_dir('boundaries', layer + 1)}/chunk-{chunk:05d}.safetensors"
                boundary[chunk] = self.io.submit(self.state.write_tensors, rel, {"hidden_states": y})
        seconds["propagate"] = time.perf_counter() - t

        t = time.perf_counter()
        weights = [w.result() for w in writes]
        boundary = {str(c): {**f.result(), "samples": list(self.chunks[c])} for c, f in boundary.items()}
        self.state.commit(layer, {
            "layer": layer, "epoch": self.epoch, "world_size": self.world_size, "weights": weights,
            "boundary": boundary, "modules": notes, "seconds": seconds,
        })
        self.state.prune_boundaries(keep=set(range(layer, self.source.num_layers + 1)))
        seconds["commit"] = time.perf_counter() - t
        log.info("layer %d/%d committed in %.1f s (%s)", layer + 1, self.source.num_layers,
                 time.perf_counter() - t0, ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()))
