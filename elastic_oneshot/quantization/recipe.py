"""What to quantize and how: the GPTQ recipe, expressed in compressed-tensors' own types.

A recipe resolves to named quantization schemes (config groups), as llmcompressor's GPTQModifier resolves its
`scheme` or `config_groups`: every compressed-tensors preset (int, FP8 by tensor, channel or block, NVFP4, MXFP4,
MXFP8, with their activation settings) or groups of our own. What this tool would not do as the peer does is
refused here, by name, before any work.
"""

import dataclasses
import math
import re

import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import (
    DynamicType,
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.quant_config import get_vllm_module_type
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.utils import match_named_modules

from elastic_oneshot.errors import UsageError
from elastic_oneshot.models.source import default_ignores
from elastic_oneshot.quantization.plan import input_groups

# compressed-tensors' presets (W4A16_ASYM is W4A16 with --asym).
PRESETS = tuple(name for name in PRESET_SCHEMES if name not in ("UNQUANTIZED", "W4A16_ASYM"))
CUSTOM = "custom"  # the scheme of a recipe whose config_groups are not a preset
ACTORDERS = {"static": "static", "weight": "static", "none": None}
WEIGHT_OBSERVERS = {None, "minmax", "memoryless_minmax", "static_minmax"}  # identical on weights observed once
WEIGHT_STRATEGIES = {"tensor", "channel", "group", "tensor_group", "block"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """GPTQ settings with the peer's defaults (llmcompressor's GPTQModifier with a preset scheme). Group size,
    symmetry apply to int weights; `config_groups` (group name -> QuantizationScheme as JSON, with scheme
    CUSTOM) replaces the preset."""

    scheme: str = "W4A16"
    group_size: int | None = None  # None: the preset's (128; per channel for W8A8)
    symmetric: bool = True
    actorder: str | None = "static"
    dampening_frac: float = 0.01
    block_size: int = 128
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    config_groups: dict | None = None

    def __post_init__(self):
        if self.config_groups is None and self.scheme not in PRESETS:
            raise UsageError(f"unknown scheme {self.scheme!r}: choose one of {', '.join(PRESETS)}")
        if self.actorder not in ACTORDERS.values():
            raise UsageError(f"actorder {self.actorder!r} is not supported: use static or none "
                             "(compressed-tensors 0.19 removed 'group' activation ordering)")
        if self.group_size is not None and self.group_size <= 0 and self.group_size != -1:
            raise UsageError(f"--group-size must be positive (or -1 for per-channel), "
                             f"not {self.group_size}")
        if not 0 <= self.dampening_frac < 1 or self.block_size <= 0:
            raise UsageError("--dampening-frac must be in [0, 1) and --block-size positive")
        if self.config_groups is None and preset_name_to_scheme(self.scheme, ["Linear"]).weights.type != "int":
            if self.group_size is not None:
                raise UsageError(f"--group-size applies to int weights, not to {self.scheme}'s")
            if not self.symmetric:
                raise UsageError(f"--asym applies to int weights, not to {self.scheme}'s")
        for name, scheme in self.schemes.items():
            check_scheme(name, scheme)

    @property
    def schemes(self) -> dict[str, QuantizationScheme]:
        """The config groups, resolved as the peer resolves them (observers, activation order)."""
        if self.config_groups is not None:
            return {name: QuantizationScheme.model_validate(s) for name, s in self.config_groups.items()}
        scheme = preset_name_to_scheme(self.scheme, list(self.targets))
        w = scheme.weights
        if w.type == "int":
            group = self.group_size if self.group_size is not None else w.group_size or -1
            scheme.weights = QuantizationArgs(
                num_bits=w.num_bits, type=w.type, symmetric=self.symmetric,
                strategy="channel" if group == -1 else "group", group_size=None if group == -1 else group,
                actorder=self.actorder, observer="memoryless_minmax", dynamic=False)
        else:
            w.actorder = self.actorder
        return {"group_0": with_observers(scheme)}

    @property
    def weights(self) -> QuantizationArgs:
        """The weights' arguments of a recipe with one config group."""
        (scheme,) = self.schemes.values()
        return scheme.weights

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["config_groups"] is None:  # absent: the identity of a preset job is what it always was
            del d["config_groups"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        return cls(**{**d, "targets": tuple(d["targets"]), "ignore": tuple(d["ignore"])})

    def module_schemes(self, model) -> dict[str, QuantizationScheme]:
        """Each quantized Linear's scheme, matched as the peer matches config groups, in module order; what
        `source.default_ignores` keeps dense (routers, shared experts' gates, a vision tower) never. A module
        matched by two groups, or modules sharing an input (fused by vLLM) with different schemes, are refused."""
        found, group_of = {}, {}
        ignore = [*self.ignore, *default_ignores(model)] if hasattr(model, "get_decoder") else list(self.ignore)
        for group, scheme in self.schemes.items():
            for name, module in match_named_modules(model, list(scheme.targets), ignore):
                if not isinstance(module, torch.nn.Linear):
                    continue
                if name in found:
                    raise UsageError(f"{name} is matched by config groups {group_of[name]} and {group}: "
                                     "make their targets disjoint")
                found[name], group_of[name] = scheme, group
        for names in input_groups(list(found), all_experts=True):
            if len({group_of[n] for n in names}) > 1:
                raise UsageError(f"{', '.join(names)} share their input but not their config group "
                                 f"({', '.join(sorted({group_of[n] for n in names}))}): give them one scheme")
        modules = dict(model.named_modules())
        check_divisible(self, {n: tuple(modules[n].weight.shape) for n in found}, found)
        order = {name: i for i, name in enumerate(modules)}
        return {name: found[name] for name in sorted(found, key=order.get)}

    def quantized_modules(self, model) -> list[str]:
        """Names of the modules this recipe quantizes, matched as the peer matches them."""
        return list(self.module_schemes(model))

    def quantization_config(self, model) -> QuantizationConfig:
        """The config the peer writes: one group per distinct scheme in module order, each with its format
        (the top level's: that format, or mixed-precision), and as ignored every unquantized module of a
        quantized type as vLLM counts types (MoE routers count as Linear)."""
        schemes = self.module_schemes(model)
        modules = dict(model.named_modules())
        types = {get_vllm_module_type(type(modules[n]).__name__) for n in schemes}
        ignore = [name for name, m in modules.items()
                  if name and name not in schemes and get_vllm_module_type(type(m).__name__) in types]
        groups = []
        for scheme in schemes.values():
            if scheme not in groups:
                groups.append(scheme)
        groups = [g.model_copy(update={"format": module_format(g)}) for g in groups]
        formats = {g.format for g in groups}
        return QuantizationConfig(
            config_groups={f"group_{i}": g for i, g in enumerate(groups)},
            format=formats.pop() if len(formats) == 1 else "mixed-precision",
            quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)


def module_format(scheme: QuantizationScheme) -> str:
    """The compressed-tensors format a Linear of `scheme` is written in: its own, else the one compressed-tensors
    infers (int-quantized, float-quantized, pack-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized, ...)."""
    return getattr(scheme.format, "value", scheme.format) or infer_module_format(torch.nn.Linear, scheme).value


def with_observers(scheme: QuantizationScheme, weights: str | None = None, inputs: str | None = None
                   ) -> QuantizationScheme:
    """Observers as the peer sets them (QuantizationMixin._apply_observer_overrides): the override given, else the
    one the scheme names, else memoryless_minmax for weights and minmax for static inputs."""
    for args, override, default in ((scheme.weights, weights, "memoryless_minmax"),
                                    (scheme.input_activations, inputs, "minmax")):
        if args is not None and (override is not None or "observer" not in args.model_fields_set):
            args.observer = override or (None if args.dynamic is True else default)
    return scheme


def static_inputs(scheme: QuantizationScheme) -> QuantizationArgs | None:
    """The input activations' arguments when calibration observes them (not fully dynamic); else None."""
    args = scheme.input_activations
    return args if args is not None and args.dynamic is not True else None


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


def check_divisible(recipe: Recipe, shapes: dict[str, tuple[int, int]], schemes: dict | None = None):
    """Refuse a group size that does not divide an input dimension, naming the modules (`schemes`: each module's,
    default: the recipe's one)."""
    if schemes is None:
        if len(recipe.schemes) > 1:
            return  # Recipe.module_schemes checks each module against its own group
        schemes = dict.fromkeys(shapes, recipe.weights)
    bad = {}
    for name, (_, cols) in shapes.items():
        w = getattr(schemes[name], "weights", schemes[name])
        if w.strategy in ("group", "tensor_group") and cols % w.group_size:
            bad[name] = (cols, w.group_size)
    if not bad:
        return
    kinds = sorted({(re.sub(r"\.\d+\.", ".*.", name), cols) for name, (cols, _) in bad.items()})
    shown = ", ".join(f"{name} [{cols}]" for name, cols in kinds[:4]) + (" ..." if len(kinds) > 4 else "")
    group = max(g for _, g in bad.values())
    common = math.gcd(*(c for c, _ in bad.values()))
    hint = max(d for d in range(1, group) if common % d == 0)
    ignore = f"--ignore them (e.g. --ignore 're:{kinds[0][0]}')"
    raise UsageError(f"group size {group} does not divide the input dimension of {len(bad)} modules ({shown}): "
                     + (f"use --group-size {hint}, or {ignore}" if recipe.config_groups is None and
                        recipe.weights.type == "int" else ignore))
