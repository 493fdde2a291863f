"""llmcompressor recipes, as its users write them, read into a `Recipe`.

They come two ways: YAML (or JSON) text or file nested `<name>_stage: <name>_modifiers: Modifier: {...}`,
or modifier objects (alone, in a list, or in llmcompressor's `Recipe`) passed to `oneshot`.
Both are read as llmcompressor 0.14 reads them: every stage's modifiers in one list, in the order written, each
run over the whole model before the next (its default `independent` pipeline); presets, `scheme: {PRESET:
targets}`, several config groups. Anything this tool would not do as the peer does (another modifier, output or
kv-cache quantization, other observers, an order the peer would not run) is refused in one line before any work.
"""

import json
import os

import yaml
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationScheme,
    is_preset_scheme,
    preset_name_to_scheme,
)
from pydantic import ValidationError

from elastic_oneshot.errors import UsageError
from elastic_oneshot.quantization.recipe import ACTORDERS, AWQ, CUSTOM, GPTQ, RTN, Recipe, SmoothQuant, SparseGPT
from elastic_oneshot.quantization.schemes import PRESETS, group_option, with_observers

LOG_EQUALIZATION = "LogarithmicEqualizationModifier"
READS = (GPTQ, RTN, SmoothQuant.modifier, LOG_EQUALIZATION, AWQ.modifier, SparseGPT.modifier)
# Arguments that change nothing in a oneshot run: lifecycle fields of every modifier, memory knobs, fields the peer
# declares but never reads.
INERT = {"index", "group", "start", "end", "update", "requires_calibration_data"}
QUANTIZATION = {"targets", "ignore", "scheme", "config_groups", "kv_cache_scheme", "weight_observer", "input_observer",
                "output_observer", "observer", "bypass_divisibility_checks"}
ARGUMENTS = {  # each modifier's arguments, and those of them that change nothing
    GPTQ: (QUANTIZATION | {"block_size", "dampening_frac", "actorder"}, {"batched_quantization"}),
    RTN: (QUANTIZATION, set()),
    SmoothQuant.modifier: ({"smoothing_strength", "mappings", "ignore", "algorithm"},
                           {"num_calibration_steps", "calibration_function"}),
    AWQ.modifier: ({"mappings", "duo_scaling", "n_grid"}, {"offload_device"}),
    SparseGPT.modifier: ({"sparsity", "mask_structure", "block_size", "dampening_frac", "targets", "ignore",
                          "sparsity_profile", "owl_m", "owl_lmbda", "preserve_sparsity_mask"},
                         {"sequential_update", "offload_hessians"}),
}
ARGUMENTS[LOG_EQUALIZATION] = ARGUMENTS[SmoothQuant.modifier]


def read_recipe(recipe) -> Recipe:
    """`recipe`: a Recipe, a YAML/JSON file path or text, a modifier, a list of them, or llmcompressor's Recipe;
    read whole: the stages before quantization and the quantization modifier."""
    if isinstance(recipe, Recipe):
        return recipe
    return _recipe(_modifiers(recipe))


def _modifiers(recipe) -> list[tuple[str, dict]]:
    """The recipe's modifiers in the order the peer runs them, each refused by name unless read here."""
    modifiers = _from_text(recipe) if isinstance(recipe, str) else _from_objects(recipe)
    for name, _ in modifiers:
        if name not in READS:
            raise UsageError(f"{name} is not supported: elastic-oneshot runs {', '.join(READS)}")
    return modifiers


def _recipe(modifiers: list[tuple[str, dict]]) -> Recipe:
    """Stages, then at most one quantization modifier, last (AWQ scales for the one after it; a stage after
    quantization would change quantized weights)."""
    names = [name for name, _ in modifiers]
    quantizers = [i for i, name in enumerate(names) if name in (GPTQ, RTN)]
    if len(quantizers) > 1:
        raise UsageError(f"the recipe has {len(quantizers)} quantization modifiers ({', '.join(names)}): "
                         "elastic-oneshot runs at most one, last")
    if quantizers and quantizers[0] != len(names) - 1:
        raise UsageError(f"{names[quantizers[0] + 1]} after {names[quantizers[0]]} is not supported: "
                         "the quantization modifier runs last")
    for name, args in modifiers:
        known, inert = ARGUMENTS[name]
        unknown = sorted(set(args) - known - inert - INERT)
        if unknown:
            hint = (f": in llmcompressor 0.14 AWQ is a transform; give the scheme to a {RTN} after it"
                    if name == AWQ.modifier and unknown[0] in QUANTIZATION else "")
            raise UsageError(f"{name} argument {unknown[0]!r} is not supported{hint}")
    stages = tuple(_stage(name, args) for name, args in modifiers if name not in (GPTQ, RTN))
    if not quantizers:
        return Recipe(scheme=None, quantizer=None, stages=stages)
    name, args = modifiers[-1]
    return _quantization(name, args, stages)


