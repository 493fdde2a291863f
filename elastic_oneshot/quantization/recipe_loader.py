"""llmcompressor recipes, as its users write them, read into a `Recipe`.

They come two ways: YAML (or JSON) text or file nested `<name>_stage: <name>_modifiers: GPTQModifier: {...}`,
or `GPTQModifier(...)` objects (alone, in a list, or in llmcompressor's `Recipe`) passed to `oneshot`.
Both are read as the peer reads them (presets, `scheme: {PRESET: targets}`, several config groups); anything this
tool would not do as the peer does (another modifier, output or kv-cache quantization, other observers) is refused
in one line instead of being ignored.
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
from elastic_oneshot.quantization.recipe import ACTORDERS, CUSTOM, Recipe
from elastic_oneshot.quantization.schemes import PRESETS, group_option, with_observers

GPTQ = "GPTQModifier"
# GPTQModifier arguments that change nothing in a oneshot run: lifecycle fields of every modifier, a memory knob.
INERT = {"index", "group", "start", "end", "update", "batched_quantization"}


def load_recipe(recipe) -> Recipe:
    """`recipe`: a Recipe, a YAML/JSON file path or text, a GPTQModifier, a list of them, or llmcompressor's Recipe."""
    if isinstance(recipe, Recipe):
        return recipe
    modifiers = _from_text(recipe) if isinstance(recipe, str) else _from_objects(recipe)
    names = [name for name, _ in modifiers]
    for name in names:
        if name != GPTQ:
            raise UsageError(f"{name} is not supported: elastic-oneshot runs GPTQ only")
    if len(names) != 1:
        raise UsageError(f"the recipe has {len(names)} GPTQModifiers: elastic-oneshot runs exactly one")
    return _gptq(modifiers[0][1])


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


def _gptq(args: dict) -> Recipe:
    """GPTQModifier's arguments, resolved as llmcompressor resolves them, as a Recipe: a preset with our options
    where one says the same, else its config groups."""
    known = {"targets", "ignore", "scheme", "config_groups", "block_size", "dampening_frac", "actorder",
             "kv_cache_scheme", "weight_observer", "input_observer", "output_observer", "observer",
             "bypass_divisibility_checks"}
    unknown = sorted(set(args) - known - INERT)
    if unknown:
        raise UsageError(f"GPTQModifier argument {unknown[0]!r} is not supported")
    if args.get("kv_cache_scheme") is not None:
        raise UsageError("GPTQModifier kv_cache_scheme is not supported: elastic-oneshot quantizes Linear layers only")
    if args.get("bypass_divisibility_checks"):
        raise UsageError("bypass_divisibility_checks is not supported: group sizes must divide every input dimension")
    observer = args.get("observer") or {}
    if set(observer) - {"weights", "input"} or args.get("output_observer") is not None:
        raise UsageError("output observers are not supported: elastic-oneshot quantizes no output activations")
    observers = {"weights": observer.get("weights", args.get("weight_observer")),
                 "inputs": observer.get("input", args.get("input_observer"))}
    schemes = {}
    for name, scheme in _schemes(args).items():
        if scheme.weights is not None:
            scheme.weights.actorder = _actorder(args, scheme.weights)
        schemes[name] = with_observers(scheme, **observers)
    common = dict(dampening_frac=args.get("dampening_frac", 0.01), block_size=args.get("block_size", 128),
                  ignore=tuple(args.get("ignore", ())))
    if len(schemes) == 1:
        (scheme,) = schemes.values()
        preset = _as_preset(scheme, common)
        if preset is not None:
            return preset
    return Recipe(scheme=CUSTOM, actorder=_order(args.get("actorder", "static")),
                  config_groups={name: s.model_dump(mode="json") for name, s in schemes.items()}, **common)


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


def _schemes(args: dict) -> dict[str, QuantizationScheme]:
    """The quantization schemes of `scheme` (a preset name, or {preset: targets}) or `config_groups`, by group name
    (the peer's resolve_quantization_config)."""
    scheme, groups = args.get("scheme"), args.get("config_groups")
    if scheme is not None and groups is not None:
        raise UsageError("GPTQModifier takes either scheme or config_groups, not both")
    targets = args.get("targets", ["Linear"])
    if isinstance(scheme, str):
        scheme = {scheme: targets}
    if scheme is not None:
        out = {}
        for i, (name, group_targets) in enumerate(scheme.items()):
            if not is_preset_scheme(name) or name.upper() == "UNQUANTIZED":
                raise UsageError(f"unknown scheme {name!r}: use a preset such as {', '.join(PRESETS[:6])}, ..., "
                                 "or config_groups")
            out[f"group_{i}"] = preset_name_to_scheme(name, [group_targets] if isinstance(group_targets, str)
                                                      else list(group_targets))
        return out
    if not groups:
        raise UsageError("GPTQModifier needs a scheme (e.g. W4A16) or config_groups")
    out = {}
    for name, group in groups.items():
        try:
            out[name] = group if isinstance(group, QuantizationScheme) else QuantizationScheme.model_validate(group)
        except ValidationError as e:
            error = e.errors()[0]
            raise UsageError(f"invalid config group {name}{''.join(f'.{x}' for x in error['loc'])}: "
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
