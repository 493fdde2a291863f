"""Recipes of several modifiers, read as llmcompressor 0.14 reads them: YAML stages and modifier objects into the
stages before quantization and one quantization modifier, last, in the order the peer runs them; what is not read
here refused by name; the job identity of a GPTQ recipe unchanged."""

import json
import re

import pytest

from elastic_oneshot.errors import UsageError
from elastic_oneshot.quantization.recipe import AWQ, RTN, Recipe, SmoothQuant, SparseGPT
from elastic_oneshot.quantization.recipe_loader import READS, read_recipe

# Recipe().to_dict() as every job before stages existed wrote it into job.json's identity.
GPTQ_IDENTITY = {"scheme": "W4A16", "group_size": None, "symmetric": True, "actorder": "static",
                 "dampening_frac": 0.01, "block_size": 128, "targets": ("Linear",), "ignore": ("lm_head",)}

# llmcompressor's examples (examples/ in its repository), as YAML with two stages where it has them.
W8A8_SMOOTHQUANT = """\
smooth_stage:
  smoothing_modifiers:
    SmoothQuantModifier: {smoothing_strength: 0.8}
quant_stage:
  quant_modifiers:
    GPTQModifier: {scheme: W8A8, targets: Linear, ignore: [lm_head]}
"""
AWQ_W4A16 = """\
quant_stage:
  quant_modifiers:
    AWQModifier:
      mappings:
        - smooth_layer: re:.*input_layernorm$
          balance_layers: [re:.*q_proj$, re:.*k_proj$, re:.*v_proj$]
      duo_scaling: both
    QuantizationModifier: {scheme: W4A16_ASYM, targets: [Linear], ignore: [lm_head]}
"""
SPARSE_FP8 = """\
sparsity_stage:
  sparsity_modifiers:
    SparseGPTModifier: {sparsity: 0.5, mask_structure: "2:4", ignore: ["re:.*lm_head"]}
quantization_stage:
  quantization_modifiers:
    QuantizationModifier: {scheme: FP8_DYNAMIC, targets: [Linear], ignore: ["re:.*lm_head"]}
"""
PRUNE_SMOOTH_GPTQ = """\
prune_stage:
  prune_modifiers:
    SparseGPTModifier: {sparsity: 0.5, ignore: [lm_head]}
smooth_stage:
  smooth_modifiers:
    SmoothQuantModifier: {}
quant_stage:
  quant_modifiers:
    GPTQModifier: {scheme: FP8, ignore: [lm_head]}
"""
LOG_EQ = """\
quant_stage:
  quant_modifiers:
    LogarithmicEqualizationModifier:
      mappings: [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]]
    QuantizationModifier: {scheme: NVFP4, ignore: [lm_head]}
"""


def peer_order(recipe) -> list[str]:
    """The modifiers llmcompressor's own Recipe holds, in the order its independent pipeline runs them."""
    from llmcompressor.recipe import Recipe as PeerRecipe

    return [type(m).__name__ for m in PeerRecipe.create_instance(recipe).modifiers]


def test_a_gptq_recipe_keeps_its_job_identity():
    assert Recipe().to_dict() == GPTQ_IDENTITY
    preset = "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16, ignore: [lm_head]}\n"
    assert read_recipe(preset) == Recipe()
    assert read_recipe(preset).to_dict() == GPTQ_IDENTITY


@pytest.mark.parametrize("text, expected", [
    (W8A8_SMOOTHQUANT, Recipe(scheme="W8A8", stages=(SmoothQuant(smoothing_strength=0.8),))),
    (AWQ_W4A16, Recipe(scheme="W4A16", symmetric=False, actorder=None, quantizer=RTN, stages=(
        AWQ(mappings=(("re:.*input_layernorm$", ("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"), None),),
            duo_scaling="both"),))),
    (SPARSE_FP8, Recipe(scheme="FP8_DYNAMIC", actorder=None, quantizer=RTN, ignore=("re:.*lm_head",), stages=(
        SparseGPT(sparsity=0.5, mask_structure="2:4", ignore=("re:.*lm_head",)),))),
    (PRUNE_SMOOTH_GPTQ, Recipe(scheme="FP8", stages=(SparseGPT(sparsity=0.5, ignore=("lm_head",)), SmoothQuant()))),
    (LOG_EQ, Recipe(scheme="NVFP4", actorder=None, quantizer=RTN, stages=(SmoothQuant(
        algorithm="log_equalization", mappings=((("re:.*q_proj", "re:.*k_proj", "re:.*v_proj"),
                                                 "re:.*input_layernorm"),)),))),
])
def test_the_peers_examples_read_in_the_order_it_runs_them(text, expected):
    recipe = read_recipe(text)
    assert recipe == expected
    assert recipe.modifiers == [m.replace("LogarithmicEqualization", "SmoothQuant") for m in peer_order(text)]
    assert Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe  # job.json round trip


