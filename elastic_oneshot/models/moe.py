"""Mixture-of-experts blocks made quantizable and calibratable.

transformers 5 keeps a block's experts fused in 3D parameters (gate and up concatenated or interleaved, as (out, in)
or transposed, with or without biases, gated by act(gate) * up or by the class's own gating such as GPT-OSS's
clamped SwiGLU); checkpoints keep one Linear per expert and projection, or the fused tensors (GPT-OSS, GraniteMoE,
Llama 4), which are then split per expert as they are read (`Experts.unfused`). Only the experts container is
replaced, by one holding the experts as Linear modules under the checkpoint's names and taking the container's
call (hidden states, top-k indices, top-k weights; or Llama 4's tokens repeated once per expert); the block's own
forward (router, its normalization, shared experts and their gates) runs unchanged, so shared experts are read,
calibrated and quantized like any other Linear. In all-experts calibration every expert runs on every token, so
every expert gets a full Hessian, while the container's output still sums only the routed tokens with their
routing weights: the output equals the original's (the down projections compute only those rows; their Hessians
still see every token).

A layer too large to hold whole streams its experts (`Experts.streamed`): they stay on the meta device and are held
a batch at a time while calibrated and solved, and one at a time, fetched, for each later forward pass.
"""

import contextlib
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable

import torch

# A fused container's parameters, and the per-expert projections each holds (gate and up side by side); ungated
# experts (NemotronH's: down(act(up(x)))) hold only up and down.
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a fused experts container holds and calls its experts, as its family says (models.family): weights as
    (out, in) or transposed, gate and up concatenated or interleaved, biases or none, called with the routed
    tokens or (`stacked`) with every token repeated once per expert; `gating` makes (gate, up) one activation, or
    for experts without a gate (not `gated`) is the activation of up alone."""

    gating: Callable[..., torch.Tensor]
    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    stacked: bool = False
    gated: bool = True

    @property
    def fused(self) -> tuple[str, str]:
        """The container's fused parameters: the one holding up (and gate), then down's."""
        return ("gate_up_proj" if self.gated else "up_proj", "down_proj")


def default_gating(act_fn) -> Callable:
    """transformers' default gating of experts: act(gate) * up."""
    return functools.partial(_activated, act_fn)


def own_gating(apply_gate, interleaved: bool) -> Callable:
    """A container's own gating (GPT-OSS's clamped SwiGLU), called on the fused projection it expects."""
    return functools.partial(_own_gating, apply_gate, interleaved)


class RowsLinear(torch.nn.Linear):
    """A Linear that can compute only some rows of its output while its hooks see the whole input: in
    all-experts calibration the down projection's Hessian needs every token, the block only the routed."""

    def forward(self, x, rows=None):
        return super().forward(x if rows is None else x[rows])


