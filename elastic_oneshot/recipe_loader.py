"""llmcompressor recipes, as its users write them, read into a `Recipe`.

They come two ways: YAML (or JSON) text or file nested `<name>_stage: <name>_modifiers: GPTQModifier: {...}`,
or `GPTQModifier(...)` objects (alone, in a list, or in llmcompressor's `Recipe`) passed to `oneshot`.
Both are read as the peer reads them; anything this tool would not do as the peer does (another modifier,
activation or float quantization, other targets) is refused in one line instead of being ignored.
"""

import os

import yaml
from compressed_tensors.quantization import QuantizationArgs, is_preset_scheme, preset_name_to_scheme
from pydantic import ValidationError

from .errors import UsageError
from .recipe import ACTORDERS, PRESETS, Recipe

GPTQ = "GPTQModifier"
# GPTQModifier arguments that change nothing in a oneshot run: lifecycle fields of every modifier, a memory knob.
INERT = {"index", "group", "start", "end", "update", "batched_quantization"}
WEIGHT_OBSERVERS = {None, "minmax", "memoryless_minmax"}  # identical on weights observed once


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
    """GPTQModifier's arguments, resolved as llmcompressor resolves them, as a Recipe."""
    known = {"targets", "ignore", "scheme", "config_groups", "block_size", "dampening_frac", "actorder",
             "kv_cache_scheme", "weight_observer", "input_observer", "output_observer", "observer",
             "bypass_divisibility_checks"}
    unknown = sorted(set(args) - known - INERT)
    if unknown:
        raise UsageError(f"GPTQModifier argument {unknown[0]!r} is not supported")
    for key in ("kv_cache_scheme", "input_observer", "output_observer"):
        if args.get(key) is not None:
            raise UsageError(f"GPTQModifier {key} is not supported: elastic-oneshot quantizes weights only")
    if args.get("bypass_divisibility_checks"):
        raise UsageError("bypass_divisibility_checks is not supported: group sizes must divide every input dimension")
    observer = args.get("observer") or {}
    if set(observer) - {"weights"} or {args.get("weight_observer"), observer.get("weights")} - WEIGHT_OBSERVERS:
        raise UsageError("observers other than memoryless_minmax on weights are not supported")

    scheme = _scheme(args)
    targets = scheme.get("targets")
    if targets not in (["Linear"], "Linear"):
        raise UsageError(f"targets {targets!r} are not supported: elastic-oneshot quantizes every Linear "
                         "(use ignore to leave some out)")
    for key in ("input_activations", "output_activations"):
        if scheme.get(key) is not None:
            raise UsageError(f"{key} are not supported: elastic-oneshot quantizes weights only (W*A16)")
    if scheme.get("format") not in (None, "pack-quantized"):
        raise UsageError(f"format {scheme['format']!r} is not supported: elastic-oneshot writes pack-quantized")
    weights = _weights(scheme.get("weights"))
    actorder = _actorder(args, weights)

    group = -1 if weights.strategy == "channel" else weights.group_size
    preset = f"W{weights.num_bits}A16"
    recipe = Recipe(
        scheme=preset, group_size=None if group == preset_name_to_scheme(preset, ["Linear"]).weights.group_size
        else group, symmetric=weights.symmetric, actorder=actorder,
        dampening_frac=args.get("dampening_frac", 0.01), block_size=args.get("block_size", 128),
        ignore=tuple(args.get("ignore", ())))
    mine = recipe.weights
    for field in QuantizationArgs.model_fields:
        if field not in ("actorder", "observer") and getattr(weights, field) != getattr(mine, field):
            raise UsageError(f"weights {field}={getattr(weights, field)!r} is not supported")
    return recipe


def _scheme(args: dict) -> dict:
    """The one quantization scheme of `scheme` (a preset name, or {preset: targets}) or `config_groups`."""
    scheme, groups = args.get("scheme"), args.get("config_groups")
    if scheme is not None and groups is not None:
        raise UsageError("GPTQModifier takes either scheme or config_groups, not both")
    if isinstance(scheme, str):
        scheme = {scheme: args.get("targets", ["Linear"])}
    if scheme is not None:
        if len(scheme) != 1:
            raise UsageError(f"one scheme is supported, not {len(scheme)} ({', '.join(scheme)})")
        (name, targets), = scheme.items()
        if not is_preset_scheme(name):
            raise UsageError(f"unknown scheme {name!r}: use a preset such as {', '.join(PRESETS)}, or config_groups")
        return preset_name_to_scheme(name, [targets] if isinstance(targets, str) else targets).model_dump()
    if not groups:
        raise UsageError("GPTQModifier needs a scheme (e.g. W4A16) or config_groups")
    if len(groups) != 1:
        raise UsageError(f"one config group is supported, not {len(groups)} ({', '.join(groups)})")
    (group,) = groups.values()
    return group


def _weights(weights) -> QuantizationArgs:
    if not weights:
        raise UsageError("the config group quantizes no weights (weights: is missing)")
    try:
        args = QuantizationArgs.model_validate(weights)
    except ValidationError as e:
        error = e.errors()[0]
        raise UsageError(f"invalid weights{''.join(f'.{x}' for x in error['loc'])}: {error['msg']}") from None
    if args.type != "int":
        raise UsageError(f"{args.type} weights are not supported: elastic-oneshot writes int weights (fp8, fp4: no)")
    if not 2 <= args.num_bits <= 8:
        raise UsageError(f"{args.num_bits}-bit weights are not supported: use 2 to 8 bits")
    if args.strategy not in ("group", "channel"):
        raise UsageError(f"weights strategy {args.strategy!r} is not supported: use group or channel")
    if args.observer not in WEIGHT_OBSERVERS:
        raise UsageError(f"weight observer {args.observer!r} is not supported: memoryless_minmax only")
    return args


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
