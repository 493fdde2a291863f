"""What rides with the hidden states from one decoder layer to the next.

The layer loop moves one tensor per sample from layer to layer: held in memory, written to boundaries, replayed. Some
decoders hand their layers per-sample values besides the hidden states: Gemma 4's per-layer inputs (computed from
the tokens), DeepSeek-V4's token ids (its hash-routed layers pick experts by them), and values a layer computes for
later ones (Gemma 4's shared keys and values, GLM-DSA's top-k indices). A family (models/family.py) that has such
values packs them into that one tensor after the hidden states' last dimension, each viewed bit for bit as the hidden
states' dtype (integers too, exactly), and hooks each loaded layer to unpack what it takes into its arguments and to
pack what later layers need after its output. The layout entering each layer follows from its index and the config.
"""

import math
from collections.abc import Callable

import torch

Layout = list[tuple[torch.dtype, tuple[int, ...] | None]]  # each rider's dtype and shape after (batch, seq); None: rest


def pack(hidden: torch.Tensor, riders: list[torch.Tensor]) -> torch.Tensor:
    """[batch, seq, width] in `hidden`'s dtype: `hidden` ([batch, seq, ...]) flattened, then each rider's bits."""
    batch, seq = hidden.shape[:2]
    parts = [hidden.reshape(batch, seq, -1)]
    parts += [r.contiguous().reshape(batch, seq, -1).view(hidden.dtype) for r in riders]
    return torch.cat(parts, -1) if len(parts) > 1 else hidden


def unpack(x: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The tensors `pack` put in `x`, by `layout` (the hidden states first); one shape of None takes what the others
    leave, flat."""
    batch, seq = x.shape[:2]
    widths = [None if tail is None else math.prod(tail) * dtype.itemsize // x.dtype.itemsize for dtype, tail in layout]
    rest = x.shape[-1] - sum(w for w in widths if w is not None)
    if rest < 0 or (rest and None not in widths):
        raise RuntimeError(f"a layer's input is {x.shape[-1]} wide, which does not fit what rides with it")
    out, at = [], 0
    for (dtype, tail), width in zip(layout, widths):
        width = rest if width is None else width
        out.append(x[..., at:at + width].contiguous().view(dtype).reshape(batch, seq, *(tail or (-1,))))
        at += width
    return out


def ride(layer: torch.nn.Module, take: Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict, object]],
         give: Callable[[object, dict, object], object]):
    """Hooks on `layer`: `take(stream, kwargs)` gives its hidden states, the arguments to add, and what to keep for
    `give(output, kwargs, kept)`, which gives the output the layer loop carries on (the call's arguments, as the layer
    saw them, may have been filled in by the layer: Gemma 4's shared keys and values)."""
    kept = {}

    def before(module, args, kwargs):
        hidden, added, kept["value"] = take(args[0], kwargs)
        return (hidden, *args[1:]), {**kwargs, **added}

    def after(module, args, kwargs, output):
        return give(output, kwargs, kept.pop("value"))

    layer.register_forward_pre_hook(before, with_kwargs=True)
    layer.register_forward_hook(after, with_kwargs=True)
