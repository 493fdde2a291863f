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
