"""One decoder layer's compression, for everyone who runs one: load -> calibrate -> solve -> propagate.

No epochs and no I/O of the state: the runner sequences epochs and commits around these steps (and persists what
they solve), a replay runs committed layers through `quantized` and `forward`, and `plan --fleet --calibrate` times
them on one layer. Each step adds its seconds to the phase it belongs to, as the runner's commits report them.
"""

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from elastic_oneshot.distributed.world import World
from elastic_oneshot.loop.calibration import Calibration
from elastic_oneshot.models.moe import experts_mode, streamed
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.quantization.executor import Executor
from elastic_oneshot.quantization.packing import LayerPacking, unpack_into, unpacked
from elastic_oneshot.quantization.plan import Group, layer_groups, make_plan
from elastic_oneshot.quantization.recipe import Recipe


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


class LayerStep:
    """A job's per-layer steps: `schemes` (each quantized module's, by full name), `recipe` (GPTQ's settings), on
    `world`'s ranks and `device`; samples of `seq_len` tokens, `num_samples` in all (GPTQ's Hessians are sums over
    them); `all_experts`: every expert calibrates on every token (`--moe-calibrate all`)."""

    def __init__(self, source: SourceModel, schemes: dict, recipe: Recipe, world: World, device, seq_len: int,
                 num_samples: int, all_experts: bool):
        self.source, self.schemes, self.recipe, self.world, self.device = source, schemes, recipe, world, device
        self.seq_len, self.num_samples, self.all_experts = seq_len, num_samples, all_experts
        self.quantized = source.by_layer(list(schemes))  # per layer, the quantized modules' names local to it

    def load(self, layer: int, budget: int | None, seconds: dict) -> tuple[torch.nn.Module, list[Group]]:
        """Layer `layer` from the checkpoint, on the device (its experts streamed where its weights would take more
        than half of `budget`: source.load_layer), and its GPTQ groups."""
        with timed(seconds, "load"):
            module = self.source.load_layer(layer, self.device, budget)
            return module, layer_groups(module, self.quantized[layer], self.source.family.input_key(self.all_experts))

    def compress(self, layer: int, module, groups: list[Group], chunks: Callable[[], Iterable[torch.Tensor]],
                 kwargs: dict, seconds: dict, persist: Callable[[list[str], dict], None] | None = None
                 ) -> tuple[dict, dict]:
        """`groups` of the layer calibrated over this rank's `chunks` (their inputs, on the device), with their
        experts held where the layer streams them, then solved across the ranks by the weight-parallel plan; qparams
        come from the original weights. `persist(group names, packed tensors)` is given this rank's owned groups as
        soon as they are solved (sub-layer progress). Returns the compressed tensors and this rank's notes."""
        names = [n for g in groups for n, _ in g.modules]
        with contextlib.ExitStack() as held:
            with timed(seconds, "load"):
                held.enter_context(self.source.hold(module, layer, names, self.device))
            packing = LayerPacking(self.schemes, f"{self.source.layer_prefix}{layer}.", dict(module.named_modules()),
                                   names, {}, self.source.family.fused_scales)
            calib = self.calibrate(layer, module, groups, chunks, kwargs, seconds)
            packing.ranges = calib.ranges  # reduced across ranks in place by the executor
            with timed(seconds, "gptq"):
                return self._solve(layer, packing, groups, calib, persist)

    def calibrate(self, layer: int, module, groups: list[Group], chunks: Callable[[], Iterable[torch.Tensor]],
                  kwargs: dict, seconds: dict) -> Calibration:
        """Hessians of `groups` over `chunks`, and static inputs' ranges (not yet reduced across ranks)."""
        start, prefix = time.perf_counter(), f"{self.source.layer_prefix}{layer}."
        calib = Calibration(module, [[n for n, _ in g.modules] for g in groups], self.device, self.seq_len,
                            {g.name: self.schemes[prefix + g.name] for g in groups})
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
               persist: Callable[[list[str], dict], None] | None) -> tuple[dict, dict]:
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

    def propagate(self, layer: int, module, tensors: dict, chunks: Iterable[tuple[int, torch.Tensor]], kwargs: dict,
                  seconds: dict) -> Iterator[tuple[int, torch.Tensor]]:
        """The next layer's inputs, chunk by chunk, through the layer with its quantized weights (`tensors`)."""
        with timed(seconds, "propagate"):
            self.unpack(module, layer, tensors)
        for chunk, x in chunks:
            with timed(seconds, "propagate"):
                y = self.forward(module, x, kwargs)
            yield chunk, y

    def quantized_layer(self, layer: int, tensors: dict, budget: int | None) -> torch.nn.Module:
        """A committed layer, its quantized weights (compressed `tensors`) in place, on the device."""
        module = self.source.load_layer(layer, self.device, budget)
        self.unpack(module, layer, tensors)
        return module

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
        unpack_into(module, f"{self.source.layer_prefix}{layer}.",
                    [n for n in self.quantized[layer] if not n.startswith(inside)], tensors, self.schemes)
        for name, container in containers.items():
            container.fetch = functools.partial(self._expert, layer, name, tensors)

    def _expert(self, layer: int, container: str, tensors: dict, e: int) -> dict:
        """Expert `e` of a streamed `container` of `layer`, quantized: its quantized weights decompressed from
        `tensors`, the others original."""
        local = f"{container}.{e}."
        quantized = [n[len(local):] for n in self.quantized[layer] if n.startswith(local)]
        weights = self.source.expert(layer, container, e, self.device, tuple(f"{q}.weight" for q in quantized))
        expert, prefix = self.source.layers[layer].get_submodule(local[:-1]), f"{self.source.layer_prefix}{layer}."
        for q in quantized:
            weights[f"{q}.weight"] = unpacked(tensors, prefix + local + q, self.schemes[prefix + local + q],
                                              expert.get_submodule(q).weight.dtype)
        return weights
