"""Mixture-of-experts blocks made quantizable and calibratable.

transformers 5 keeps a block's experts fused in 3D parameters; checkpoints keep one Linear per expert and
projection. Only the experts container is replaced, by one holding the experts as Linear modules under the
checkpoint's names and taking the container's call (hidden states, top-k indices, top-k weights); the block's own
forward (router, its normalization, shared experts and their gates) runs unchanged, so shared experts are read,
calibrated and quantized like any other Linear. In all-experts calibration every expert runs on every token, so
every expert gets a full Hessian, while the container's output still sums only the routed tokens with their
routing weights: the output equals the original's (the down projections compute only those rows; their Hessians
still see every token).
"""

import contextlib

import torch


class RowsLinear(torch.nn.Linear):
    """A Linear that can compute only some rows of its output while its hooks see the whole input: in
    all-experts calibration the down projection's Hessian needs every token, the block only the routed."""

    def forward(self, x, rows=None):
        return super().forward(x if rows is None else x[rows])


class Expert(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, act_fn, dtype):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = RowsLinear(intermediate, hidden, bias=False, dtype=dtype)
        self.act_fn = act_fn

    def forward(self, x, rows=None):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x), rows)


class Experts(torch.nn.ModuleList):
    """A fused experts container as one Expert per index, called as the container is."""

    all_experts = False  # set by `experts_mode` during calibration passes with --moe-calibrate all

    def __init__(self, fused: torch.nn.Module):
        num, intermediate2, hidden = fused.gate_up_proj.shape
        super().__init__(Expert(hidden, intermediate2 // 2, fused.act_fn, fused.gate_up_proj.dtype)
                         for _ in range(num))

    @staticmethod
    def replaces(module: torch.nn.Module) -> bool:
        """A fused experts container in transformers' default layout: [gate; up] concatenated along the output,
        weights as (out, in), no biases, the default gating (act(gate) * up: a gating that the class defines
        itself, such as GPT-OSS's clamped one, has a qualified name)."""
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        return (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
                and gate_up.dim() == 3 and down.dim() == 3 and callable(getattr(module, "act_fn", None))
                and getattr(module, "has_gate", True) and not getattr(module, "has_bias", False)
                and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True)
                and "." not in getattr(type(module), "_apply_gate", len).__qualname__
                and tuple(down.shape) == (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
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
