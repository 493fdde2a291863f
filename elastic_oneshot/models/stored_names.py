"""Tensor names as the checkpoint stores them.

transformers 5 renames some checkpoints' tensors as it loads them (Mixtral's `block_sparse_moe` becomes `mlp`) and
fuses their per-expert Linear weights into 3D parameters (`experts.N.w1` and `w3` into `experts.gate_up_proj`), by
the conversion mappings that `from_pretrained` applies. The skeleton holds each expert as Linear modules under
transformers' module names (moe.Experts), so a skeleton tensor is found in the checkpoint by applying those same
mappings to the checkpoint's names: the renamings as they are, the expert converters one expert at a time. The
export writes the stored names back, which the same loader converts again (quantized experts included).
"""

import re

import torch
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    get_model_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.core_model_loading import (
    Concatenate,
    Interleave,
    MergeModulelist,
    Transpose,
    WeightConverter,
    rename_source_key,
)
from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION

from elastic_oneshot.models.moe import Experts

# The fused parameters that moe.Experts splits: the converter's operations that build each from per-expert weights
# (stacked along dim 0, gate and up concatenated along dim 1), and the projection each of its sources becomes.
FUSED = {"gate_up_proj": ([(MergeModulelist, 0), (Concatenate, 1)], ("gate_proj", "up_proj")),
         "down_proj": ([(MergeModulelist, 0)], ("down_proj",))}


def stored_names(skeleton: torch.nn.Module, checkpoint_names) -> dict[str, str]:
    """Skeleton tensor name -> the checkpoint's name for it, for the names that differ."""
    transforms = get_model_conversion_mapping(skeleton)
    per_expert = [pair for t in transforms if isinstance(t, WeightConverter) for pair in _per_expert(t)]
    out = {}
    for stored, name in _renamed(skeleton, checkpoint_names).items():
        for pattern, replacement in per_expert:
            name = pattern.sub(replacement, name)
        if name != stored:
            out[name] = stored
    return out


def _per_expert(converter: WeightConverter) -> list[tuple[re.Pattern, str]]:
    """The converter as renamings of one expert's weights, if it builds a fused parameter that moe.Experts splits
    (in the layout it splits); none otherwise."""
    target = converter._original_target_patterns
    fused = FUSED.get(target[0].rpartition(".")[2]) if len(target) == 1 else None
    ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    if fused is None or ops != fused[0] or len(converter._original_source_patterns) != len(fused[1]):
        return []
    pairs = []
    for source, role in zip(converter._original_source_patterns, fused[1]):
        leaf = re.search(r"experts\.\*\.(\w+)\.weight$", source)
        if leaf is None:
            return []
        pairs.append((re.compile(rf"\.experts\.(\d+)\.{leaf.group(1)}\.weight$"), rf".experts.\1.{role}.weight"))
    return pairs


def _renamed(skeleton: torch.nn.Module, checkpoint_names) -> dict[str, str]:
    """Checkpoint name -> the name transformers' renamings give it."""
    renamings = [t for t in get_model_conversion_mapping(skeleton) if not isinstance(t, WeightConverter)]
    expected = skeleton.state_dict()
    return {stored: rename_source_key(stored, renamings, [], skeleton.base_model_prefix, expected)[0]
            for stored in checkpoint_names}


def fused_in_checkpoint(skeleton: torch.nn.Module, checkpoint_names) -> dict[str, tuple[str, str]]:
    """Checkpoint name -> (experts container, its fused parameter) for the tensors stored fused where the
    skeleton holds one Linear per expert (moe.Experts)."""
    containers = {name: m for name, m in skeleton.named_modules() if isinstance(m, Experts)}
    out = {}
    for stored, name in _renamed(skeleton, checkpoint_names).items():
        container, _, param = name.rpartition(".")
        if container in containers and param in containers[container].fused_parameters():
            out[stored] = (container, param)
    return out


_taught: set[str] = set()


def teach_loader(skeleton: torch.nn.Module):
    """Let transformers load per-expert weights (quantized or not) into the fused experts of `skeleton`'s type,
    where its own conversion mapping has no converter for them: the type's mapping plus one converter per fused
    parameter (stacked, gate and up concatenated or interleaved, transposed, as the container lays them out)."""
    model_type = skeleton.config.model_type
    experts = next((m for m in skeleton.modules() if isinstance(m, Experts)), None)
    if experts is None or model_type in _taught or experts.replaced in MODULES_TO_PATCH_FOR_QUANTIZATION:
        return  # the last: a quantized load builds the container per expert itself (Llama 4's)
    if any(_per_expert(t) for t in get_model_conversion_mapping(skeleton) if isinstance(t, WeightConverter)):
        return
    gate_up = [MergeModulelist(0), Concatenate(1)] + ([Interleave(1, inverse=True)] if experts.interleaved else [])
    transposed = [Transpose(1, 2)] if experts.transposed else []
    converters = [WeightConverter([".experts.*.gate_proj.weight", ".experts.*.up_proj.weight"],
                                  ".experts.gate_up_proj", gate_up + transposed),
                  WeightConverter(".experts.*.down_proj.weight", ".experts.down_proj",
                                  [MergeModulelist(0)] + transposed)]
    if experts.bias:
        converters += [WeightConverter([".experts.*.gate_proj.bias", ".experts.*.up_proj.bias"],
                                       ".experts.gate_up_proj_bias", gate_up),
                       WeightConverter(".experts.*.down_proj.bias", ".experts.down_proj_bias", [MergeModulelist(0)])]
    register_checkpoint_conversion_mapping(
        model_type, (get_checkpoint_conversion_mapping(model_type) or []) + converters, overwrite=True)
    _taught.add(model_type)