def _from_text(text: str) -> list[tuple[str, dict]]:
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    elif text.lower().endswith((".yaml", ".yml", ".json")):
        raise UsageError(f"recipe file {text} does not exist")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UsageError(f"the recipe is not valid YAML: {str(e).splitlines()[0]}") from None
    modifiers = [(name, args or {}) for stage, groups in (doc.items() if isinstance(doc, dict) else [])
                 if str(stage).endswith("_stage") and isinstance(groups, dict)
                 for group, mods in groups.items() if str(group).endswith("_modifiers") and isinstance(mods, dict)
                 for name, args in mods.items()]
    if not modifiers:
        raise UsageError("no modifier found in the recipe: expected "
                         "'<name>_stage: <name>_modifiers: GPTQModifier: {...}' (llmcompressor's layout)")
    return modifiers


def _from_objects(recipe) -> list[tuple[str, dict]]:
    """Modifier objects as the YAML they stand for: only the arguments their author set."""
    items = recipe.modifiers if hasattr(recipe, "modifiers") else recipe
    out = []
    for item in items if isinstance(items, (list, tuple)) else [items]:
        if isinstance(item, (list, tuple)) or hasattr(item, "modifiers"):
            out += _from_objects(item)
        elif hasattr(item, "model_dump"):
            out.append((type(item).__name__, item.model_dump(exclude_unset=True)))
        else:
            raise UsageError(f"cannot read a recipe from {type(item).__name__}: give a GPTQModifier, a list of "
                             "modifiers, or YAML (a file or text)")
    return out


def _stage(name: str, args: dict):
    """A stage's arguments as the peer reads them; what it would run otherwise than here is refused."""
    if name in (SmoothQuant.modifier, LOG_EQUALIZATION):
        default = "log_equalization" if name == LOG_EQUALIZATION else "smoothquant"
        mappings = args.get("mappings")
        return SmoothQuant(smoothing_strength=args.get("smoothing_strength", 0.5),
                           algorithm=args.get("algorithm", default), ignore=tuple(args.get("ignore") or ()),
                           mappings=None if mappings is None else tuple(_smoothquant_mapping(m) for m in mappings))
    if name == AWQ.modifier:
        mappings = args.get("mappings")
        return AWQ(duo_scaling=args.get("duo_scaling", True), n_grid=args.get("n_grid", 20),
                   mappings=None if mappings is None else tuple(_awq_mapping(m) for m in mappings))
    sparsity = args.get("sparsity")
    if not isinstance(sparsity, (int, float)) or isinstance(sparsity, bool):
        raise UsageError(f"SparseGPTModifier sparsity {sparsity!r} is not supported: give one fraction "
                         "(per-layer lists are not supported)")
    if args.get("sparsity_profile") is not None or args.get("owl_m") is not None or args.get("preserve_sparsity_mask"):
        raise UsageError("SparseGPTModifier sparsity_profile (OWL) and preserve_sparsity_mask are not supported")
    targets = args.get("targets", ["Linear"])
    return SparseGPT(sparsity=float(sparsity), mask_structure=str(args.get("mask_structure", "0:0")),
                     block_size=args.get("block_size", 128), dampening_frac=args.get("dampening_frac", 0.01),
                     targets=(targets,) if isinstance(targets, str) else tuple(targets),
                     ignore=tuple(args.get("ignore") or ()))


def _smoothquant_mapping(mapping) -> tuple[tuple[str, ...], str]:
    """The peer's SmoothQuant mapping: any nesting of patterns, the last one the smooth layer's."""
    leaves = list(_leaves(mapping))
    if len(leaves) < 2 or not all(isinstance(p, str) for p in leaves):
        raise UsageError(f"SmoothQuantModifier mapping {mapping!r}: expected [[balance layers...], smooth layer]")
    return tuple(leaves[:-1]), leaves[-1]


