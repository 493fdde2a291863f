"""One decoder layer's work in one pass of a recipe (loop/passes.py), for everyone who runs one: load -> calibrate ->
decide -> propagate.

Load: the layer from the checkpoint with the decisions of the passes before this one applied (their committed
scales folded, pruned weights in place). Then this pass's own decisions, by kind:
- GPTQ: Hessians over this rank's chunks, solved across the ranks by the weight-parallel plan (as it always was).
- SmoothQuant: each mapping's smooth layer's output ranges over this rank's chunks, reduced exactly (MIN and MAX),
  scales, fold.
- AWQ: one calibration forward records each mapping's activation sums and its parent's calls per sample; then
  mapping after mapping the grid search, data-parallel over the ranks' samples, reduced exactly in per-sample slots
  (awq.py), fold.
- SparseGPT: Hessians as GPTQ's, each input group solved whole on one rank, the pruned weights broadcast.
- QuantizationModifier: round to nearest, the ranks sharing the groups; static input ranges calibrated exactly first
  (no forward at all without them).
Propagate: the next layer's inputs through the layer as this pass leaves it (GPTQ: quantized; QuantizationModifier:
unquantized, as the peer's).

No epochs and no I/O of the state: the runner reads the earlier passes' decisions and this pass's earlier attempts,
sequences epochs and commits around these steps (and persists what they decide), a replay runs committed layers
through `replayed` and `forward`, and `plan --fleet --calibrate` times them on one layer. Each step adds its seconds
to the phase it belongs to, as the runner's commits report them.
"""

import contextlib
import functools
import inspect
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from elastic_oneshot.distributed.world import World, host_share, local_ranks
from elastic_oneshot.errors import UsageError
from elastic_oneshot.loop.calibration import Calibration
from elastic_oneshot.loop.data import partition
from elastic_oneshot.loop.device_cache import DeviceCache, file_room, tensor_ids
from elastic_oneshot.loop.passes import DENSE, SCALES, Pass, Unit, dense
from elastic_oneshot.models.moe import experts_mode, has_experts, replayable, streamed
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.quantization import awq, gptq, rtn, smoothing, sparsegpt
from elastic_oneshot.quantization.executor import Executor
from elastic_oneshot.quantization.packing import LayerPacking, unpack_into, unpacked
from elastic_oneshot.quantization.plan import Group, layer_groups, make_plan, memory_batches
from elastic_oneshot.quantization.recipe import GPTQ, Recipe
from elastic_oneshot.quantization.schemes import input_qparams, static_inputs

log = logging.getLogger("elastic_oneshot")
Persist = Callable[[list[str], dict], None]
Chunks = Callable[[], Iterable[tuple[int, torch.Tensor]]]


@contextlib.contextmanager
def timed(seconds: dict, phase: str):
    """Adds the block's seconds to `seconds[phase]`, the device's queued work included."""
    start = time.perf_counter()
    try:
        yield
    finally:
        device_done()
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


