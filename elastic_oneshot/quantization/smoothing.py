"""SmoothQuant (Xiao et al., 2022) and logarithmic equalization (Wang et al., 2023) with llmcompressor 0.14's
semantics. Pure math: no I/O, no processes.

A mapping pairs a smooth layer (a norm, or a Linear whose output rows can be scaled) with the balance layers that
read its output. Its statistics are the per-channel minimum and maximum of the smooth layer's output over every
calibration token: exact, so their reduction across ranks (MIN and MAX) does not depend on how samples are split.
From them and the balance layers' weights come per-channel scales s; the smooth layer's output is divided by s
(its weight rows, bias) and each balance layer's input columns multiplied by s, which leaves the layer's function
unchanged up to rounding. Each step uses the peer's operations and dtypes, so that its bits equal the peer's.
"""

import dataclasses

import torch
from compressed_tensors.utils import match_modules_set, match_named_modules

from elastic_oneshot.errors import UsageError

MINIMUM_SCALE = 1e-5

@dataclasses.dataclass(frozen=True)
class Mapping:
    """A resolved mapping: full module names."""

    smooth: str
    balance: tuple[str, ...]


def resolve(model: torch.nn.Module, mappings, ignore: tuple[str, ...] = ()) -> list[Mapping]:
    """Each mapping's modules, one set per parent context (a layer; every expert of a mixture together), as the
    peer matches them (compressed-tensors' match_modules_set): a mapping is skipped when it has no balance layer,
    or when its smooth layer and all its balance layers are ignored. `model` may be on the meta device."""
    names = {id(m): n for n, m in model.named_modules()}
    ignored = {n for n, _ in match_named_modules(model, list(ignore))} if ignore else set()
    out = []
    for balance_patterns, smooth_pattern in mappings:
        try:
            sets = list(match_modules_set(model, [*balance_patterns, smooth_pattern]))
        except ValueError as e:
            raise UsageError(f"SmoothQuant mapping {smooth_pattern} cannot be resolved: {e}") from None
        for *balance_sets, smooth in sets:
            if len(smooth) > 1:
                raise UsageError(f"SmoothQuant mapping {smooth_pattern} matches {len(smooth)} smooth layers in one "
                                 f"set ({', '.join(names[id(m)] for m in smooth)}): give a narrower pattern")
            balance = tuple(names[id(m)] for group in balance_sets for m in group)
            smooth_name = names[id(smooth[0])]
            if balance and not (smooth_name in ignored and all(b in ignored for b in balance)):
                out.append(Mapping(smooth_name, balance))
    return out


def observe(ranges: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor:
    """[2, channels]: the running minimum and maximum per channel of a smooth layer's output (a tuple's first),
    in its dtype; `ranges` None at the first call."""
    if isinstance(output, tuple):
        output = output[0]
    flat = output.reshape(-1, output.shape[-1])
    seen = torch.stack([flat.amin(dim=0), flat.amax(dim=0)])
    if ranges is None:
        return seen
    return torch.stack([torch.minimum(ranges[0], seen[0]), torch.maximum(ranges[1], seen[1])])


def scales(ranges: torch.Tensor, balance_weights: list[torch.Tensor], strength: float = 0.5,
           algorithm: str = "smoothquant") -> torch.Tensor:
    """The smoothing scales of one mapping from its smooth layer's output ranges over all ranks ([2, channels]) and
    its balance layers' weights: SmoothQuant's range^a / (2 max|W|)^(1 - a) (the range where no weight is
    nonzero), or logarithmic equalization's range / log2(2 + range); at least MINIMUM_SCALE."""
    spread = ranges[1] - ranges[0]
    if algorithm == "log_equalization":
        s = spread / torch.log2(2 + spread)
    else:
        per_layer = torch.cat([w.abs().amax(dim=0, keepdim=True) for w in balance_weights])
        weight_spread = 2.0 * per_layer.amax(dim=0)
        s = spread.pow(strength) / weight_spread.pow(1 - strength)
        s = torch.where(weight_spread > 0.0, s, spread)
    # the floor is an fp32 tensor, as the peer's, so that scales of a half-precision model come out in fp32
    return torch.maximum(s, torch.tensor([MINIMUM_SCALE], dtype=torch.float32, device=s.device))


def fold(scales: torch.Tensor, smooth_weight: torch.Tensor, balance_weights: list[torch.Tensor],
         smooth_bias: torch.Tensor | None = None, offset: bool = False
         ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """The smooth layer's weight (and bias) divided by the scales, the balance layers' input columns multiplied by
    them, each computed in the scales' and weight's common dtype and stored in the weight's. A Linear smooth layer
    with more output rows than scales (a fused qkv_proj before o_proj) has its last rows divided. `offset`: a norm
    that multiplies by 1 + weight (Gemma's), folded in the plain convention as the peer does."""
    balance = [(w * scales.view(1, -1)).to(w.dtype) for w in balance_weights]
    dtype = smooth_weight.dtype
    if offset:
        plain = (1.0 + smooth_weight.float()).to(dtype)
        smooth = ((plain / scales).to(dtype).float() - 1.0).to(dtype)
    elif smooth_weight.dim() == 1:
        smooth = (smooth_weight / scales).to(dtype)
    else:
        smooth = smooth_weight.clone()
        smooth[-scales.shape[0]:] = smooth_weight[-scales.shape[0]:] / scales.view(-1, 1)
    bias = None if smooth_bias is None else (smooth_bias / scales).to(smooth_bias.dtype)
    return smooth, balance, bias
