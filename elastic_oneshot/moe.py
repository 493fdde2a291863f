"""Mixture-of-experts blocks made quantizable and calibratable.

transformers 5 keeps a block's experts fused in 3D parameters; checkpoints keep one Linear per
expert and projection. The block here holds the experts as Linear modules under the checkpoint's
names, so each is read, calibrated and quantized like any other Linear. In all-experts calibration
every expert runs on every token, so every expert gets a full Hessian, while the block's output
still sums only the routed tokens with their routing weights: the output equals the original's (the
down projections compute only those rows; their Hessians still see every token).
"""

import contextlib

import torch
from transformers.activations import ACT2FN


class RowsLinear(torch.nn.Linear):
    """A Linear that can compute only some rows of its output while its hooks see the whole input: in
    all-experts calibration the down projection's Hessian needs every token, the block only the routed."""

    def forward(self, x, rows=None):
        return super().forward(x if rows is None else x[rows])


class Expert(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, dtype):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = RowsLinear(intermediate, hidden, bias=False, dtype=dtype)
        self.act_fn = ACT2FN[act]

    def forward(self, x, rows=None):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x), rows)


class MoEBlock(torch.nn.Module):
    """Router (unchanged; it stays unquantized) plus experts as Linear modules."""

    all_experts = False  # set by `experts_mode` during calibration passes with --moe-calibrate all

    def __init__(self, block: torch.nn.Module, act: str):
        super().__init__()
        fused = block.experts
        num, intermediate2, hidden = fused.gate_up_proj.shape
        self.gate = block.gate
        self.experts = torch.nn.ModuleList(Expert(hidden, intermediate2 // 2, act, fused.gate_up_proj.dtype)
                                           for _ in range(num))

    @staticmethod
    def replaces(module: torch.nn.Module) -> bool:
        """A sparse MoE block whose experts transformers keeps fused."""
        experts = getattr(module, "experts", None)
        return (getattr(module, "gate", None) is not None and experts is not None
                and getattr(experts, "gate_up_proj", None) is not None and experts.gate_up_proj.dim() == 3)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, selected = self.gate(x)
        out = torch.zeros_like(x)
        hit = torch.nn.functional.one_hot(selected, len(self.experts)).permute(2, 1, 0)
        for index, expert in enumerate(self.experts):
            top_k_pos, tokens = torch.where(hit[index])
            if self.all_experts:
                y = expert(x, rows=tokens)
            elif tokens.numel():
                y = expert(x[tokens])
            else:
                continue
            out.index_add_(0, tokens, (y * weights[tokens, top_k_pos, None]).to(out.dtype))
        return out.reshape(shape)


def make_quantizable(model: torch.nn.Module, config):
    """Replace every fused sparse MoE block in `model` (on any device, meta included)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if MoEBlock.replaces(child):
                setattr(module, child_name, MoEBlock(child, config.hidden_act))


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
