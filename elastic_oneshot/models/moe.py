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
"""

import contextlib
import functools
import inspect

import torch

# A fused container's parameters, and the per-expert projections each holds (gate and up side by side).
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class RowsLinear(torch.nn.Linear):
    """A Linear that can compute only some rows of its output while its hooks see the whole input: in
    all-experts calibration the down projection's Hessian needs every token, the block only the routed."""

    def forward(self, x, rows=None):
        return super().forward(x if rows is None else x[rows])


def _activated(act_fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers' default gating of experts: act(gate) * up."""
    return act_fn(gate) * up


def _own_gating(apply_gate, interleaved: bool, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A container's own gating (GPT-OSS's clamped SwiGLU), called on the fused projection it expects."""
    return apply_gate(torch.stack((gate, up), -1).flatten(-2) if interleaved else torch.cat((gate, up), -1))


class Expert(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, bias: bool, gating):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias, dtype=dtype)
        self.down_proj = RowsLinear(intermediate, hidden, bias=bias, dtype=dtype)
        self.gating = gating

    def forward(self, x, rows=None):
        return self.down_proj(self.gating(self.gate_proj(x), self.up_proj(x)), rows)


class Experts(torch.nn.ModuleList):
    """A fused experts container as one Expert per index, called as the container is. It keeps the container's
    layout (transposed, gate and up interleaved, biases), by which a checkpoint that stores it fused is split."""

    all_experts = False  # set by `experts_mode` during calibration passes with --moe-calibrate all

    def __init__(self, fused: torch.nn.Module):
        transposed, interleaved, bias = _layout(fused)
        gate_up = fused.gate_up_proj.transpose(1, 2) if transposed else fused.gate_up_proj
        num, intermediate2, hidden = gate_up.shape
        if _own_gate(fused):
            gating = functools.partial(_own_gating, fused._apply_gate, interleaved)
        else:
            gating = functools.partial(_activated, fused.act_fn)
        super().__init__(Expert(hidden, intermediate2 // 2, gate_up.dtype, bias, gating) for _ in range(num))
        self.transposed, self.interleaved, self.bias = transposed, interleaved, bias
        self.stacked = _stacked(fused)
        self.replaced = type(fused).__name__

    @staticmethod
    def replaces(module: torch.nn.Module) -> bool:
        """A fused experts container as transformers declares them (`use_experts_implementation`): gate and up
        in one 3D parameter, concatenated or interleaved, weights as (out, in) or transposed, biases or none, and
        the default gating (act(gate) * up) or one that the class defines itself, called on the fused projection."""
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
                and gate_up.dim() == 3 and down.dim() == 3 and getattr(module, "has_gate", True)
                and (_own_gate(module) or callable(getattr(module, "act_fn", None)))):
            return False
        transposed, _, bias = _layout(module)
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        num, intermediate2, hidden = gate_up.shape
        shapes = {"down_proj": ((num, hidden, intermediate2 // 2), down)}
        if bias:
            shapes.update(gate_up_proj_bias=((num, intermediate2), getattr(module, "gate_up_proj_bias", None)),
                          down_proj_bias=((num, hidden), getattr(module, "down_proj_bias", None)))
        return all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape for shape, t in shapes.values())

    def forward(self, hidden_states: torch.Tensor, top_k_index=None, top_k_weights=None):
        if self.stacked:
            return self._stacked(hidden_states)
        out = torch.zeros_like(hidden_states)
        hit = torch.nn.functional.one_hot(top_k_index, len(self)).permute(2, 1, 0)
        for index, expert in enumerate(self):
            top_k_pos, tokens = torch.where(hit[index])
            if self.all_experts:
                y = expert(hidden_states, rows=tokens)
            elif tokens.numel():
                y = expert(hidden_states[tokens])
            else:
                continue
            out.index_add_(0, tokens, (y * top_k_weights[tokens, top_k_pos, None]).to(out.dtype))
        return out

    def _stacked(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert e on the e-th copy of the tokens; in all-experts calibration its gate and up projections read
        every copy (as llmcompressor's do), its down projection computes only its own."""
        n = hidden_states.shape[0] // len(self)
        return torch.cat([expert(hidden_states, rows=slice(e * n, (e + 1) * n)) if self.all_experts
                          else expert(hidden_states[e * n:(e + 1) * n]) for e, expert in enumerate(self)])

    def fused_parameters(self) -> list[str]:
        """The names of the container's fused parameters, as a checkpoint stores them."""
        return [f"{name}{suffix}" for name in FUSED for suffix in ("", "_bias") if suffix == "" or self.bias]

    def unfused_names(self, name: str) -> list[str]:
        """The per-expert tensors (local names) that the container's fused parameter `name` holds."""
        base = name.removesuffix("_bias")
        return [f"{e}.{proj}.{'weight' if name == base else 'bias'}" for proj in FUSED[base] for e in range(len(self))]

    def unfused(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-expert tensors of the container's fused parameter `name`, from its value."""
        base = name.removesuffix("_bias")
        if name == base and self.transposed:
            tensor = tensor.transpose(1, 2)
        if base == "gate_up_proj":
            parts = (tensor[:, 0::2], tensor[:, 1::2]) if self.interleaved else tensor.chunk(2, dim=1)
        else:
            parts = (tensor,)
        return dict(zip(self.unfused_names(name), (part[e].contiguous() for part in parts for e in range(len(self)))))


def _layout(module: torch.nn.Module) -> tuple[bool, bool, bool]:
    """A container's layout: transposed, gate and up interleaved, biases; as transformers declares it
    (`use_experts_implementation`), or, for a container it does not declare (Llama 4's), transposed where only
    that reading of the shapes fits."""
    if hasattr(module, "is_transposed"):
        return (module.is_transposed, not getattr(module, "is_concatenated", True), getattr(module, "has_bias", False))
    return module.down_proj.shape[1] * 2 == module.gate_up_proj.shape[2], False, False


def _stacked(module: torch.nn.Module) -> bool:
    """Called with the tokens alone, repeated once per expert and weighted by its routing score (Llama 4)."""
    return list(inspect.signature(module.forward).parameters) == ["hidden_states"]


def _own_gate(module: torch.nn.Module) -> bool:
    """The class defines its gating itself (a method has a qualified name; transformers' default is a function)."""
    return "." in getattr(type(module), "_apply_gate", len).__qualname__


def make_quantizable(model: torch.nn.Module):
    """Replace every fused experts container in `model` (on any device, meta included)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if Experts.replaces(child):
                setattr(module, child_name, Experts(child))


def fused_experts(model: torch.nn.Module) -> list[str]:
    """Experts containers left fused (a layout `Experts` does not take): no Linear-based quantization reaches them."""
    return [name for name, m in model.named_modules()
            if "expert" in type(m).__name__.lower() and any(p.dim() >= 3 for p in m.parameters(recurse=False))]


def default_ignores(model: torch.nn.Module) -> list[str]:
    """The Linear modules of MoE blocks that decide routing rather than compute: beside the experts, with one
    output per expert (a router, such as PhiMoE's Linear `router` or HunYuan's `gate.wg`) or a single output (a
    shared expert's gate, such as Qwen2-MoE's `shared_expert_gate`). vLLM builds them unquantized, and a
    quantized router is one transformers cannot initialize (PhiMoE), so they stay dense, listed in `ignore`."""
    out = []
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, Experts):
            continue
        inside = {id(m) for m in experts.modules()}
        out.extend(local for local, m in block.named_modules(prefix=name) if isinstance(m, torch.nn.Linear)
                   and id(m) not in inside and m.out_features in (1, len(experts)))
    return out


@contextlib.contextmanager
def experts_mode(layer: torch.nn.Module, all_experts: bool):
    """Run every expert on every token (all-experts calibration) inside; routed outside."""
    containers = [m for m in layer.modules() if isinstance(m, Experts)]
    for c in containers:
        c.all_experts = all_experts
    try:
        yield
    finally:
        for c in containers:
            c.all_experts = False
