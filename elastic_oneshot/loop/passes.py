"""A recipe as passes over the layers, as llmcompressor's independent pipeline runs it: each modifier (a stage,
then the quantizer) over every layer before the next begins, each seeing the layers as the modifiers before it left
them. Each pass is a run of the layer loop with its own state: the last one's is the job's state itself (a plain
GPTQ job is one pass, as it always was), the others' are folders of it (layout.stage).

What a pass commits for a layer, in units of sub-layer progress (its "groups"): SmoothQuant and AWQ each mapping's
scales (folding them is deterministic, so every later reader folds them again); SparseGPT each input group's pruned
weights; GPTQ and QuantizationModifier each input group's compressed tensors, as a GPTQ job always did. The last pass
also commits, as one more unit, every dense tensor that the passes changed and that it does not quantize (folded
norms and biases, pruned Linears left dense), so that the export reads the last pass only.

Here: each pass's modules, resolved on the skeleton once, before any work (pure: no I/O, no processes).
"""

import dataclasses

import torch
from compressed_tensors.utils import match_named_modules, match_targets

from elastic_oneshot.durability import layout
from elastic_oneshot.errors import UsageError
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.quantization import awq, smoothing
from elastic_oneshot.quantization.recipe import AWQ, GPTQ, RTN, Recipe, SmoothQuant, SparseGPT

SCALES = "smoothing_scales"  # the leaf of a mapping's committed scales, under its smooth layer's name
DENSE = "+dense"  # the last pass's unit of the dense tensors the passes changed (never a module's name)
KINDS = {SmoothQuant: "smoothing", AWQ: "awq", SparseGPT: "sparsegpt"}


@dataclasses.dataclass(frozen=True)
class Unit:
    """A unit of a layer's sub-layer progress that is not an input group (plan.Group): a mapping, or DENSE."""

    name: str


@dataclasses.dataclass
class Pass:
    """Pass `index` of a recipe: `stage` (recipe.SmoothQuant, AWQ, SparseGPT) or, for the quantizer, None with
    `modifier` GPTQ or RTN. Per layer, by names local to it: `mappings` (SmoothQuant's smoothing.Mapping, AWQ's
    awq.Mapping), `targets` (SparseGPT's Linears), `touched` (the dense tensors it changes)."""

    index: int
    modifier: str
    stage: SmoothQuant | AWQ | SparseGPT | None
    last: bool
    mappings: list[list] = dataclasses.field(default_factory=list)
    targets: list[list[str]] = dataclasses.field(default_factory=list)
    touched: list[list[str]] = dataclasses.field(default_factory=list)

    @property
    def kind(self) -> str:
        """smoothing, awq, sparsegpt, gptq or rtn."""
        return KINDS[type(self.stage)] if self.stage is not None else {GPTQ: "gptq", RTN: "rtn"}[self.modifier]

    @property
    def folder(self) -> str | None:
        """Its state's folder in the job's state; None for the last pass, whose state is the job's."""
        return None if self.last else layout.stage(self.index, self.modifier)

    @property
    def quantizes(self) -> bool:
        return self.stage is None


def plan(recipe: Recipe, source: SourceModel, schemes: dict) -> list["Pass"]:
    """The recipe's passes, each with its modules resolved on the skeleton (UsageError, before any work, for a
    mapping that does not resolve or modules outside the decoder layers). `schemes`: the quantizer's, by module."""
    stages = list(recipe.stages)
    out = []
    for index, stage in enumerate(stages):
        p = Pass(index, stage.modifier, stage, last=index == len(stages) - 1 and recipe.quantizer is None)
        _resolve(p, source, schemes)
        out.append(p)
    if recipe.quantizer is not None:
        out.append(Pass(len(stages), recipe.quantizer, None, last=True,
                        touched=[[] for _ in range(source.num_layers)]))
    return out


def _resolve(p: Pass, source: SourceModel, schemes: dict):
    model, stage = source.skeleton, p.stage
    if isinstance(stage, SmoothQuant):
        found = smoothing.resolve(model, stage.mappings, stage.ignore)
    elif isinstance(stage, AWQ):
        found = awq.resolve(model, stage.mappings, schemes, stage.duo_scaling)
    else:
        found = sparse_targets(model, stage)
    local = _by_layer(source, found, p.modifier)
    modules = dict(model.named_modules())
    if isinstance(stage, SparseGPT):
        p.targets = [[name for name, _ in layer] for layer in local]
        p.touched = [[f"{name}.weight" for name in names] for names in p.targets]
        return
    p.mappings = [[m for _, m in layer] for layer in local]
    p.touched = []
    for index, layer in enumerate(p.mappings):
        prefix, names = f"{source.layer_prefix}{index}.", []
        for m in layer:
            bias = getattr(modules[prefix + m.smooth], "bias", None)
            names += [f"{m.smooth}.weight"] + ([f"{m.smooth}.bias"] if isinstance(bias, torch.Tensor) else [])
            names += [f"{b}.weight" for b in m.balance]
        p.touched.append(list(dict.fromkeys(names)))


def sparse_targets(model: torch.nn.Module, stage: SparseGPT) -> list[str]:
    """SparseGPT's modules, as the peer finds them: every Linear inside a module its targets match (a Linear
    itself, or a decoder layer), unless matched by `ignore`; in module order."""
    found = {}
    for name, module in match_named_modules(model, list(stage.targets)):
        for inner, m in module.named_modules(prefix=name):
            if isinstance(m, torch.nn.Linear) and not match_targets(inner, m, list(stage.ignore)):
                found[inner] = True
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(found, key=order.get)


def _by_layer(source: SourceModel, found: list, modifier: str) -> list[list[tuple[str, object]]]:
    """Resolved modules (names, or mappings by their smooth layer) per decoder layer, with names local to it."""
    out = [[] for _ in range(source.num_layers)]
    prefix = source.layer_prefix
    for item in found:
        name = item if isinstance(item, str) else item.smooth
        if not name.startswith(prefix):
            raise UsageError(f"{modifier}: {name} is outside the decoder layers and cannot be run layer by layer: "
                             "add it to the modifier's ignore")
        index, _, rest = name[len(prefix):].partition(".")
        layer = f"{prefix}{index}."
        if isinstance(item, str):
            out[int(index)].append((rest, item))
            continue
        names = [item.smooth, *item.balance, *([item.parent, item.hook] if isinstance(item, awq.Mapping) else [])]
        if any(not f"{n}.".startswith(layer) for n in names):
            raise UsageError(f"{modifier} mapping of {name} reaches beyond its decoder layer: not supported")
        out[int(index)].append((rest, dataclasses.replace(
            item, **{f: _local(getattr(item, f), layer) for f in ("smooth", "balance", "parent", "hook")
                     if hasattr(item, f)})))
    return out


def _local(value, prefix: str):
    if isinstance(value, tuple):
        return tuple(v[len(prefix):] for v in value)
    return value[len(prefix):]


def dense(passes: list[Pass], layer: int, quantized: list[str]) -> list[str]:
    """The tensors (local names) of `layer` that the last pass commits dense: those any pass changed, but the
    weights the last pass commits itself (quantized modules', `quantized`; a last SparseGPT's pruned ones)."""
    last = passes[-1]
    own = {f"{name}.weight" for name in quantized}
    if last.kind == "sparsegpt":
        own |= set(last.touched[layer])
    names = [name for p in passes for name in p.touched[layer]]
    return [name for name in dict.fromkeys(names) if name not in own]
