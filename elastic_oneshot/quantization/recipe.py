"""What to do to the model: the recipe, its quantization expressed in compressed-tensors' own types.

A recipe is the peer's list of modifiers: the stages that come before quantization (SmoothQuant, AWQ, SparseGPT),
in the recipe's order, then at most one quantization modifier (GPTQModifier, or QuantizationModifier: round to
nearest), last. Its quantization resolves to named quantization schemes (config groups), as llmcompressor resolves
a modifier's `scheme` or `config_groups`: every compressed-tensors preset (int, FP8 by tensor, channel or block,
NVFP4, MXFP4, MXFP8, with their activation settings) or groups of our own. What this tool would not do as the peer
does is refused by name before any work (schemes.check_scheme, recipe_loader).
"""

import dataclasses
import math
import re
from typing import ClassVar

import torch
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.quant_config import get_vllm_module_type
from compressed_tensors.utils import match_named_modules

from elastic_oneshot.errors import UsageError
from elastic_oneshot.quantization.plan import input_groups
from elastic_oneshot.quantization.schemes import (
    PRESETS,
    check_scheme,
    group_size,
    int_weights,
    module_format,
    static_inputs,
    with_observers,
)

CUSTOM = "custom"  # the scheme of a recipe whose config_groups are not a preset
ACTORDERS = {"static": "static", "weight": "static", "none": None}
GPTQ, RTN = "GPTQModifier", "QuantizationModifier"  # the quantizers
SMOOTHING_ALGORITHMS = ("smoothquant", "log_equalization")
DUO_SCALING = (True, False, "both")


# -- the stages before quantization, each with the peer's defaults; a stage runs over every layer before the next ----
@dataclasses.dataclass(frozen=True)
class SmoothQuant:
    """SmoothQuantModifier (LogarithmicEqualizationModifier is it with algorithm log_equalization). `mappings`:
    (balance layers, smooth layer) patterns; None: the model's (smoothing.default_mappings)."""

    smoothing_strength: float = 0.5
    algorithm: str = "smoothquant"
    mappings: tuple[tuple[tuple[str, ...], str], ...] | None = None
    ignore: tuple[str, ...] = ()
    modifier: ClassVar[str] = "SmoothQuantModifier"

    def __post_init__(self):
        if not 0 <= self.smoothing_strength <= 1 or self.algorithm not in SMOOTHING_ALGORITHMS:
            raise UsageError(f"SmoothQuantModifier takes smoothing_strength in [0, 1] and algorithm "
                             f"{' or '.join(SMOOTHING_ALGORITHMS)}, not {self.smoothing_strength} and {self.algorithm}")


@dataclasses.dataclass(frozen=True)
class AWQ:
    """AWQModifier: a transform for the quantization modifier after it. `mappings`: (smooth layer, balance layers,
    activation hook target) patterns; None: the model's (awq.default_mappings)."""

    mappings: tuple[tuple[str, tuple[str, ...], str | None], ...] | None = None
    duo_scaling: bool | str = True
    n_grid: int = 20
    modifier: ClassVar[str] = "AWQModifier"

    def __post_init__(self):
        least = {True: 3, False: 2, "both": 4}.get(self.duo_scaling)
        if least is None or self.n_grid < least:
            raise UsageError(f"AWQModifier takes duo_scaling true, false or both and n_grid of at least 2 (3 with "
                             f"duo scaling, 4 with both), not {self.duo_scaling} and {self.n_grid}")


@dataclasses.dataclass(frozen=True)
class SparseGPT:
    """SparseGPTModifier: `mask_structure` "0:0" unstructured, else N:M (N of every M weights pruned)."""

    sparsity: float
    mask_structure: str = "0:0"
    block_size: int = 128
    dampening_frac: float = 0.01
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    modifier: ClassVar[str] = "SparseGPTModifier"

    def __post_init__(self):
        n, m = self.n_of_m
        if not 0 <= self.sparsity < 1 or n < 0 or m < 0 or n > m or (m and not n) or self.block_size <= 0 \
                or not 0 <= self.dampening_frac < 1 or n and self.block_size % m:
            raise UsageError(f"SparseGPTModifier takes sparsity in [0, 1), mask_structure 0:0 or N:M with M dividing "
                             f"block_size, dampening_frac in [0, 1): not {self.sparsity}, {self.mask_structure}, "
                             f"{self.block_size}, {self.dampening_frac}")

    @property
    def n_of_m(self) -> tuple[int, int]:
        n, _, m = self.mask_structure.partition(":")
        if not (n.isdigit() and m.isdigit()):
            raise UsageError(f"SparseGPTModifier mask_structure {self.mask_structure!r}: expected 0:0 or N:M (2:4)")
        return int(n), int(m)


