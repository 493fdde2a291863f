"""The recipes of issue 46's table (llmcompressor 0.14's own examples: SmoothQuant + GPTQ W8A8, FP8_DYNAMIC, NVFP4,
AWQ + W4A16_ASYM, 2:4 SparseGPT + FP8_DYNAMIC, GPTQ W4A16) as the YAML our CLI reads and as the peer's modifier
objects read from the same YAML: the cases of the parity and resume tests and of bench/recipes.py."""

import json

# name -> the modifiers, as YAML lines; {ignore} is the quantizer's ignore list, {sparse_ignore} SparseGPT's (the
# peer's SparseGPT matches lm_head's name with a dot after it: only a regex ignores it); {w4a16} and {w4a16_asym} the
# presets, or at another group size than theirs (SmolLM2's 576 columns) their config groups
RECIPES = {
    "smoothquant_w8a8": ["SmoothQuantModifier: {{smoothing_strength: 0.8}}",
                         "GPTQModifier: {{scheme: W8A8, targets: [Linear], ignore: {ignore}}}"],
    "fp8_dynamic": ["QuantizationModifier: {{scheme: FP8_DYNAMIC, targets: [Linear], ignore: {ignore}}}"],
    "nvfp4": ["QuantizationModifier: {{scheme: NVFP4, targets: [Linear], ignore: {ignore}}}"],
    "awq_w4a16_asym": ["AWQModifier: {{}}", "QuantizationModifier: {{{w4a16_asym}, ignore: {ignore}}}"],
    "sparse_2of4_fp8": ["SparseGPTModifier: {{sparsity: 0.5, mask_structure: '2:4', ignore: {sparse_ignore}}}",
                        "QuantizationModifier: {{scheme: FP8_DYNAMIC, targets: [Linear], ignore: {ignore}}}"],
    "w4a16": ["GPTQModifier: {{{w4a16}, ignore: {ignore}}}"],
}


def recipe_yaml(name: str, moe: bool = False, group: int = 128) -> str:
    ignore = ["lm_head"] + (["re:.*mlp.gate$"] if moe else [])
    w4 = {sym: ("scheme: W4A16" + ("" if sym else "_ASYM")) if group == 128 else
          "config_groups: {group_0: {targets: [Linear], weights: {num_bits: 4, type: int, symmetric: "
          f"{str(sym).lower()}, strategy: group, group_size: {group}}}}}}}" for sym in (True, False)}
    lines = [line.format(ignore=json.dumps(ignore), sparse_ignore=json.dumps(["re:.*lm_head", *ignore[1:]]),
                         w4a16=w4[True], w4a16_asym=w4[False]) for line in RECIPES[name]]
    return "recipe_stage:\n  recipe_modifiers:\n" + "".join(f"    {line}\n" for line in lines)


def peer_recipe(name: str, moe: bool = False, group: int = 128):
    """The peer's modifiers of the same recipe, read from the same YAML by llmcompressor itself."""
    from llmcompressor.recipe import Recipe

    return Recipe.create_instance(recipe_yaml(name, moe, group)).modifiers
