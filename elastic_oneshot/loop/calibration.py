"""The calibration pass's hooks: one Hessian per input group, accumulated while the layer runs, and the
running min and max of the input of groups whose input activations are static (the peer's static_minmax
observer, on the raw inputs: the peer calibrates with quantization disabled).

Within a chunk the Hessian is summed in fp32, as the peer sums; across chunks in fp64 (see
gptq.hessian_add), so the total hardly depends on how chunks are split across ranks. Both are kept as their lower
triangle (gptq.Lower): half the memory of the whole matrices. Min and max are exact, so their reduction across
ranks (executor.py) does not depend on the split at all.
"""

import math
import re
import time

import torch

from elastic_oneshot.quantization import gptq
from elastic_oneshot.quantization.schemes import static_inputs

_NUMBERED = re.compile(r"(.*)\.\d+\.([^.]+)$")  # a container's numbered child's module: experts.7.down_proj


class _Stop(Exception):
    """Raised by the last hooked module: the calibration pass needs no layer output."""


class Calibration:
    """Forward pre-hooks on a layer's quantized modules; `run` feeds one sample, `end_chunk` folds the
    chunk's fp32 partial sums into the fp64 totals (`hessian`: leader -> gptq.Lower). `schemes`: group leader ->
    its QuantizationScheme; the input range of groups with static input activations is kept (`ranges`: leader ->
    [min, max], input dtype)."""

    def __init__(self, layer: torch.nn.Module, groups: list[list[str]], device, seq_len: int, schemes: dict):
        modules = dict(layer.named_modules())
        self.ranges = {g: torch.tensor([math.inf, -math.inf], dtype=modules[g].weight.dtype, device=device)
                       for g, scheme in schemes.items() if static_inputs(scheme)}
        self.hessian = {g[0]: gptq.Lower(modules[g[0]].in_features, torch.float64, device) for g in groups}
        self.chunk, self._stacks = self._partials({g[0]: len(g) for g in groups}, device)
        self.seconds, self.seq_len = 0.0, seq_len
        self.order: list[str] = []
        self.last = None
        self._inputs: dict = {}
        self._handles = [modules[name].register_forward_pre_hook(self._hook(name, g[0]))
                         for g in groups for name in g]

    def _partials(self, sizes: dict, device) -> tuple[dict, dict]:
        """The chunk's fp32 partial sums (leader -> gptq.Lower); those of the one-module groups (`sizes`: leader ->
        its group's modules) of a container's numbered children (an MoE layer's experts' down projections) narrow
        enough to be one strip, as views of one stacked buffer, so that `observe_all` can add all of their products
        at once (stacks: tuple of leaders -> [n, d, d]). Each is still a Lower: the loop's hooks add to it alone."""
        chunk, families = {}, {}
        for leader, total in self.hessian.items():
            found = _NUMBERED.match(leader)
            if found and sizes[leader] == 1 and gptq.Lower.size(total.d, device) == total.d**2:  # one strip
                families.setdefault((found.group(1), found.group(2), total.d), []).append(leader)
            else:
                chunk[leader] = gptq.Lower(total.d, torch.float32, device)
        stacks = {}
        for (_, _, d), leaders in families.items():
            stack = torch.zeros(len(leaders), d, d, dtype=torch.float32, device=device)
            stacks[tuple(leaders)] = stack
            for i, leader in enumerate(leaders):
                chunk[leader] = gptq.Lower(d, torch.float32, device, packed=stack[i].view(-1))
        return chunk, stacks

    def _hook(self, name, leader):
        def hook(module, args):
            self._observe(name, leader, args[0])
        hook.observe_all, hook.target = self.observe_all, (name, leader)  # see observe_all
        return hook

    def observe_all(self, hooks: list, x: torch.Tensor):
        """What `hooks` (this calibration's, of n modules) would do, x[i] being the input of hooks[i]'s module: an MoE
        layer's experts batched (moe.Experts._batched). Where their partial sums are one stack, their products are
        added at once; every module is then observed as its hook would observe it (order, stop, ranges)."""
        targets = [h.target for h in hooks]
        stack = self._stacks.get(tuple(leader for _, leader in targets))
        if stack is not None and not any(leader in self._inputs for _, leader in targets):
            t = time.perf_counter()
            gptq.hessian_add_batch(stack, x)
            self.seconds += time.perf_counter() - t
        for (name, leader), xi in zip(targets, x):
            self._observe(name, leader, xi, summed=stack is not None)

    def _observe(self, name: str, leader: str, x: torch.Tensor, summed: bool = False):
        """Module `name` (of `leader`'s group) sees `x`: its group's Hessian (unless `summed` already), its range."""
        if leader not in self._inputs:
            if not summed:
                t = time.perf_counter()
                gptq.hessian_add(self.chunk[leader], x, self.seq_len)
                self.seconds += time.perf_counter() - t
            self._inputs[leader] = x
            if leader in self.ranges:
                r = self.ranges[leader]
                self.ranges[leader] = torch.stack([torch.minimum(r[0], x.amin()), torch.maximum(r[1], x.amax())])
        elif self._inputs.get(leader) is not x:
            raise RuntimeError(f"{name} was expected to share its input with {leader}")
        if self.last is None:
            self.order.append(name)
        elif self.last and name == self.last:
            raise _Stop

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
            gptq.fold(self.hessian[leader], partial)
            partial.packed.zero_()

    def remove(self):
        for h in self._handles:
            h.remove()
        self.chunk.clear()
        self._stacks.clear()
