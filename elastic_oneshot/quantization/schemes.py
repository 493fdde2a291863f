"""What a compressed-tensors QuantizationScheme means here, in one place, so that gptq, packing, the recipe and
evaluation switch on strategies and formats nowhere else: the presets (compressed-tensors' own registry), what is
refused, the observers the peer sets, each weight strategy's geometry (which columns share a qparam, which rows a
scale covers, whether a global scale is shared), static input qparams, the format and compressor a module is
written with, and the dtype a checkpoint loads in."""

from copy import copy

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    DynamicType,
    QuantizationArgs,
    QuantizationScheme,
    QuantizationStrategy,
)
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    generate_gparam,
    maybe_pad_tensor_for_block_quant,
)

from elastic_oneshot.errors import UsageError

# compressed-tensors' presets (W4A16_ASYM is W4A16 with --asym).
PRESETS = tuple(name for name in PRESET_SCHEMES if name not in ("UNQUANTIZED", "W4A16_ASYM"))
WEIGHT_OBSERVERS = {None, "minmax", "memoryless_minmax", "static_minmax"}  # identical on weights observed once
WEIGHT_STRATEGIES = {"tensor", "channel", "group", "tensor_group", "block"}
GROUPED = (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP)
# The FP4 formats, unpacked here in fp32 (their compressors decompress through bfloat16), with how each one's
# stored scale becomes a float scale.
FP4_SCALES = {"nvfp4-pack-quantized": lambda scale: scale, "mxfp4-pack-quantized": decompress_mx_scale}


# -- weights: the int presets' options, and each strategy's geometry -------------------------------------------------
def int_weights(weights: QuantizationArgs, group: int, symmetric: bool, actorder) -> QuantizationArgs:
    """An int preset's weights with our options: per channel for `group` -1, else groups of `group` columns."""
    return QuantizationArgs(
        num_bits=weights.num_bits, type=weights.type, symmetric=symmetric,
        strategy="channel" if group == -1 else "group", group_size=None if group == -1 else group,
        actorder=actorder, observer="memoryless_minmax", dynamic=False)


def group_option(weights: QuantizationArgs) -> int | None:
    """The --group-size of int weights: -1 per channel, else their group size."""
    return -1 if weights.strategy == QuantizationStrategy.CHANNEL else weights.group_size


def group_size(args: QuantizationArgs) -> int | None:
    """Columns per qparam of the group and tensor-group strategies (which an input dimension must divide)."""
    return args.group_size if args.strategy in GROUPED else None


def column_width(args: QuantizationArgs, cols: int) -> int:
    """Input columns that share one column of qparams: a group, a block's width, or all of them."""
    if args.strategy == QuantizationStrategy.BLOCK:
        return args.block_structure[1]
    return group_size(args) or cols


def has_global_scale(args: QuantizationArgs) -> bool:
    """Tensor group (NVFP4): a global scale, shared by the siblings that vLLM fuses."""
    return args.strategy == QuantizationStrategy.TENSOR_GROUP


