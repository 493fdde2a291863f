"""A layer's quantized weights in compressed-tensors form, written by the compressor of each module's format
(schemes.compressor): packed when solved, with the module's static activation qparams, and unpacked for every
later forward pass (propagation and replay), so both see exactly the committed values."""

import functools
import types

import torch
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStrategy
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.quant_args import round_to_quantized_type_args
from compressed_tensors.quantization.utils import calculate_range

from elastic_oneshot.quantization.gptq import QParams, module_qparams
from elastic_oneshot.quantization.schemes import FP4_SCALES, compressor, group_size, input_qparams, module_format


def compress_module(weight: torch.Tensor, q: QParams, inputs: dict, scheme: QuantizationScheme) -> dict:
    """One module's tensors by local name (weight_packed or weight, weight_scale, ...), from its solved weight,
    its qparams and its static input activations' (`inputs`: input_scale, input_global_scale), with the dtypes
    the peer's modules hold (scales in the weight's dtype, global scales in fp32)."""
    state = {"weight": weight, "weight_scale": q.scale.to(weight.dtype),
             "weight_zero_point": q.zero_point.to(scheme.weights.zp_dtype), **inputs}
    if q.global_scale is not None:
        state["weight_global_scale"] = q.global_scale.to(torch.float32)
    return _compress(compressor(scheme), state, scheme)


ROWS_ELEMENTS = 2**20  # a slice of rows whose temporaries stay in cache


def _compress(comp, state: dict, scheme: QuantizationScheme) -> dict:
    """`comp.compress(state, scheme)`; on the host, a naive compressor's (int-quantized, float-quantized: each code
    from its own element and per-row or whole-tensor qparams, which it passes through) by `_codes` instead, in
    slices of rows: the same tensors, without its full-size temporaries and its cast of FP8 codes to the weight's
    dtype and back, which cost more than the rest."""
    weight, args = state["weight"], scheme.weights
    if weight.device.type != "cpu" or weight.shape[0] < 2 or not issubclass(comp, NaiveQuantizationCompressor) or \
            args.strategy not in (QuantizationStrategy.TENSOR, QuantizationStrategy.CHANNEL):
        return comp.compress(state, scheme)
    rows = weight.shape[0]
    per_row = {k for k, v in state.items() if v.ndim == weight.ndim and v.shape[0] == rows}
    out = comp.compress({k: v[:1] if k in per_row else v for k, v in state.items()}, scheme)  # names, the rest
    out.update({k: state[k] for k in per_row & out.keys()})
    out["weight"] = _codes(weight, state["weight_scale"], state.get("weight_zero_point"), args, per_row)
    return out