def _awq_mapping(mapping) -> tuple[str, tuple[str, ...], str | None]:
    """The peer's AWQMapping: {smooth_layer, balance_layers, activation_hook_target}, or those as a list."""
    if isinstance(mapping, dict):
        mapping = (mapping.get("smooth_layer"), mapping.get("balance_layers"), mapping.get("activation_hook_target"))
    elif not isinstance(mapping, (list, tuple)):  # an AWQMapping
        mapping = (getattr(mapping, "smooth_layer", None), getattr(mapping, "balance_layers", None),
                   getattr(mapping, "activation_hook_target", None))
    smooth, balance, target = (*mapping, None)[:3] if len(mapping) in (2, 3) else (None, None, None)
    if not isinstance(smooth, str) or not balance or isinstance(balance, str) or \
            not all(isinstance(p, str) for p in balance) or not (target is None or isinstance(target, str)):
        raise UsageError(f"AWQModifier mapping {mapping!r}: expected {{smooth_layer: S, balance_layers: [...]}}")
    return smooth, tuple(balance), target


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _quantization(name: str, args: dict, stages: tuple) -> Recipe:
    """A quantization modifier's arguments, resolved as llmcompressor resolves them, as a Recipe: a preset with
    our options where one says the same, else its config groups. GPTQ's activation order and damping apply to
    GPTQModifier; QuantizationModifier rounds to nearest with the scheme as written."""
    if args.get("kv_cache_scheme") is not None:
        raise UsageError(f"{name} kv_cache_scheme is not supported: elastic-oneshot quantizes Linear layers only")
    if args.get("bypass_divisibility_checks"):
        raise UsageError("bypass_divisibility_checks is not supported: group sizes must divide every input dimension")
    observer = args.get("observer") or {}
    if set(observer) - {"weights", "input"} or args.get("output_observer") is not None:
        raise UsageError("output observers are not supported: elastic-oneshot quantizes no output activations")
    observers = {"weights": observer.get("weights", args.get("weight_observer")),
                 "inputs": observer.get("input", args.get("input_observer"))}
    schemes = {}
    for group, scheme in _schemes(name, args).items():
        if scheme.weights is not None and name == GPTQ:
            scheme.weights.actorder = _actorder(args, scheme.weights)
        schemes[group] = with_observers(scheme, **observers)
    common = dict(dampening_frac=args.get("dampening_frac", 0.01), block_size=args.get("block_size", 128),
                  ignore=tuple(args.get("ignore", ())), quantizer=name, stages=stages)
    if len(schemes) == 1:
        (scheme,) = schemes.values()
        preset = _as_preset(scheme, common)
        if preset is not None:
            return preset
    actorder = _order(args.get("actorder", "static")) if name == GPTQ else None
    return Recipe(scheme=CUSTOM, actorder=actorder,
                  config_groups={group: s.model_dump(mode="json") for group, s in schemes.items()}, **common)


def _as_preset(scheme: QuantizationScheme, common: dict) -> Recipe | None:
    """The preset recipe (with our int options: group size, symmetry) whose scheme is `scheme`, if any: the job
    of the same command-line flags."""
    w = scheme.weights
    if w is None or list(scheme.targets) != ["Linear"]:
        return None
    for name in PRESETS:
        preset = preset_name_to_scheme(name, ["Linear"]).weights
        ints = w.type == "int" and preset.type == "int"
        group = group_option(w) if ints else None
        try:
            candidate = Recipe(scheme=name, symmetric=w.symmetric if ints else True, actorder=_order(w.actorder),
                               group_size=None if group == group_option(preset) else group, **common)
        except UsageError:
            continue
        if _same(candidate.schemes["group_0"], scheme):
            return candidate
    return None


def _same(a, b) -> bool:
    return json.dumps(a.model_dump(mode="json"), sort_keys=True) == json.dumps(b.model_dump(mode="json"),
                                                                              sort_keys=True)


def _schemes(name: str, args: dict) -> dict[str, QuantizationScheme]:
    """The quantization schemes of `scheme` (a preset name, or {preset: targets}) or `config_groups`, by group name
    (the peer's resolve_quantization_config)."""
    scheme, groups = args.get("scheme"), args.get("config_groups")
    if scheme is not None and groups is not None:
        raise UsageError(f"{name} takes either scheme or config_groups, not both")
    targets = args.get("targets", ["Linear"])
    if isinstance(scheme, str):
        scheme = {scheme: targets}
    if scheme is not None:
        out = {}
        for i, (preset, group_targets) in enumerate(scheme.items()):
            if not is_preset_scheme(preset) or preset.upper() == "UNQUANTIZED":
                raise UsageError(f"unknown scheme {preset!r}: use a preset such as {', '.join(PRESETS[:6])}, ..., "
                                 "or config_groups")
            out[f"group_{i}"] = preset_name_to_scheme(preset, [group_targets] if isinstance(group_targets, str)
                                                      else list(group_targets))
        return out
    if not groups:
        raise UsageError(f"{name} needs a scheme (e.g. W4A16) or config_groups")
    out = {}
    for group_name, group in groups.items():
        try:
            out[group_name] = group if isinstance(group, QuantizationScheme) else \
                QuantizationScheme.model_validate(group)
        except ValidationError as e:
            error = e.errors()[0]
            raise UsageError(f"invalid config group {group_name}{''.join(f'.{x}' for x in error['loc'])}: "
                             f"{error['msg']}") from None
    return out


def _actorder(args: dict, weights: QuantizationArgs) -> str | None:
    """As the peer resolves it: the modifier's, if given, must agree with the weights'; by default static."""
    theirs = _order(weights.actorder)
    if "actorder" in args:
        mine = _order(args["actorder"])
        if theirs is not None and mine != theirs:
            raise UsageError(f"GPTQModifier actorder {mine} differs from the weights' {theirs}: give one")
    else:
        mine = theirs or "static"
    if mine not in ("static", None):
        raise UsageError(f"actorder {mine!r} is not supported: use static (alias weight) or none "
                         "(compressed-tensors 0.19 removed 'group' activation ordering)")
    return mine


def _order(value) -> str | None:
    value = getattr(value, "value", value)  # an ActivationOrdering
    return None if value is None else ACTORDERS.get(value, value)