def observed(weight: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """The weight as the peer's observer flattens it: one qparam per row of the result (blocks zero-padded)."""
    if args.strategy == QuantizationStrategy.TENSOR:
        return weight.reshape(1, -1)
    if args.strategy in GROUPED:
        return weight.unflatten(-1, (-1, args.group_size))
    if args.strategy == QuantizationStrategy.BLOCK:
        height, width = args.block_structure
        padded = maybe_pad_tensor_for_block_quant(weight, tuple(args.block_structure))
        rows, cols = padded.shape
        return padded.reshape(rows // height, height, cols // width, width).transpose(1, 2).flatten(-2)
    return weight.unsqueeze(-2)


def per_row(qparam: torch.Tensor, args: QuantizationArgs, rows: int) -> torch.Tensor:
    """A scale or zero point as one row per output row: a tensor's repeated, a block row's for each of its rows."""
    if args.strategy == QuantizationStrategy.TENSOR:
        return qparam.reshape(1, 1).expand(rows, 1)
    if args.strategy == QuantizationStrategy.BLOCK:
        return qparam[torch.arange(rows, device=qparam.device) // args.block_structure[0]]
    return qparam


def per_column(args: QuantizationArgs) -> QuantizationArgs:
    """The arguments that quantize one column with per-row scales (GPTQ's column loop)."""
    column = copy(args)
    column.strategy = QuantizationStrategy.CHANNEL
    return column


# -- observers and what is refused ---------------------------------------------------------------------------------
def with_observers(scheme: QuantizationScheme, weights: str | None = None, inputs: str | None = None
                   ) -> QuantizationScheme:
    """Observers as the peer sets them (QuantizationMixin._apply_observer_overrides): the override given, else the
    one the scheme names, else memoryless_minmax for weights and minmax for static inputs."""
    for args, override, default in ((scheme.weights, weights, "memoryless_minmax"),
                                    (scheme.input_activations, inputs, "minmax")):
        if args is not None and (override is not None or "observer" not in args.model_fields_set):
            args.observer = override or (None if args.dynamic is True else default)
    return scheme


def check_scheme(name: str, scheme: QuantizationScheme):
    """Refuse, by name, what this tool does not do as the peer does."""
    w = scheme.weights
    if w is None:
        raise UsageError(f"config group {name} quantizes no weights (weights: is missing)")
    if scheme.output_activations is not None:
        raise UsageError(f"config group {name}: output_activations are not supported")
    if w.type == "int" and not 2 <= w.num_bits <= 8 or w.type == "float" and w.num_bits not in (4, 8):
        raise UsageError(f"config group {name}: {w.num_bits}-bit {w.type} weights are not supported "
                         "(int 2 to 8 bits, float 8 or 4)")
    if w.strategy not in WEIGHT_STRATEGIES or w.dynamic:
        raise UsageError(f"config group {name}: weights strategy {w.strategy!r}{' dynamic' if w.dynamic else ''} "
                         f"is not supported: use {', '.join(sorted(WEIGHT_STRATEGIES))}")
    if w.type == "float" and not w.symmetric:
        raise UsageError(f"config group {name}: asymmetric float weights are not supported")
    if w.observer not in WEIGHT_OBSERVERS:
        raise UsageError(f"config group {name}: weight observer {w.observer!r} is not supported: memoryless_minmax")
    a = static_inputs(scheme)
    if a is not None:
        kind = {False: QuantizationStrategy.TENSOR, DynamicType.LOCAL: QuantizationStrategy.TENSOR_GROUP}
        if a.strategy != kind.get(a.dynamic) or a.observer != "static_minmax":
            raise UsageError(f"config group {name}: static input activations by {a.strategy} with observer "
                             f"{a.observer!r} are not supported: static ones by tensor (FP8), or tensor_group "
                             "local (NVFP4), observed by static_minmax")
    if scheme.format is not None and module_format(scheme) != infer_module_format(torch.nn.Linear, scheme).value:
        raise UsageError(f"config group {name}: format {module_format(scheme)!r} is not supported: leave it out "
                         f"({infer_module_format(torch.nn.Linear, scheme).value} for this scheme)")


# -- static input activations --------------------------------------------------------------------------------------
def static_inputs(scheme: QuantizationScheme) -> QuantizationArgs | None:
    """The input activations' arguments when calibration observes them (not fully dynamic); else None."""
    args = scheme.input_activations
    return args if args is not None and args.dynamic is not True else None


def input_qparams(scheme: QuantizationScheme, observed_range: torch.Tensor | None, dtype: torch.dtype) -> dict:
    """A module's static input activation tensors from its input's range over all ranks ([min, max]), as the peer's
    update_qparams stores them: scale (and zero point) by tensor, only the global scale for tensor group's locally
    dynamic ones (NVFP4); none for dynamic ones."""
    args = static_inputs(scheme)
    if args is None:
        return {}
    lo, hi = observed_range[:1], observed_range[1:]
    if args.dynamic == DynamicType.LOCAL:
        absmax = torch.maximum(hi, -lo)
        return {"input_global_scale": generate_gparam(-absmax, absmax)}
    scale, zero_point = calculate_qparams(lo, hi, args)
    return {"input_scale": scale.to(dtype), "input_zero_point": zero_point.to(args.zp_dtype)}


# -- formats: how a module is written, and how a checkpoint loads --------------------------------------------------
def module_format(scheme: QuantizationScheme) -> str:
    """The compressed-tensors format a Linear of `scheme` is written in: its own, else the one compressed-tensors
    infers (int-quantized, float-quantized, pack-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized, ...)."""
    return CompressionFormat(scheme.format or infer_module_format(torch.nn.Linear, scheme)).value


def compressor(scheme: QuantizationScheme):
    """The compressor of the module's format."""
    return BaseCompressor.get_value_from_registry(module_format(scheme))


def load_dtype(quantization_config: dict | None) -> torch.dtype | None:
    """The dtype to load a checkpoint in: bfloat16 where a config group has fp4 weights (compressed-tensors
    decompresses them to bfloat16, which a float32 model cannot multiply); else None, the checkpoint's own."""
    groups = (quantization_config or {}).get("config_groups") or {}
    fp4 = any((g.get("weights") or {}).get("type") == "float" and g["weights"].get("num_bits") == 4
              for g in groups.values())
    return torch.bfloat16 if fp4 else None