def test_modifier_objects_read_as_their_yaml():
    from llmcompressor.modifiers.awq import AWQModifier as DeprecatedAWQ
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    objects = [SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", targets="Linear",
                                                                         ignore=["lm_head"])]
    assert read_recipe(objects) == read_recipe(W8A8_SMOOTHQUANT)
    awq = [AWQModifier(duo_scaling="both", mappings=[{"smooth_layer": "re:.*input_layernorm$", "balance_layers": [
        "re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]}]),
        QuantizationModifier(scheme="W4A16_ASYM", targets=["Linear"], ignore=["lm_head"])]
    assert read_recipe(awq) == read_recipe(AWQ_W4A16)
    # llmcompressor 0.14 still takes the old AWQModifier(scheme=...), which returns [AWQ, QuantizationModifier]
    with pytest.warns(DeprecationWarning):
        old = DeprecatedAWQ(scheme="W4A16_ASYM", ignore=["lm_head"], duo_scaling="both", mappings=awq[0].mappings)
    assert read_recipe(old) == read_recipe(AWQ_W4A16)
    sparse = [SparseGPTModifier(sparsity=0.5, mask_structure="2:4", ignore=["re:.*lm_head"]),
              QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=["re:.*lm_head"])]
    assert read_recipe(sparse) == read_recipe(SPARSE_FP8)
    assert read_recipe(SparseGPTModifier(sparsity=0.5)) == Recipe(scheme=None, quantizer=None,
                                                                  stages=(SparseGPT(sparsity=0.5),))


def stage(modifiers: str) -> str:
    return "quant_stage:\n  quant_modifiers:\n" + "".join(f"    {line}\n" for line in modifiers.splitlines())


@pytest.mark.parametrize("modifiers, message", [
    *[(f"{name}: {{}}\nGPTQModifier: {{scheme: W4A16}}", f"{name} is not supported: elastic-oneshot runs "
       + ", ".join(READS)) for name in ("QuIPModifier", "SpinQuantModifier", "AutoRoundModifier",
                                         "WandaPruningModifier", "REAPPruningModifier", "ConstantPruningModifier")],
    ("QuantizationModifier: {scheme: FP8, kv_cache_scheme: {num_bits: 8, type: float}}",
     "QuantizationModifier kv_cache_scheme is not supported"),
    ("AWQModifier: {}", "AWQModifier needs a quantization modifier after it"),
    ("GPTQModifier: {scheme: W4A16}\nSmoothQuantModifier: {}", "SmoothQuantModifier after GPTQModifier is not "
     "supported: the quantization modifier runs last"),
    ("QuantizationModifier: {scheme: W4A16}\nGPTQModifier: {scheme: W4A16}", "2 quantization modifiers"),
    ("AWQModifier: {scheme: W4A16_ASYM}", "AWQModifier argument 'scheme' is not supported: in llmcompressor 0.14 "
     "AWQ is a transform"),
    ("AWQModifier: {duo_scaling: sometimes}\nQuantizationModifier: {scheme: W4A16}", "AWQModifier takes duo_scaling"),
    ("AWQModifier: {n_grid: 2}\nQuantizationModifier: {scheme: W4A16}", "AWQModifier takes duo_scaling"),
    ("AWQModifier: {mappings: [{smooth_layer: a}]}\nQuantizationModifier: {scheme: W4A16}", "AWQModifier mapping"),
    ("SmoothQuantModifier: {smoothing_strength: 1.5}", "SmoothQuantModifier takes smoothing_strength in [0, 1]"),
    ("SmoothQuantModifier: {mappings: [[re:.*q_proj]]}", "SmoothQuantModifier mapping"),
    ("SparseGPTModifier: {sparsity: 0.5, mask_structure: 2-4}", "mask_structure '2-4': expected 0:0 or N:M"),
    ("SparseGPTModifier: {sparsity: 0.5, mask_structure: '5:4'}", "SparseGPTModifier takes sparsity in [0, 1)"),
    ("SparseGPTModifier: {sparsity: [0.5, 0.6]}", "per-layer lists are not supported"),
    ("SparseGPTModifier: {sparsity: 0.5, sparsity_profile: owl, owl_m: 5, owl_lmbda: 0.1}",
     "sparsity_profile (OWL) and preserve_sparsity_mask are not supported"),
    ("SparseGPTModifier: {sparsity: 0.5, preserve_sparsity_mask: true}", "preserve_sparsity_mask are not supported"),
    ("SparseGPTModifier: {sparsity: 0.5, sequential_update: true, owl: 1}", "SparseGPTModifier argument 'owl'"),
])
def test_what_is_not_run_as_the_peer_runs_it_is_refused_in_one_line(modifiers, message):
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        read_recipe(stage(modifiers))
    assert "\n" not in str(e.value)


def test_an_unknown_modifier_is_refused_before_its_arguments_are_read():
    with pytest.raises(UsageError, match="^SpinQuantModifier is not supported"):
        read_recipe(stage("GPTQModifier: {scheme: W4A16, bogus: 1}\nSpinQuantModifier: {rotations: [R1]}"))


def test_what_needs_calibration_data():
    """Round to nearest of weights, with dynamic or no input activations, runs no forward pass (the peer's
    data-free pipeline); static input scales, GPTQ and every stage need the calibration data."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    rtn = "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {{scheme: {}, ignore: [lm_head]}}\n"
    presets = ("W4A16", "FP8_DYNAMIC", "NVFP4A16", "MXFP4", "W8A8", "FP8_BLOCK", "FP8", "NVFP4")
    assert [read_recipe(rtn.format(s)).calibrates for s in presets] == \
        [QuantizationModifier(scheme=s).requires_calibration_data for s in presets] == [False] * 6 + [True] * 2
    assert Recipe().calibrates and read_recipe(SPARSE_FP8).calibrates and read_recipe(AWQ_W4A16).calibrates