def device_done():
    """On a GPU, wait for the work queued so far: a phase's seconds are then its own, not the next phase's."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Stop(Exception):
    """Raised by the last hook a calibration pass needs: the rest of the layer is not run."""


class LayerStep:
    """A job's per-layer steps in pass `index` of `passes` (default: GPTQ alone): `schemes` (each quantized module's,
    by full name), `recipe` (GPTQ's settings), on `world`'s ranks and `device`; samples of `seq_len` tokens,
    `num_samples` in all (Hessians are sums over them) in chunks of `chunks` (sample bounds, by chunk id);
    `all_experts`: every expert calibrates on every token (`--moe-calibrate all`)."""

    def __init__(self, source: SourceModel, schemes: dict, recipe: Recipe, world: World, device, seq_len: int,
                 num_samples: int, all_experts: bool, passes: list[Pass] | None = None, index: int = 0,
                 chunks: list[tuple[int, int]] = ()):
        self.source, self.schemes, self.recipe, self.world, self.device = source, schemes, recipe, world, device
        self.seq_len, self.num_samples, self.all_experts, self.chunks = seq_len, num_samples, all_experts, chunks
        self.quantized = source.by_layer(list(schemes))  # per layer, the quantized modules' names local to it
        self._awq_first = None  # the grid point AWQ's last search chose: where the next one starts
        self.passes = passes or [Pass(0, GPTQ, None, last=True, touched=[[] for _ in range(source.num_layers)])]
        self.stage = self.passes[index]
        self.kind = self.stage.kind

    @property
    def forwards(self) -> bool:
        """Whether the pass runs the layers: round to nearest without static input activations only reads the
        weights and writes its result."""
        return self.kind != "rtn" or any(static_inputs(s) for s in self.schemes.values())

    def prefix(self, layer: int) -> str:
        return f"{self.source.layer_prefix}{layer}."

    # -- load ------------------------------------------------------------------------------------------------
    def load(self, layer: int, budget: int | None, seconds: dict, decisions: list = ()
             ) -> tuple[torch.nn.Module, list]:
        """Layer `layer` from the checkpoint, on the device, with the earlier passes' `decisions` ([(pass, their
        committed tensors)]) applied, and the pass's units of work (GPTQ's: input groups). A GPTQ pass without
        earlier ones streams the experts of a layer whose weights take more than half of `budget`
        (source.load_layer)."""
        with timed(seconds, "load"):
            module = self.source.load_layer(layer, self.device, self._streaming(budget))
            for p, tensors in decisions:
                self.apply(module, layer, p, tensors)
            return module, self.units(layer, module)

    def _streaming(self, budget: int | None) -> int | None:
        """The budget that streams a large layer's experts (source.load_layer): GPTQ's alone, whose steps hold and
        fetch them; the other passes, and GPTQ after them, hold whole layers."""
        return budget if self.stage.index == 0 and self.kind == "gptq" else None

    def units(self, layer: int, module) -> list:
        """The pass's units of sub-layer progress for `layer`: input groups (GPTQ, round to nearest, SparseGPT),
        mappings (SmoothQuant, AWQ); and in the last pass the dense tensors the passes changed (DENSE)."""
        key = self.source.family.input_key(self.all_experts)
        if self.kind in ("gptq", "rtn"):
            out = layer_groups(module, self.quantized[layer], key)
        elif self.kind == "sparsegpt":
            out = layer_groups(module, self.stage.targets[layer], key)
        else:
            out = [Unit(m.smooth) for m in self.stage.mappings[layer]]
        return out + ([Unit(DENSE)] if self.stage.last and self.dense(layer) else [])

    def dense(self, layer: int) -> list[str]:
        return dense(self.passes[:self.stage.index + 1], layer, self.quantized[layer] if self.stage.quantizes else [])

    def apply(self, module, layer: int, p: Pass, tensors: dict):
        """Pass `p`'s committed decisions on `layer` (`tensors`, by full name) applied to `module`: scales folded
        (SmoothQuant, AWQ), pruned weights in place (SparseGPT), quantized weights unpacked (GPTQ); nothing for round
        to nearest, which the peer propagates unquantized."""
        prefix = self.prefix(layer)
        if p.kind in ("smoothing", "awq"):
            for m in p.mappings[layer]:
                scales = tensors.get(f"{prefix}{m.smooth}.{SCALES}")
                if scales is not None and scales.numel():
                    _fold(module, m, scales, self.source.family)
        elif p.kind == "sparsegpt":
            for name in p.targets[layer]:
                _put(module, f"{name}.weight", tensors[f"{prefix}{name}.weight"])
        elif p.kind == "gptq":
            self.unpack(module, layer, tensors)

    def replayed(self, layer: int, tensors: dict, decisions: list, budget: int | None) -> torch.nn.Module:
        """A layer this pass committed, as its propagation left it (its `tensors` applied over the earlier passes'
        `decisions`), on the device."""
        module = self.source.load_layer(layer, self.device, self._streaming(budget))
        for p, committed in [*decisions, (self.stage, tensors)]:
            self.apply(module, layer, p, committed)
        return module

    def quantized_layer(self, layer: int, tensors: dict, budget: int | None) -> torch.nn.Module:
        """A committed layer of a GPTQ job, its quantized weights (compressed `tensors`) in place, on the device."""
        return self.replayed(layer, tensors, [], budget)

    # -- decide ----------------------------------------------------------------------------------------------
    def decide(self, layer: int, module, todo: list, tensors: dict, chunks: Chunks, kwargs: Callable[[], dict],
               seconds: dict, persist: Persist, budget: int | None = None) -> tuple[dict, dict | None]:
        """This pass's decisions on `layer` but GPTQ's (`compress`): those of the units in `todo` computed over this
        rank's `chunks` (a callable giving (chunk, inputs) pairs) and the ranks', this rank's share persisted; the
        others' taken from `tensors` (an earlier attempt's), which gets every decision; `module` changed as the
        pass leaves it. Returns this rank's notes, and the next layer's inputs where computing the decisions gave
        them (None: propagate). `budget`: the bytes the device may hold (None: unbounded), which bounds what AWQ
        caches there and SparseGPT's Hessians held at once."""
        names = {u.name for u in todo if u.name != DENSE}
        if self.kind == "smoothing":
            return self._smoothing(layer, module, names, tensors, chunks, kwargs, seconds, persist), None
        if self.kind == "awq":
            return self._awq(layer, module, names, tensors, chunks, kwargs, seconds, persist, budget), None
        groups = [g for g in todo if isinstance(g, Group)]
        if self.kind == "sparsegpt":
            return self._sparsegpt(layer, module, groups, tensors, chunks, kwargs, seconds, persist, budget), None
        return self._rtn(layer, module, groups, tensors, chunks, kwargs, seconds, persist)

    def keep_dense(self, layer: int, module, todo: list, tensors: dict, persist: Persist):
        """The last pass's DENSE unit, once the layer holds every pass's decisions: the dense tensors the passes
        changed, persisted by rank 0."""
        if not any(u.name == DENSE for u in todo):
            return
        prefix, state = self.prefix(layer), module.state_dict()
        found = {prefix + name: state[name].detach().clone() for name in self.dense(layer)}
        tensors.update(found)
        if self.world.rank == 0:
            persist([DENSE], found)

    def _smoothing(self, layer, module, names, tensors, chunks, kwargs, seconds, persist) -> dict:
        stage, prefix = self.stage.stage, self.prefix(layer)
        todo = [m for m in self.stage.mappings[layer] if m.smooth in names]
        ranges = self._observe(module, [m.smooth for m in todo], chunks, kwargs, seconds) if todo else {}
        mine = {}
        with timed(seconds, "solve"):
            for m in self.stage.mappings[layer]:  # in order: a mapping's scales see the weights as the last left them
                key = f"{prefix}{m.smooth}.{SCALES}"
                if m.smooth in ranges:
                    balance = [module.get_submodule(b).weight for b in m.balance]
                    mine[key] = tensors[key] = smoothing.scales(ranges[m.smooth], balance, stage.smoothing_strength,
                                                                stage.algorithm)
                _fold(module, m, tensors[key], self.source.family)
        if mine and self.world.rank == 0:
            persist([m.smooth for m in todo], mine)
        return {}

    def _observe(self, module, names: list[str], chunks: Chunks, kwargs: Callable[[], dict], seconds: dict) -> dict:
        """Per smooth layer, the minimum and maximum of its output per channel over every rank's chunks (exact), each
        sample's pass stopped once every smooth layer has been seen."""
        seen, pending = {}, set()

        def hook(name):
            def observe(_, args, output):
                seen[name] = smoothing.observe(seen.get(name), output)
                pending.discard(name)
                if not pending:
                    raise _Stop
            return observe

        handles = [module.get_submodule(n).register_forward_hook(hook(n)) for n in names]
        try:
            with timed(seconds, "calibrate"):
                for _, x in chunks():
                    for sample in x.split(1):
                        pending.update(names)
                        with contextlib.suppress(_Stop):
                            module(sample, **kwargs())
        finally:
            for h in handles:
                h.remove()
        channels = {n: module.get_submodule(n).weight.shape[0] for n in names}
        dtypes = {n: module.get_submodule(n).weight.dtype for n in names}
        return _extrema(self.world, {n: seen.get(n) for n in names}, channels, dtypes)

    def _awq(self, layer, module, names, tensors, chunks, kwargs, seconds, persist, budget) -> dict:
        prefix, notes = self.prefix(layer), {}
        mappings = self.stage.mappings[layer]
        cache = DeviceCache(self.device, *_cache_allowances(module, budget, self.device))
        record = self._record(layer, module, [m for m in mappings if m.smooth in names], chunks, kwargs, seconds,
                              cache) if names else None
        if cache.spilled:
            log.info("layer %d: rank %d's AWQ keeps %.2f GB of its recorded calls in host memory and %.2f GB in a file "
                     "in %s, past the memory it may use", layer, self.world.rank, cache.on_host / 1e9,
                     cache.on_disk / 1e9, tempfile.gettempdir())
        for i, m in enumerate(mappings):  # in order: each mapping's search sees the layer as the earlier left it
            key = f"{prefix}{m.smooth}.{SCALES}"
            if m.smooth in names:
                with timed(seconds, "solve"), experts_mode(module, self.all_experts):
                    tensors[key], point = self._search(layer, module, m, record, cache.rest())
                if m.parent not in {later.parent for later in mappings[i + 1:]}:
                    del record["calls"][m.parent]  # its calls are not replayed again
                notes[m.smooth] = {"awq_grid_point": point}
                if self.world.rank == 0:
                    persist([m.smooth], {key: tensors[key]})
            if tensors[key].numel():
                _fold(module, m, tensors[key], self.source.family)
        return notes

    def _record(self, layer: int, module, mappings: list, chunks: Chunks, kwargs: Callable[[], dict],
                seconds: dict, cache: DeviceCache) -> dict:
        """One calibration forward over this rank's chunks: per mapping, each sample's activation sum in its slot
        (awq.activation_sum, by the sample's number) with its token count, and per parent, each sample's call (its
        own tensors in `cache`; the layer's keyword arguments, the same for every call, stay where they are)."""
        sums = {m.smooth: torch.zeros(self.num_samples, module.get_submodule(m.hook).weight.shape[-1],
                                      device=self.device) for m in mappings}
        record = {"sums": sums, "tokens": dict.fromkeys(sums, 0), "calls": {m.parent: [] for m in mappings},
                  "samples": {m.parent: [] for m in mappings}, "cache": cache}
        at, shared, outputs = [0], [frozenset()], {}  # outputs: each parent's output bytes for one sample

        def activations(name):
            def hook(_, args, output):
                sums[name][at[0]] += awq.activation_sum(args[0])
                record["tokens"][name] += args[0].numel() // args[0].shape[-1]
            return hook

        def call(parent):
            def hook(m, args, kw):
                bound = inspect.signature(m.forward).bind(*args, **kw).arguments
                bound |= bound.pop("kwargs", {})
                record["calls"][parent].append(cache.keep(replayable(m, bound), shared[0]))
                record["samples"][parent].append(at[0])
            return hook

        def output(parent):
            def hook(_, args, y):
                y = y[0] if isinstance(y, tuple) else y  # as awq.outputs keeps it
                outputs[parent] = y.numel() * y.element_size()
            return hook

        handles = [module.get_submodule(m.hook).register_forward_hook(activations(m.smooth)) for m in mappings]
        handles += [module.get_submodule(p).register_forward_pre_hook(call(p), with_kwargs=True)
                    for p in record["calls"]]
        handles += [module.get_submodule(p).register_forward_hook(output(p)) for p in record["calls"]]
        try:
            with timed(seconds, "calibrate"), experts_mode(module, self.all_experts):
                first = True
                for chunk, x in chunks():
                    for i, sample in enumerate(x.split(1)):
                        at[0], kw = self.chunks[chunk][0] + i, kwargs()
                        shared[0] = tensor_ids(kw)
                        module(sample, **kw)
                        if first:
                            self._record_fits(layer, cache, max(outputs.values(), default=0))
                            first = False
        finally:
            for h in handles:
                h.remove()
        return record

    def _record_fits(self, layer: int, cache: DeviceCache, reference: int):
        """Once the first sample is recorded: UsageError if this rank's samples, each recorded as large, with the
        `reference` bytes of a sample's output that the search keeps per sample (a mapping's at a time, beside what
        is left of the record), would not fit in what the cache may hold and its share of the temporary directory's
        free space, none if that is in memory (every sample's calls have the same shapes: the whole layer would be
        spent before the disk filled; every rank on the host records its own at once)."""
        per_sample, (tmp, room, in_memory) = cache.kept + reference, file_room()
        own = partition(len(self.chunks), self.world.size, self.world.rank)
        samples = sum(self.chunks[c][1] - self.chunks[c][0] for c in own)
        in_file = 0 if in_memory else cache.on_disk  # a file in memory holds memory
        memory, disk = cache.left + cache.host_left + cache.kept - in_file, room + in_file
        if per_sample * samples <= memory + disk:
            return
        if in_memory:
            room_text = f"the {memory / 1e9:.3g} GB of memory it may use ({tmp}, the temporary directory, is in " \
                "memory too)"
        else:
            local = local_ranks()
            share = f" (its share: {local} ranks on this host record at once)" if local > 1 else ""
            room_text = f"the {memory / 1e9:.3g} GB of memory and the {disk / 1e9:.3g} GB of disk in {tmp} it may " \
                f"use{share}"
        raise UsageError(f"layer {layer}: AWQ's record of its calls on rank {self.world.rank} would take "
                         f"{per_sample * samples / 1e9:.3g} GB ({samples} samples of {per_sample / 1e9:.3g} GB, "
                         "with the outputs its search keeps), "
                         f"more than {room_text}: run on more ranks (each records its share of the samples), with "
                         f"fewer --num-samples, or with TMPDIR on a{'' if in_memory else ' larger'} disk")

    def _search(self, layer: int, module, m, record: dict, cache: DeviceCache) -> tuple[torch.Tensor, int | None]:
        """AWQ's scales of mapping `m` (empty where it is skipped) and the grid point chosen: every rank's samples'
        statistics reduced in per-sample slots (exact), the grid's errors on this rank's samples, the search
        starting from the point the last search chose (rank 0's: every rank must run the same points). The
        reference outputs go in `cache`; the recorded calls come back from the record's one at a time."""
        stage, world, prefix = self.stage.stage, self.world, self.prefix(layer)
        parent, calls = module.get_submodule(m.parent), record["calls"][m.parent]
        reference, finite, size = [], [], 0
        for y in awq.outputs(parent, map(record["cache"].use, calls)):
            finite.append(y.isfinite().all())
            size += y.numel()
            reference.append(cache.keep(y))
        ok, tokens, elements, counts, first = zip(*world.gather_objects(
            (bool(torch.stack(finite).all()) if finite else True, record["tokens"][m.smooth], size, len(calls),
             self._awq_first)))
        if not all(ok) or not sum(elements):  # the peer skips a mapping whose outputs are not all finite
            return torch.zeros(0), None
        sums = record["sums"][m.smooth]
        _wait(world.all_reduce(sums))
        x_mean = awq.activation_mean(sums, sum(tokens))
        quantized = {b: module.get_submodule(b) for b in m.balance if prefix + b in self.schemes}
        args = {b: self.schemes[prefix + b].weights for b in quantized}
        w_mean = awq.weight_mean([q.weight for q in quantized.values()], list(args.values())) \
            if stage.duo_scaling else None
        points = awq.grid(stage.n_grid, stage.duo_scaling)
        with awq.Candidates(quantized, points, x_mean, w_mean, args, self.source.family.fused_scales) as held:
            def errors(point: int, at: list[int]) -> torch.Tensor:
                held.hold(point)
                got = awq.outputs(parent, (record["cache"].use(calls[i]) for i in at))
                return torch.cat([awq.sample_errors([cache.use(reference[i])], [y]) for i, y in zip(at, got)])

            point = awq.search(errors, record["samples"][m.parent], len(points),
                               awq.rounds(max(counts), sum(elements) // world.size), self.num_samples,
                               sum(elements), lambda t: _wait(world.all_reduce(t)), self.device,
                               (len(points) // 3 if first[0] is None else first[0]) % len(points))
        self._awq_first = point
        return awq.scales(x_mean, w_mean, *points[point]), point

    def batches(self, layer: int, module, todo: list[Group], budget: int) -> list[list[Group]]:
        """The groups to solve (GPTQ, SparseGPT), in batches whose Hessians fit beside the layer in `budget` bytes
        (plan.memory_batches)."""
        stream = bool(streamed(module))  # its experts are read with their batch
        batches = memory_batches(todo, budget - _held_bytes(module), self.source.dtype.itemsize * stream)
        if len(batches) > 1 and self.world.rank == 0:
            log.info("layer %d: %d groups in %d batches%s, to keep within %.1f GB", layer, len(todo), len(batches),
                     ", each reading its experts" if stream else "", budget / 1e9)
        return batches

    def _sparsegpt(self, layer, module, groups, tensors, chunks, kwargs, seconds, persist, budget) -> dict:
        """Each batch of groups (`batches`) calibrated on the layer's weights as loaded, then pruned; the pruned
        weights put in place once every batch is done, so that no batch's Hessians see another's pruning."""
        for batch in self.batches(layer, module, groups, budget) if groups and budget is not None else [groups]:
            self._sparsegpt_batch(layer, module, batch, tensors, chunks, kwargs, seconds, persist)
        self.apply(module, layer, self.stage, tensors)
        return {}

    def _sparsegpt_batch(self, layer, module, groups, tensors, chunks, kwargs, seconds, persist):
        stage, prefix = self.stage.stage, self.prefix(layer)
        n, m = stage.n_of_m
        if groups:
            calib = self.calibrate(layer, module, groups, lambda: (x for _, x in chunks()), kwargs(), seconds, {})
            with timed(seconds, "solve"):
                owners = _owners(groups, self.world.size, lambda g: g.rows * g.cols**2 + g.cols**3)
                hessians = _hessians(self.world, calib, groups, owners, self.num_samples)
                pruned, works = {}, []
                for g in groups:
                    weights = {name: module.get_submodule(name).weight for name, _ in g.modules}
                    if owners[g.name] == self.world.rank:
                        pruned.update(sparsegpt.sparsify_group(weights, hessians[g.name], stage.sparsity, n, m,
                                                              stage.block_size, stage.dampening_frac))
                    else:
                        pruned.update({name: torch.empty_like(w) for name, w in weights.items()})
                    works.extend(self.world.broadcast(pruned[name], owners[g.name]) for name in weights)
                    hessians.pop(g.name, None)
                for work in works:
                    _wait(work)
                tensors.update({f"{prefix}{name}.weight": w for name, w in pruned.items()})
            mine = [g for g in groups if owners[g.name] == self.world.rank]
            if mine:
                persist([g.name for g in mine], {f"{prefix}{name}.weight": pruned[name] for g in mine
                                                 for name, _ in g.modules})

    def _rtn(self, layer, module, groups, tensors, chunks, kwargs, seconds, persist) -> tuple[dict, dict | None]:
        """Round to nearest of the groups this rank owns; static input ranges first, from a forward whose outputs
        are the next layer's inputs (where the layer has no experts, whose calibration runs them all)."""
        prefix, outputs = self.prefix(layer), None
        if groups and self.forwards:
            ranges, outputs = self._ranges(layer, module, groups, chunks, kwargs, seconds)
        elif groups:
            ranges = {}
        with timed(seconds, "solve"):
            owners = _owners(groups, self.world.size, lambda g: g.rows * g.cols)
            mine = [g for g in groups if owners[g.name] == self.world.rank]
            names = [n for g in mine for n, _ in g.modules]
            if names:
                inputs = {n: input_qparams(self.schemes[prefix + g.name], ranges.get(g.name),
                                           module.get_submodule(n).weight.dtype) for g in mine for n, _ in g.modules}
                weights = {n: module.get_submodule(n).weight for n in self.quantized[layer]}
                found = rtn.compress(weights, {n: self.schemes[prefix + n] for n in weights},
                                     self.source.family.fused_scales, inputs, names)
                packed = {f"{prefix}{n}.{k}": v for n, t in found.items() for k, v in t.items()}
                tensors.update(packed)
                persist([g.name for g in mine], packed)
        return {}, outputs

    def _ranges(self, layer: int, module, groups: list[Group], chunks: Chunks, kwargs: Callable[[], dict],
                seconds: dict) -> tuple[dict, dict | None]:
        """Each group's input range ([min, max]) over every rank's chunks (exact), for those with static inputs;
        and the layer's outputs by chunk, where the layer has no experts."""
        prefix, seen = self.prefix(layer), {}
        static = [g.name for g in groups if static_inputs(self.schemes[prefix + g.name])]
        experts = has_experts(module)

        def hook(name):
            def observe(_, args):
                x, r = args[0], seen.get(name)
                now = torch.stack([x.amin(), x.amax()])
                seen[name] = now if r is None else torch.stack([torch.minimum(r[0], now[0]),
                                                                torch.maximum(r[1], now[1])])
            return observe

        handles = [module.get_submodule(n).register_forward_pre_hook(hook(n)) for n in static]
        outputs = None if experts else {}
        try:
            with timed(seconds, "calibrate"), experts_mode(module, self.all_experts):
                for chunk, x in chunks():
                    y = self.forward(module, x, kwargs())
                    if outputs is not None:
                        outputs[chunk] = y
        finally:
            for h in handles:
                h.remove()
        dtypes = {n: module.get_submodule(n).weight.dtype for n in static}
        found = _extrema(self.world, {n: None if seen.get(n) is None else seen[n][:, None] for n in static},
                         dict.fromkeys(static, 1), dtypes)
        return {n: r[:, 0] for n, r in found.items()}, outputs

    # -- GPTQ ------------------------------------------------------------------------------------------------
    def compress(self, layer: int, module, groups: list[Group], chunks: Callable[[], Iterable[torch.Tensor]],
                 kwargs: dict, seconds: dict, persist: Persist | None = None) -> tuple[dict, dict]:
        """`groups` of the layer calibrated over this rank's `chunks` (their inputs, on the device), with their
        experts held where the layer streams them, then solved across the ranks by the weight-parallel plan; qparams
        come from the weights as the passes before left them. `persist(group names, packed tensors)` is given this
        rank's owned groups as soon as they are solved (sub-layer progress). Returns the compressed tensors and this
        rank's notes."""
        names = [n for g in groups for n, _ in g.modules]
        with contextlib.ExitStack() as held:
            with timed(seconds, "load"):
                held.enter_context(self.source.hold(module, layer, names, self.device))
            packing = LayerPacking(self.schemes, self.prefix(layer), dict(module.named_modules()), names, {},
                                   self.source.family.fused_scales)
            calib = self.calibrate(layer, module, groups, chunks, kwargs, seconds)
            packing.ranges = calib.ranges  # reduced across ranks in place by the executor
            with timed(seconds, "gptq"):
                return self._solve(layer, packing, groups, calib, persist)

    def calibrate(self, layer: int, module, groups: list[Group], chunks: Callable[[], Iterable[torch.Tensor]],
                  kwargs: dict, seconds: dict, schemes: dict | None = None) -> Calibration:
        """Hessians of `groups` over `chunks`, and static inputs' ranges (not yet reduced across ranks) of those
        whose scheme (`schemes`, by group; default: the quantizer's) has them."""
        start, prefix = time.perf_counter(), self.prefix(layer)
        schemes = {g.name: self.schemes[prefix + g.name] for g in groups} if schemes is None else schemes
        calib = Calibration(module, [[n for n, _ in g.modules] for g in groups], self.device, self.seq_len, schemes)
        with experts_mode(module, self.all_experts):
            for x in chunks():
                for sample in x.split(1):
                    calib.run(module, sample, kwargs)
                calib.end_chunk()
        calib.remove()
        device_done()
        seconds["hessian"] = seconds.get("hessian", 0.0) + calib.seconds
        seconds["calibrate"] = seconds.get("calibrate", 0.0) + time.perf_counter() - start - calib.seconds
        return calib

    def _solve(self, layer: int, packing: LayerPacking, groups: list[Group], calib: Calibration,
               persist: Persist | None) -> tuple[dict, dict]:
        tensors, given = {}, set()

        def solved(done: list):
            packed = {k: v for g, weight in done for k, v in packing.pack(g, weight).items()}
            given.update(g.name for g, _ in done)
            tensors.update(packed)
            if persist is not None:
                persist([g.name for g, _ in done], packed)

        executor = Executor(self.world, make_plan(groups, self.world.size), groups, packing.weights, self.recipe,
                            layer, solved, packing.args, packing.qparams)
        results = executor.run(calib.hessian, self.num_samples, calib.ranges)
        for g in groups:
            if g.name not in given:
                tensors.update(packing.pack(g, results[g.name]))
        return tensors, {name: {"damping": d} for g, d in executor.damping.items() for name, _ in g.modules}

    # -- propagate -------------------------------------------------------------------------------------------
    def propagate(self, layer: int, module, tensors: dict, chunks: Iterable[tuple[int, torch.Tensor]], kwargs: dict,
                  seconds: dict) -> Iterator[tuple[int, torch.Tensor]]:
        """The next layer's inputs, chunk by chunk, through the layer as the pass leaves it: GPTQ's quantized
        weights (`tensors`) unpacked into it; the other passes' decisions are in place already."""
        if self.kind == "gptq":
            with timed(seconds, "propagate"):
                self.unpack(module, layer, tensors)
        for chunk, x in chunks:
            with timed(seconds, "propagate"):
                y = self.forward(module, x, kwargs)
            yield chunk, y

    @staticmethod
    def forward(module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The layer on a chunk, one sample at a time, as the peer runs it: cache-friendly on CPU (a batch's attention
        scores outgrow the cache) and the same bits in every pass and replay."""
        outputs = [module(sample, **kwargs) for sample in x.split(1)]
        return torch.cat([y[0] if isinstance(y, tuple) else y for y in outputs])

    def unpack(self, module: torch.nn.Module, layer: int, tensors: dict):
        """Put the layer's quantized weights (compressed `tensors`) into `module`; the experts it streams get theirs
        each time they are called."""
        containers = streamed(module)
        inside = tuple(f"{c}." for c in containers)
        unpack_into(module, self.prefix(layer), [n for n in self.quantized[layer] if not n.startswith(inside)],
                    tensors, self.schemes)
        for name, container in containers.items():
            container.fetch = functools.partial(self._expert, layer, name, tensors)

    def _expert(self, layer: int, container: str, tensors: dict, e: int) -> dict:
        """Expert `e` of a streamed `container` of `layer`, quantized: its quantized weights decompressed from
        `tensors`, the others original."""
        local = f"{container}.{e}."
        quantized = [n[len(local):] for n in self.quantized[layer] if n.startswith(local)]
        weights = self.source.expert(layer, container, e, self.device, tuple(f"{q}.weight" for q in quantized))
        expert, prefix = self.source.layers[layer].get_submodule(local[:-1]), self.prefix(layer)
        for q in quantized:
            weights[f"{q}.weight"] = unpacked(tensors, prefix + local + q, self.schemes[prefix + local + q],
                                              expert.get_submodule(q).weight.dtype)
        return weights


def _cache_allowances(module, budget: int | None, device) -> tuple[float, float]:
    """The bytes AWQ may cache in a layer (its calls, then each mapping's reference outputs) on the device, then in
    host memory. The device's: half the budget less the layer's own tensors, as the replays' window takes half
    (inputs.py); the rest is the search's working memory (candidate weights, a round's outputs). The host's: half of
    this rank's share of its available memory; on the CPU, the lesser of the two is the device's."""
    device_bytes = math.inf if budget is None else max(0, budget // 2 - _held_bytes(module))
    host_bytes = host_share() // 2
    if torch.device(device).type == "cpu":
        return min(device_bytes, host_bytes), 0
    return device_bytes, host_bytes


def _held_bytes(module) -> int:
    """The bytes of a layer's tensors that are held (a streamed layer's experts on the meta device are not)."""
    return sum(t.nbytes for t in module.state_dict().values() if not t.is_meta)


def _put(module, name: str, tensor: torch.Tensor):
    """Parameter `name` of `module` (a local name) replaced by `tensor` (loaded weights may be file-backed: never
    written in place)."""
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, torch.nn.Parameter(tensor, requires_grad=False))


def _fold(module, m, scales: torch.Tensor, family):
    """Mapping `m`'s scales folded into `module`: its smooth layer's output (weight rows, bias) divided, its balance
    layers' input columns multiplied."""
    smooth = module.get_submodule(m.smooth)
    bias = getattr(smooth, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    balance = [module.get_submodule(b).weight for b in m.balance]
    new, balance, new_bias = smoothing.fold(scales, smooth.weight, balance, bias, family.offset_norm(smooth))
    _put(module, f"{m.smooth}.weight", new)
    if new_bias is not None:
        _put(module, f"{m.smooth}.bias", new_bias)
    for b, w in zip(m.balance, balance):
        _put(module, f"{b}.weight", w)


def _extrema(world: World, ranges: dict, channels: dict, dtypes: dict) -> dict:
    """Per name, [2, channels]: the minimum (row 0) and maximum (row 1) over every rank's `ranges` (None where a
    rank saw nothing), exactly: each rank's values in its own slot of an all-reduce by sum, then reduced here."""
    names = sorted(ranges)
    rows = []
    for n in names:
        r = ranges[n]
        if r is None:
            r = torch.tensor([[torch.inf], [-torch.inf]], dtype=torch.float64).expand(2, channels[n])
        rows.append(r.to(world.device, torch.float64, copy=True).reshape(2, channels[n]))
    mine = torch.cat(rows, dim=1) if rows else torch.zeros(2, 0, dtype=torch.float64, device=world.device)
    slots = torch.zeros(world.size, *mine.shape, dtype=torch.float64, device=world.device)
    slots[world.rank] = mine
    _wait(world.all_reduce(slots))
    low, high = slots[:, 0].amin(0), slots[:, 1].amax(0)
    out, at = {}, 0
    for n in names:
        out[n] = torch.stack([low[at:at + channels[n]], high[at:at + channels[n]]]).to(dtypes[n])
        at += channels[n]
    return out


def _owners(groups: list[Group], world_size: int, cost: Callable[[Group], float]) -> dict[str, int]:
    """Each group's rank: the costliest first, each to the least loaded rank (the lowest of equals): the same on
    every rank."""
    load, out = [0.0] * world_size, {}
    for g in sorted(groups, key=lambda g: (-cost(g), g.name)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[g.name], load[rank] = rank, load[rank] + cost(g)
    return out


def _hessians(world: World, calib: Calibration, groups: list[Group], owners: dict, num_samples: int) -> dict:
    """Each group's Hessian on its owner (summed over the ranks, divided by the number of samples), a whole fp32
    [d, d] matrix: the one place that reads calibration's Hessians (gptq.Lower) outside GPTQ's executor."""
    works = [world.reduce_to(gptq.packed(calib.hessian[g.name]), owners[g.name]) for g in groups]
    for work in works:
        _wait(work)
    mine = [g.name for g in groups if owners[g.name] == world.rank]
    for name in mine:
        gptq.packed(calib.hessian[name]).div_(num_samples)
    return {name: gptq.dense(calib.hessian[name]) for name in mine}


def _wait(work):
    if work is not None:
        work.wait()