def _activated(act_fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act_fn(gate) * up


def _own_gating(apply_gate, interleaved: bool, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return apply_gate(torch.stack((gate, up), -1).flatten(-2) if interleaved else torch.cat((gate, up), -1))


class Expert(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, bias: bool, gating, gated: bool = True):
        super().__init__()
        if gated:
            self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias, dtype=dtype)
        self.down_proj = RowsLinear(intermediate, hidden, bias=bias, dtype=dtype)
        self.gating, self.gated = gating, gated

    def forward(self, x, rows=None):
        inner = self.gating(self.gate_proj(x), self.up_proj(x)) if self.gated else self.gating(self.up_proj(x))
        return self.down_proj(inner, rows)


class Experts(torch.nn.ModuleList):
    """A fused experts container as one Expert per index, called as the container is. It keeps the container's
    layout, by which a checkpoint that stores it fused is split."""

    all_experts = False  # set by `experts_mode` during calibration passes with --moe-calibrate all
    streamed = False  # the experts stay on the meta device but while they are held or called (source.load_layer)
    fetch = None  # for a streamed container: expert index -> its weights (local names) for one call, or None to skip

    def __init__(self, fused: torch.nn.Module, layout: Layout):
        up = fused.get_parameter(layout.fused[0])
        num, intermediate, hidden = (up.transpose(1, 2) if layout.transposed else up).shape
        super().__init__(Expert(hidden, intermediate // (2 if layout.gated else 1), up.dtype, layout.bias,
                                layout.gating, layout.gated) for _ in range(num))
        self.layout = layout

    def forward(self, hidden_states: torch.Tensor, top_k_index=None, top_k_weights=None):
        if self.layout.stacked:
            return self._stacked(hidden_states)
        if self._batchable(hidden_states):
            return self._batched(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        for e, (top_k_pos, tokens) in enumerate(_routed(top_k_index, len(self))):
            if not (self.all_experts or tokens.numel()):
                continue
            with self._held(e, hidden_states.device) as expert:
                if expert is None:
                    continue
                y = expert(hidden_states, rows=tokens) if self.all_experts else expert(hidden_states[tokens])
            out.index_add_(0, tokens, (y * top_k_weights[tokens, top_k_pos, None]).to(out.dtype))
        return out

    def _batchable(self, x: torch.Tensor) -> bool:
        """All experts at once (`_batched`): on an accelerator, where a loop over experts is bound by launches, for
        experts held whole and without biases, whose modules have no hooks but calibration's pre-hooks in
        all-experts calibration (which `_batched` calls as the loop's calls would)."""
        if x.device.type == "cpu" or self.streamed or self.layout.bias or not self.layout.gated:
            return False
        modules = [m for e in self for m in (e.gate_proj, e.up_proj, e.down_proj)]
        return not any(m._forward_hooks or (m._forward_pre_hooks and not self.all_experts) or m.weight.is_meta
                       for m in modules)

    def _batched(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The loop of `forward` with every expert in one batched product per projection: the routed tokens of
        expert e in row block e, padded to the most any expert got; in all-experts calibration, gate and up on every
        token, each module's pre-hooks called with its input as the loop's calls would (the down projections' with
        every token). The tokens' outputs are summed in expert order, as the loop's index_add_ sums them; the products
        are batched ones, so an accelerator's bits may differ from the loop's (the CPU runs the loop)."""
        experts, tokens = len(self), hidden_states.shape[0]
        slots, ids, counts = _routing(top_k_index, experts)
        device, routed = ids.device, len(ids)
        count = torch.tensor(counts, device=device)
        expert = torch.repeat_interleave(torch.arange(experts, device=device), count, output_size=routed)
        row = torch.arange(routed, device=device) - (torch.cumsum(count, 0) - count)[expert]  # within its block
        gate, up, down = self._stacks()
        if self.all_experts:
            for e in self:
                _pre_hooks(e.gate_proj, hidden_states)
                _pre_hooks(e.up_proj, hidden_states)
            inner = self.layout.gating(*(torch.mm(hidden_states, w.flatten(0, 1).t()).unflatten(1, w.shape[:2])
                                         .transpose(0, 1) for w in (gate, up)))  # [experts, tokens, inner]
            _pre_hooks_all([e.down_proj for e in self], inner)
            padded = inner.new_zeros(experts, max(counts), inner.shape[-1])
            padded[expert, row] = inner[expert, ids]
        else:
            padded = hidden_states.new_zeros(experts, max(counts), hidden_states.shape[-1])
            padded[expert, row] = hidden_states[ids]
            padded = self.layout.gating(torch.bmm(padded, gate.mT), torch.bmm(padded, up.mT))
        y = torch.bmm(padded, down.mT)[expert, row]  # [routed, hidden], expert by expert
        contributions = (y * top_k_weights[ids, slots, None]).to(hidden_states.dtype)
        position = torch.empty_like(ids)  # of each (slot, token) among the contributions
        position[slots * tokens + ids] = torch.arange(routed, device=device)
        order = position.view(-1, tokens).t().sort(dim=1).values  # each token's, in expert order
        out = torch.zeros_like(hidden_states)
        for j in range(order.shape[1]):
            out += contributions[order[:, j]]
        return out

    def _stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The experts' gate, up and down weights stacked [experts, out, in]: made once while those weights stay the
        same tensors, unchanged (a stack per forward would move every expert's weights twice per sample)."""
        weights = [getattr(e, n).weight for n in ("gate_proj", "up_proj", "down_proj") for e in self]
        key = [(weakref.ref(w), _state(w)) for w in weights]
        cached = getattr(self, "_stacked_weights", None)
        if cached is None or len(cached[0]) != len(key) or any(
                r() is not w or state != _state(w) for (r, state), w in zip(cached[0], weights)):
            n = len(self)
            cached = self._stacked_weights = key, tuple(torch.stack(weights[i * n:(i + 1) * n]) for i in range(3))
        return cached[1]

    @contextlib.contextmanager
    def _held(self, e: int, device):
        """Expert `e` with its weights for one call: its own, or for one not held those `fetch` gives (on
        `device`), dropped after; None where `fetch` skips it."""
        expert = self[e]
        if not expert.up_proj.weight.is_meta:
            yield expert
            return
        if self.fetch is None:
            raise RuntimeError(f"expert {e} of a streamed layer is neither held nor fetched")
        weights = self.fetch(e)
        if weights is None:
            yield None
            return
        expert.load_state_dict({k: v.to(device) for k, v in weights.items()}, assign=True, strict=True)
        try:
            yield expert
        finally:
            expert.to("meta")

    def _stacked(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert e on the e-th copy of the tokens; in all-experts calibration its gate and up projections read
        every copy (as llmcompressor's do), its down projection computes only its own."""
        n = hidden_states.shape[0] // len(self)
        return torch.cat([expert(hidden_states, rows=slice(e * n, (e + 1) * n)) if self.all_experts
                          else expert(hidden_states[e * n:(e + 1) * n]) for e, expert in enumerate(self)])

    def fused_parameters(self) -> list[str]:
        """The names of the container's fused parameters, as a checkpoint stores them."""
        return [f"{name}{suffix}" for name in self.layout.fused for suffix in ("", "_bias")
                if suffix == "" or self.layout.bias]

    def unfused_names(self, name: str) -> list[str]:
        """The per-expert tensors (local names) that the container's fused parameter `name` holds."""
        base = name.removesuffix("_bias")
        return [f"{e}.{proj}.{'weight' if name == base else 'bias'}" for proj in FUSED[base] for e in range(len(self))]

    def unfused(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-expert tensors of the container's fused parameter `name`, from its value."""
        base = name.removesuffix("_bias")
        if name == base and self.layout.transposed:
            tensor = tensor.transpose(1, 2)
        if base == "gate_up_proj":
            parts = (tensor[:, 0::2], tensor[:, 1::2]) if self.layout.interleaved else tensor.chunk(2, dim=1)
        else:
            parts = (tensor,)
        return dict(zip(self.unfused_names(name), (part[e].contiguous() for part in parts for e in range(len(self)))))


def _routing(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The top-k slots and tokens of every routing, expert by expert (within one, in slot-then-token order), and each
    expert's count, from one sort and one count: one device-to-host wait per forward, where a search per expert
    waits once per expert on a GPU."""
    tokens = top_k_index.shape[0]
    order = torch.argsort(top_k_index.t().reshape(-1), stable=True)  # slot-major positions, grouped by expert
    counts = torch.bincount(top_k_index.reshape(-1), minlength=experts).tolist()
    return order // tokens, order % tokens, counts


def _routed(top_k_index: torch.Tensor, experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per expert, the top-k slots and tokens routed to it (`_routing`'s, split)."""
    slots, ids, counts = _routing(top_k_index, experts)
    return [(slots[s:s + n], ids[s:s + n]) for s, n in zip(itertools.accumulate([0, *counts]), counts)]


def _state(w: torch.Tensor) -> tuple:
    """What changes when a tensor's values may have: written in place (its version; inference tensors keep none),
    or given other data."""
    return None if w.is_inference() else w._version, w.dtype, w.device, w.data_ptr()


def _pre_hooks(module: torch.nn.Module, x: torch.Tensor):
    """What calling `module` on `x` would run before its forward: its forward pre-hooks (calibration's)."""
    for hook in module._forward_pre_hooks.values():
        hook(module, (x,))


def _pre_hooks_all(modules: list[torch.nn.Module], x: torch.Tensor):
    """`_pre_hooks` of each module with x[i]: at once where each has one hook of one calibration, which observes
    them all in one batched product (loop.calibration.Calibration.observe_all)."""
    hooks = [list(m._forward_pre_hooks.values()) for m in modules]
    observe_all = getattr(hooks[0][0], "observe_all", None) if hooks and len(hooks[0]) == 1 else None
    if observe_all is not None and all(len(h) == 1 and getattr(h[0], "observe_all", None) == observe_all
                                       for h in hooks):
        observe_all([h[0] for h in hooks], x)
        return
    for module, xi in zip(modules, x):
        _pre_hooks(module, xi)


def make_quantizable(model: torch.nn.Module, layout_of: Callable[[torch.nn.Module], Layout | None]):
    """Replace every fused experts container in `model` (on any device, meta included): each module for which
    `layout_of` (the family's) gives a layout."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            layout = layout_of(child)
            if layout is not None:
                setattr(module, child_name, Experts(child, layout))


def streamed(layer: torch.nn.Module) -> dict[str, Experts]:
    """The layer's experts containers that stream their experts, by name."""
    return {n: m for n, m in layer.named_modules() if isinstance(m, Experts) and m.streamed}


def has_experts(layer: torch.nn.Module) -> bool:
    """Whether the layer holds an experts container (its calibration passes then run under `experts_mode`)."""
    return any(isinstance(m, Experts) for m in layer.modules())


def replayable(module: torch.nn.Module, arguments: dict) -> dict:
    """A call of `module` recorded in a calibration pass, as it is replayed alone (AWQ's grid): an expert's down
    projection then computes every token's output, as its hooks saw them (in all-experts calibration the block
    computes only the routed rows), as llmcompressor's calibration experts do."""
    return {k: v for k, v in arguments.items() if k != "rows"} if isinstance(module, RowsLinear) else arguments


def _skip(_: int) -> None:
    return None


@contextlib.contextmanager
def experts_mode(layer: torch.nn.Module, all_experts: bool):
    """Calibration passes inside: every expert runs on every token (all-experts calibration) or only on its
    routed ones, and a streamed layer's experts that are not held (outside the batch being calibrated) are
    skipped: their inputs come before them and a calibration pass's output is not used."""
    containers = [m for m in layer.modules() if isinstance(m, Experts)]
    fetches = [c.fetch for c in containers]
    for c in containers:
        c.all_experts, c.fetch = all_experts, _skip
    try:
        yield
    finally:
        for c, fetch in zip(containers, fetches):
            c.all_experts, c.fetch = False, fetch
