"""Tensor names as the checkpoint stores them.

transformers 5 renames some checkpoints' tensors as it loads them (Mixtral's `block_sparse_moe` becomes `mlp`) and
fuses their per-expert Linear weights into 3D parameters (`experts.N.w1` and `w3` into `experts.gate_up_proj`), or
concatenates several stored tensors into one (Kimi Linear's and OLMo hybrid's `q_conv1d`, `k_conv1d`, `v_conv1d` into
`conv1d`), by the conversion mappings that `from_pretrained` applies. The skeleton holds each expert as Linear modules
under transformers' module names (moe.Experts), so a skeleton tensor is found in the checkpoint by applying those same
mappings to the checkpoint's names: the renamings as they are, the expert converters one expert at a time, and a
concatenation by reading its parts. The export writes the stored names back, which the same loader converts again
(quantized experts included).
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

from elastic_oneshot.models.moe import FUSED, Experts

# The operations of a converter that builds a fused parameter from per-expert weights (moe.FUSED): the experts
# stacked along dim 0, gate and up concatenated along dim 1.
STACKED = [(MergeModulelist, 0), (Concatenate, 1)]


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
    target, sources, ops = converter.target_patterns, converter.source_patterns, converter.operations
    projections = FUSED.get(target[0].rpartition(".")[2]) if len(target) == 1 else None
    if projections is None or len(sources) != len(projections) or len(ops) != len(projections) or \
            any(type(op) is not kind or op.dim != dim for op, (kind, dim) in zip(ops, STACKED)):
        return []
    pairs = []
    for source, role in zip(sources, projections):
        leaf = re.search(r"experts\.\*\.(\w+)\.weight$", source)
        if leaf is None:
            return []
        pairs.append((re.compile(rf"\.experts\.(\d+)\.{leaf.group(1)}\.weight$"), rf".experts.\1.{role}.weight"))
    return pairs


def _renamed(skeleton: torch.nn.Module, checkpoint_names) -> dict[str, str]:
    """Checkpoint name -> the name transformers' renamings give it."""
    renamings = [t for t in get_model_conversion_mapping(skeleton) if not isinstance(t, WeightConverter)]
    expected = skeleton.state_dict()
    return {stored: loaded_name(stored, renamings, [], skeleton.base_model_prefix, expected)[0]
            for stored in checkpoint_names}


def loaded_name(key: str, renamings: list, converters: list, prefix: str, expected) -> tuple[str, str | None]:
    """The name transformers' loader gives checkpoint tensor `key` (and the converter pattern it matched) for a
    model whose tensors are `expected`: its conversions' renaming, unless that names no tensor of the model while
    `key` itself is one, which the loader then keeps (DeepSeek-V4's renaming of `.norm.` to `.kv_norm.`, meant for
    its attention's norms, would otherwise take the final `model.norm` too)."""
    renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
    if renamed not in expected and key in expected:
        return rename_source_key(key, [], [], prefix, expected)
    return renamed, pattern


def assembled(skeleton: torch.nn.Module, checkpoint_names) -> dict[str, tuple[list[str], int]]:
    """Skeleton tensor name -> (the checkpoint tensors that transformers concatenates into it, in order; the
    dimension), for converters that do only that (Kimi Linear's and OLMo hybrid's short convolutions)."""
    transforms = get_model_conversion_mapping(skeleton)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    concatenations = [t for t in transforms if isinstance(t, WeightConverter) and len(t.target_patterns) == 1
                      and len(t.source_patterns) > 1 and [type(op) for op in t.operations] == [Concatenate]]
    expected = skeleton.state_dict()
    parts: dict[str, dict[str, str]] = {}
    for stored in checkpoint_names:
        name, pattern = loaded_name(stored, renamings, concatenations, skeleton.base_model_prefix, expected)
        if pattern is not None and name in expected:
            parts.setdefault(name, {})[pattern] = stored
    out = {}
    for name, found in parts.items():
        converter = next(c for c in concatenations if set(found) <= set(c.source_patterns))
        if len(found) == len(converter.source_patterns):  # else the tensor is missing, as check_weights says
            out[name] = ([found[p] for p in converter.source_patterns], converter.operations[0].dim)
    return out


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


def taught(model_type: str) -> bool:
    """Whether `teach_loader` taught transformers to load this type's per-expert weights: a new process loads a
    checkpoint of it only after elastic_oneshot.teach_transformers."""
    return model_type in _taught


def teach_loader(skeleton: torch.nn.Module, experts: Experts):
    """Let transformers load per-expert weights (quantized or not) into the fused experts of `skeleton`'s type,
    where its own conversion mapping has no converter for them: the type's mapping plus one converter per fused
    parameter (stacked, gate and up concatenated or interleaved, transposed, as `experts` lays them out). The one
    change made to transformers' registry of conversions, once per type."""
    model_type, layout = skeleton.config.model_type, experts.layout
    if model_type in _taught or any(_per_expert(t) for t in get_model_conversion_mapping(skeleton)
                                    if isinstance(t, WeightConverter)):
        return
    gate_up = [MergeModulelist(0), Concatenate(1)] + ([Interleave(1, inverse=True)] if layout.interleaved else [])
    transposed = [Transpose(1, 2)] if layout.transposed else []
    converters = [WeightConverter([".experts.*.gate_proj.weight", ".experts.*.up_proj.weight"],
                                  ".experts.gate_up_proj", gate_up + transposed),
                  WeightConverter(".experts.*.down_proj.weight", ".experts.down_proj",
                                  [MergeModulelist(0)] + transposed)]
    if layout.bias:
        converters += [WeightConverter([".experts.*.gate_proj.bias", ".experts.*.up_proj.bias"],
                                       ".experts.gate_up_proj_bias", gate_up),
                       WeightConverter(".experts.*.down_proj.bias", ".experts.down_proj_bias", [MergeModulelist(0)])]
    register_checkpoint_conversion_mapping(
        model_type, (get_checkpoint_conversion_mapping(model_type) or []) + converters, overwrite=True)
    _taught.add(model_type)