STAGES = {cls.modifier: cls for cls in (SmoothQuant, AWQ, SparseGPT)}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A recipe with the peer's defaults (llmcompressor's GPTQModifier with a preset scheme). Group size,
    symmetry apply to int weights; `config_groups` (group name -> QuantizationScheme as JSON, with scheme
    CUSTOM) replaces the preset; damping, block size and activation order apply to GPTQ. `quantizer` is the
    quantization modifier (GPTQ, RTN; None: none, and no scheme), `stages` what runs before it, in order."""

    scheme: str | None = "W4A16"
    group_size: int | None = None  # None: the preset's (128; per channel for W8A8)
    symmetric: bool = True
    actorder: str | None = "static"
    dampening_frac: float = 0.01
    block_size: int = 128
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    config_groups: dict | None = None
    quantizer: str | None = GPTQ
    stages: tuple = ()

    def __post_init__(self):
        self._check_stages()
        if self.quantizer is None:
            return
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

    def _check_stages(self):
        if self.quantizer not in (GPTQ, RTN, None) or self.quantizer is None and (
                self.scheme is not None or self.config_groups is not None) or \
                not all(isinstance(stage, tuple(STAGES.values())) for stage in self.stages):
            raise ValueError(f"not a recipe: quantizer {self.quantizer!r}, scheme {self.scheme!r}, "
                             f"stages {self.stages!r}")  # what recipe_loader and from_dict never make
        if self.quantizer is None and any(isinstance(s, AWQ) for s in self.stages):
            raise UsageError(f"AWQModifier needs a quantization modifier after it ({GPTQ} or {RTN}): "
                             "it scales weights for that modifier's scheme")

    @property
    def modifiers(self) -> list[str]:
        """The peer's names of the recipe's modifiers, in the order they run."""
        return [s.modifier for s in self.stages] + ([self.quantizer] if self.quantizer else [])

    @property
    def name(self) -> str:
        """What the recipe makes, for a default output name: its scheme, else its stages' names."""
        if self.scheme is not None:
            return self.scheme
        return "-".join(s.modifier.removesuffix("Modifier") for s in self.stages)

    def with_default_mappings(self, family, config) -> "Recipe":
        """The recipe with the model's default mappings (models.family.Family's) for the stages given none: what a
        job records, so that a later change of the defaults cannot change it silently on a resume."""
        stages = tuple(dataclasses.replace(s, mappings=family.smoothing_mappings(config))
                       if isinstance(s, SmoothQuant) and s.mappings is None else
                       dataclasses.replace(s, mappings=family.awq_mappings(config))
                       if isinstance(s, AWQ) and s.mappings is None else s for s in self.stages)
        return dataclasses.replace(self, stages=stages)

    @property
    def calibrates(self) -> bool:
        """Whether the recipe needs calibration data (forward passes): every stage and GPTQ do; round to nearest only
        for static input activations (FP8's scale, NVFP4's global scale)."""
        return bool(self.stages) or self.quantizer == GPTQ or any(static_inputs(s) for s in self.schemes.values())

    @property
    def schemes(self) -> dict[str, QuantizationScheme]:
        """The config groups, resolved as the peer resolves them (observers, activation order); none without a
        quantizer."""
        if self.quantizer is None:
            return {}
        if self.config_groups is not None:
            return {name: QuantizationScheme.model_validate(s) for name, s in self.config_groups.items()}
        scheme = preset_name_to_scheme(self.scheme, list(self.targets))
        w = scheme.weights
        if w.type == "int":
            group = self.group_size if self.group_size is not None else w.group_size or -1
            scheme.weights = int_weights(w, group, self.symmetric, self.actorder)
        else:
            w.actorder = self.actorder
        return {"group_0": with_observers(scheme)}

    @property
    def weights(self) -> QuantizationArgs:
        """The weights' arguments of a recipe with one config group."""
        (scheme,) = self.schemes.values()
        return scheme.weights

    def to_dict(self) -> dict:
        """As JSON; what a GPTQ recipe does not use is absent, so that the identity of a preset job (job.json's
        fingerprint) is what it always was."""
        d = dataclasses.asdict(self)
        for name, default in (("config_groups", None), ("quantizer", GPTQ), ("stages", ())):
            if d[name] == default:
                del d[name]
        if self.stages:
            d["stages"] = [{"modifier": s.modifier, **_lists(dataclasses.asdict(s))} for s in self.stages]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        stages = tuple(STAGES[s["modifier"]](**{k: _tuples(v) for k, v in s.items() if k != "modifier"})
                       for s in d.get("stages", ()))
        return cls(**{**d, "targets": tuple(d["targets"]), "ignore": tuple(d["ignore"]), "stages": stages})

    def module_schemes(self, model: torch.nn.Module, family) -> dict[str, QuantizationScheme]:
        """Each quantized Linear's scheme, matched as the peer matches config groups, in module order; what the
        model's family (models.family.Family) keeps dense (routers, shared experts' gates, a vision tower) never.
        A module matched by two groups, modules sharing an input (fused by vLLM) with different schemes, or a
        group size that does not divide an input dimension are refused."""
        found, group_of = {}, {}
        ignore = [*self.ignore, *family.default_ignores(model)]
        for group, scheme in self.schemes.items():
            for name, module in match_named_modules(model, list(scheme.targets), ignore):
                if not isinstance(module, torch.nn.Linear):
                    continue
                if name in found:
                    raise UsageError(f"{name} is matched by config groups {group_of[name]} and {group}: "
                                     "make their targets disjoint")
                found[name], group_of[name] = scheme, group
        for names in input_groups(list(found), family.input_key(all_experts=True)):
            if len({group_of[n] for n in names}) > 1:
                raise UsageError(f"{', '.join(names)} share their input but not their config group "
                                 f"({', '.join(sorted({group_of[n] for n in names}))}): give them one scheme")
        modules = dict(model.named_modules())
        _check_divisible(self, {n: tuple(modules[n].weight.shape) for n in found}, found)
        order = {name: i for i, name in enumerate(modules)}
        return {name: found[name] for name in sorted(found, key=order.get)}

    def quantization_config(self, model: torch.nn.Module, schemes: dict[str, QuantizationScheme]
                            ) -> QuantizationConfig | None:
        """The config the peer writes for `schemes` (module_schemes'): one group per distinct scheme in module
        order, each with its format (the top level's: that format, or mixed-precision), and as ignored every
        unquantized module of a quantized type as vLLM counts types (MoE routers count as Linear). None without a
        quantizer: the peer writes none (compressed-tensors 0.19 has no sparse format: pruned weights stay dense)."""
        if self.quantizer is None:
            return None
        modules = dict(model.named_modules())
        types = {_vllm_type(modules[n]) for n in schemes}
        ignore = [name for name, m in modules.items() if name and name not in schemes and _vllm_type(m) in types]
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


def _vllm_type(module: torch.nn.Module) -> str:
    """A module's type as vLLM counts types (compressed-tensors' get_vllm_module_type); our own Linear modules (an
    expert's RowsLinear) count as the Linear they stand for."""
    return "Linear" if isinstance(module, torch.nn.Linear) else get_vllm_module_type(type(module).__name__)


def _check_divisible(recipe: Recipe, shapes: dict[str, tuple[int, int]], schemes: dict[str, QuantizationScheme]):
    """Refuse a group size that does not divide an input dimension, naming the modules, with a group size that
    would (int presets) or the --ignore that leaves them out."""
    bad = {}
    for name, (_, cols) in shapes.items():
        group = group_size(schemes[name].weights)
        if group and cols % group:
            bad[name] = (cols, group)
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


def _lists(value):
    """Tuples as lists, recursively (JSON's shape)."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def _tuples(value):
    """Lists as tuples, recursively (a frozen stage's shape)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
