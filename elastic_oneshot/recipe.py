"""What to quantize and how: the GPTQ recipe, expressed in compressed-tensors' own types."""

import dataclasses
import math
import re

from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.quant_config import get_vllm_module_type
from compressed_tensors.utils import match_named_modules

from .errors import UsageError

PRESETS = tuple(f"W{bits}A16" for bits in range(2, 9))  # compressed-tensors' int presets: symmetric, group 128
ACTORDERS = {"static": "static", "weight": "static", "none": None}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """GPTQ settings with the peer's defaults (llmcompressor's GPTQModifier with a preset scheme)."""

    scheme: str = "W4A16"
    group_size: int | None = None  # None: the preset's (128)
    symmetric: bool = True
    actorder: str | None = "static"
    dampening_frac: float = 0.01
    block_size: int = 128
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        if self.scheme not in PRESETS:
            raise UsageError(f"unknown scheme {self.scheme!r}: choose one of {', '.join(PRESETS)}")
        if self.actorder not in ACTORDERS.values():
            raise UsageError(f"actorder {self.actorder!r} is not supported: use static or none "
                             "(compressed-tensors 0.19 removed 'group' activation ordering)")
        if self.group_size is not None and self.group_size <= 0 and self.group_size != -1:
            raise UsageError(f"--group-size must be positive (or -1 for per-channel), "
                             f"not {self.group_size}")
        if not 0 <= self.dampening_frac < 1 or self.block_size <= 0:
            raise UsageError("--dampening-frac must be in [0, 1) and --block-size positive")

    @property
    def weights(self) -> QuantizationArgs:
        preset = preset_name_to_scheme(self.scheme, ["Linear"]).weights
        group = self.group_size if self.group_size is not None else preset.group_size
        return QuantizationArgs(
            num_bits=preset.num_bits, type=preset.type, symmetric=self.symmetric,
            strategy="channel" if group == -1 else "group", group_size=None if group == -1 else group,
            actorder=self.actorder, observer="memoryless_minmax", dynamic=False)

    @property
    def quant_scheme(self) -> QuantizationScheme:
        return QuantizationScheme(targets=list(self.targets), weights=self.weights,
                                  format="pack-quantized")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        return cls(**{**d, "targets": tuple(d["targets"]), "ignore": tuple(d["ignore"])})

    def quantized_modules(self, model) -> list[str]:
        """Names of the modules this recipe quantizes, matched as the peer matches them."""
        return [name for name, _ in match_named_modules(model, list(self.targets), list(self.ignore))]

    def quantization_config(self, model) -> QuantizationConfig:
        """The config the peer writes: one group, and as ignored every unquantized module of a quantized
        type as vLLM counts types (MoE routers count as Linear)."""
        quantized = set(self.quantized_modules(model))
        modules = dict(model.named_modules())
        types = {get_vllm_module_type(type(modules[n]).__name__) for n in quantized}
        ignore = [name for name, m in modules.items()
                  if name and name not in quantized and get_vllm_module_type(type(m).__name__) in types]
        return QuantizationConfig(
            config_groups={"group_0": self.quant_scheme}, format="pack-quantized",
            quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)


def check_divisible(recipe: Recipe, shapes: dict[str, tuple[int, int]]):
    """Refuse a group size that does not divide an input dimension, naming the modules."""
    group = recipe.weights.group_size
    bad = {name: cols for name, (_, cols) in shapes.items() if group and cols % group}
    if not bad:
        return
    kinds = sorted({(re.sub(r"\.\d+\.", ".*.", name), cols) for name, cols in bad.items()})
    shown = ", ".join(f"{name} [{cols}]" for name, cols in kinds[:4]) + (" ..." if len(kinds) > 4 else "")
    common = math.gcd(*bad.values())
    hint = max(d for d in range(1, group) if common % d == 0)
    raise UsageError(f"group size {group} does not divide the input dimension of {len(bad)} modules "
                     f"({shown}): use --group-size {hint}, or --ignore them (e.g. --ignore 're:{kinds[0][0]}')")
