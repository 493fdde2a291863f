"""A layer's quantized weights in compressed-tensors form: packed when solved, unpacked for every later
forward pass (propagation and replay), so both see exactly the committed values."""

import torch
from compressed_tensors.compressors import PackedQuantizationCompressor


def unpack_into(layer: torch.nn.Module, prefix: str, names: list[str], tensors: dict, scheme):
    """Replace the weights of `names` (modules of `layer`, whose checkpoint names start with `prefix`) by
    the decompressed `tensors`."""
    modules = dict(layer.named_modules())
    params = PackedQuantizationCompressor.compression_param_names(scheme)
    for name in names:
        packed = {k.split(".")[-1]: tensors[f"{prefix}{name}.{k}"] for k in params}
        weight = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
        modules[name].weight = torch.nn.Parameter(weight.to(modules[name].weight.dtype), requires_grad=False)


def pack_group(prefix: str, group, result, scheme) -> dict:
    """A solved group (plan.Group; gptq.Result, its modules' rows stacked) as its modules' compressed-tensors
    tensors, by checkpoint name (`prefix`: the layer's)."""
    out, row = {}, 0
    for name, rows in group.modules:
        part = {"weight": result.weight[row:row + rows], "weight_scale": result.scale[row:row + rows],
                "weight_zero_point": result.zero_point[row:row + rows]}
        row += rows
        compressed = PackedQuantizationCompressor.compress(part, scheme)
        out.update({f"{prefix}{name}.{k}": v for k, v in compressed.items()})
    return out