def _codes(weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs,
           per_row: set[str]) -> torch.Tensor:
    """compressed-tensors' quantize of `weight` (tensor or channel strategy) as a naive compressor calls it, slice
    by slice of rows (`per_row`: which of weight_scale and weight_zero_point have a row per weight row), with its
    FP8 codes cast straight to the code dtype rather than through the weight's dtype and back: every FP8 value is
    one of any wider float's, and the codes that the round trip changes (bfloat16's: the sign of NaN) are changed
    as it would."""
    low, high = (float(bound) for bound in calculate_range(args, weight.device))  # (exact; clamps faster)
    out = torch.empty(weight.shape, dtype=args.pytorch_dtype())
    changed = _round_trip_changes(out.dtype, weight.dtype)
    step = max(1, ROWS_ELEMENTS // weight[0].numel())
    for start in range(0, weight.shape[0], step):
        rows = slice(start, start + step)
        scaled = weight[rows] / (scale[rows] if "weight_scale" in per_row else scale)
        if zero_point is not None:
            scaled += (zero_point[rows] if "weight_zero_point" in per_row else zero_point).to(weight.dtype)
        out[rows] = round_to_quantized_type_args(scaled, args, low, high, cast_to_original_dtype=False)
        if changed:
            bits = out[rows].view(torch.uint8)
            top = int(bits.max())  # (a fast pass: most slices hold none of the codes to change)
            for code, back in changed:
                if code <= top:
                    bits.masked_fill_(bits == code, back)
    return out


@functools.cache
def _round_trip_changes(code: torch.dtype, dtype: torch.dtype) -> tuple[tuple[int, int], ...]:
    """The one-byte codes of `code` that a cast to `dtype` and back does not return as themselves, with what it
    returns (none for an integer code, whose rounding happens in `dtype`)."""
    if not code.is_floating_point or torch.finfo(code).bits != 8:
        return ()
    codes = torch.arange(256, dtype=torch.uint8)
    back = codes.view(code).to(dtype).to(code).view(torch.uint8)
    return tuple((int(a), int(b)) for a, b in zip(codes, back) if a != b)


def written_names(scheme: QuantizationScheme) -> tuple[str, ...]:
    """The local names of the tensors a module of `scheme` is written as (weight_packed, weight_scale, ...): those
    `compress_module` gives for a small weight (names do not depend on values), so that the export's names can be
    checked before any work."""
    return _written_names(scheme.model_dump_json())


@functools.cache
def _written_names(scheme_json: str) -> tuple[str, ...]:
    scheme = QuantizationScheme.model_validate_json(scheme_json)
    cols = max(128, group_size(scheme.weights) or 0)
    weight = torch.linspace(-1, 1, 128 * cols).reshape(128, cols)
    q = module_qparams({"m": types.SimpleNamespace(weight=weight)}, {"m": scheme.weights}, ())["m"]
    inputs = input_qparams(scheme, torch.tensor([-1.0, 1.0]), weight.dtype)
    return tuple(sorted(compress_module(weight, q, inputs, scheme)))


def decompress_module(tensors: dict, scheme: QuantizationScheme, dtype: torch.dtype) -> torch.Tensor:
    """The weight that a module's compressed tensors (by local name) stand for, exactly as solved. The FP4
    compressors decompress through bfloat16; here their codes and scales are dequantized in fp32 instead."""
    fp4_scale = FP4_SCALES.get(module_format(scheme))
    if fp4_scale is None:
        return compressor(scheme).decompress(tensors, scheme)["weight"].to(dtype)
    packed, scale = tensors["weight_packed"], fp4_scale(tensors["weight_scale"])
    codes = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
    return dequantize(codes, scale.to(torch.float32), args=scheme.weights, dtype=torch.float32,
                      global_scale=tensors.get("weight_global_scale")).to(dtype)


def pack_group(prefix: str, group, weight: torch.Tensor, qparams: dict[str, QParams], inputs: dict,
               schemes: dict[str, QuantizationScheme]) -> dict:
    """A solved group (plan.Group; its modules' rows stacked in `weight`) as its modules' compressed-tensors
    tensors, by checkpoint name (`prefix`: the layer's). `qparams`, `schemes` by module; `inputs`: the group's
    static input activation tensors."""
    out, row = {}, 0
    for name, rows in group.modules:
        own = {k: v.clone() for k, v in inputs.items()}  # a tensor of each module's own: the files share none
        compressed = compress_module(weight[row:row + rows], qparams[name], own, schemes[name])
        row += rows
        out.update({f"{prefix}{name}.{k}": v for k, v in compressed.items()})
    return out


def unpacked(tensors: dict, name: str, scheme: QuantizationScheme, dtype: torch.dtype) -> torch.Tensor:
    """The weight of module `name` (by checkpoint name) that the compressed `tensors` stand for, in `dtype`."""
    params = compressor(scheme).compression_param_names(scheme)
    return decompress_module({k: tensors[f"{name}.{k}"] for k in params if f"{name}.{k}" in tensors}, scheme, dtype)


def unpack_into(layer: torch.nn.Module, prefix: str, names: list[str], tensors: dict, schemes: dict):
    """Replace the weights of `names` (modules of `layer`, whose checkpoint names start with `prefix`) by
    the decompressed `tensors`; `schemes`: by full module name (prefix + name)."""
    modules = dict(layer.named_modules())
    for name in names:
        weight = unpacked(tensors, prefix + name, schemes[prefix + name], modules[name].weight.dtype)
        modules[name].weight = torch.nn.Parameter(weight, requires_grad=False)


class LayerPacking:
    """A layer's quantized modules (`names`, in `modules`: the layer's; checkpoint names start with `prefix`):
    their schemes (`schemes`: by full name), weights, and qparams from the original weights (before any is
    replaced); and the packing of their solved groups with the static input activations' qparams (`ranges`: the
    groups' input ranges over all ranks, calibration.Calibration's); `fused_scales`: the family's siblings that
    share a global scale."""

    def __init__(self, schemes: dict, prefix: str, modules: dict, names: list[str], ranges: dict,
                 fused_scales: tuple[tuple[str, ...], ...]):
        self.prefix, self.ranges = prefix, ranges
        self.schemes = {n: schemes[prefix + n] for n in names}
        self.args = {n: s.weights for n, s in self.schemes.items()}
        self.weights = {n: modules[n].weight for n in names}
        self.qparams = module_qparams(modules, self.args, fused_scales)

    def pack(self, group, weight: torch.Tensor) -> dict:
        inputs = input_qparams(self.schemes[group.name], self.ranges.get(group.name), weight.dtype)
        return pack_group(self.prefix, group, weight, self.qparams, inputs, self.schemes)
