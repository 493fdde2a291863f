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
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, rename_source_key

# The fused parameters that moe.Experts splits: the converter's operations that build each from per-expert weights
# (stacked along dim 0, gate and up concatenated along dim 1), and the projection each of its sources becomes.
FUSED = {"gate_up_proj": ([(MergeModulelist, 0), (Concatenate, 1)], ("gate_proj", "up_proj")),
         "down_proj": ([(MergeModulelist, 0)], ("down_proj",))}


def stored_names(skeleton: torch.nn.Module, checkpoint_names) -> dict[str, str]:
    """Skeleton tensor name -> the checkpoint's name for it, for the names that differ."""
    transforms = get_model_conversion_mapping(skeleton)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    per_expert = [pair for t in transforms if isinstance(t, WeightConverter) for pair in _per_expert(t)]
    expected = skeleton.state_dict()
    out = {}
    for stored in checkpoint_names:
        name = rename_source_key(stored, renamings, [], skeleton.base_model_prefix, expected)[0]
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
