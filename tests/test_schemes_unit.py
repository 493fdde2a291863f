"""Every weight strategy of every preset, in process: our GPTQ against llmcompressor 0.14's `quantize_weight` with its
observer's qparams on the same weight and Hessian, any row split, the compressors' round trip; recipes with several
config groups, and static input activations' qparams against the peer's observer."""

import json

import pytest
import torch
import transformers
from compressed_tensors.quantization import preset_name_to_scheme

from elastic_oneshot.errors import UsageError
from elastic_oneshot.models.family import Family, family_for
from elastic_oneshot.quantization import gptq
from elastic_oneshot.quantization.packing import compress_module, decompress_module
from elastic_oneshot.quantization.recipe import Recipe
from elastic_oneshot.quantization.recipe_loader import read_recipe
from elastic_oneshot.quantization.schemes import PRESETS as ALL_PRESETS
from elastic_oneshot.quantization.schemes import input_qparams
from elastic_oneshot.surface.cli import SCHEMES

# One preset per weight strategy and number type (W4A16_ASYM: zero points).
PRESETS = ["W4A16", "W4A16_ASYM", "W8A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4", "MXFP4", "MXFP8"]


def problem(rows: int = 160, cols: int = 256, seed: int = 0):
    """A weight with outlier columns and a Hessian with a spread diagonal (activation order matters)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[:, :3] *= 8
    x = torch.randn(4 * cols, cols, generator=g) * torch.linspace(0.2, 3, cols)
    return w, 2 * x.t() @ x / x.shape[0]


def args_of(preset: str):
    weights = preset_name_to_scheme(preset, ["Linear"]).weights
    weights.actorder = "static"
    return weights


def peer_quantize(w, h, args):
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.observers import Observer

    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(w)
    q = observer.get_qparams()
    g = None if q["global_scale"] is None else q["global_scale"].reshape(1)
    out, _, _ = quantize_weight(w[None].clone(), h[None].clone(), q["scale"][None], q["zero_point"][None], g, args)
    return out[0], q


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_solve_equals_the_peer(preset):
    w, h = problem()
    args = args_of(preset)
    theirs, q = peer_quantize(w, h, args)
    ours, mine, _ = gptq.quantize(w, h, args)
    assert torch.equal(mine.scale, q["scale"]) and torch.equal(mine.zero_point, q["zero_point"])
    assert (mine.global_scale is None) == (q["global_scale"] is None)
    same = (ours == theirs).float().mean().item()
    print(f"\n{preset}: {100 * same:.2f} % of weight values identical to the peer's")
    assert same == 1.0
    assert not torch.equal(ours, w)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_row_slices_solve_alone(preset):
    w, h = problem(rows=192)
    args = args_of(preset)
    whole, q, prep = gptq.quantize(w, h, args)
    scale, zp = gptq.row_qparams(q, args, w.shape[0])
    parts = [gptq.solve(w[None, lo:hi], prep, args, 128, scale[None, lo:hi], None if zp is None else zp[None, lo:hi])
             for lo, hi in ((0, 37), (37, 130), (130, 192))]
    assert torch.equal(torch.cat(parts, dim=1)[0], whole)


def test_fused_modules_share_one_global_scale():
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.gate_proj, layer.mlp.up_proj = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    layer.mlp.down_proj = torch.nn.Linear(32, 64)
    with torch.no_grad():
        layer.mlp.up_proj.weight[0, 0] = 7.0  # the fusion group's maximum
    args = args_of("NVFP4")
    names = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    q = gptq.module_qparams(dict(layer.named_modules()), dict.fromkeys(names, args), Family.fused_scales)
    assert torch.equal(q["mlp.gate_proj"].global_scale, q["mlp.up_proj"].global_scale)
    assert torch.equal(q["mlp.up_proj"].global_scale, gptq.global_scale([torch.full((1,), 7.0)], args))
    assert not torch.equal(q["mlp.down_proj"].global_scale, q["mlp.up_proj"].global_scale)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_compressors_give_back_the_solved_weight(preset):
    w, h = problem()
    scheme = Recipe(scheme=preset.replace("W4A16_ASYM", "W4A16"), symmetric=preset != "W4A16_ASYM").schemes["group_0"]
    solved, q, _ = gptq.quantize(w, h, scheme.weights)
    inputs = {"input_scale": torch.ones(1)} if preset == "FP8" else \
        {"input_global_scale": torch.full((1,), 3.0)} if preset == "NVFP4" else {}
    packed = compress_module(solved, q, inputs, scheme)
    assert set(inputs) <= set(packed)
    assert torch.equal(decompress_module(packed, scheme, solved.dtype), solved)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheme="FP8", group_size=64), "--group-size applies to int weights"),
    (dict(scheme="NVFP4", symmetric=False), "--asym applies to int weights"),
    (dict(scheme="UNQUANTIZED"), "unknown scheme"),
])
def test_overrides_that_do_not_apply_are_refused(kwargs, message):
    with pytest.raises(UsageError, match=message):
        Recipe(**kwargs)


MIXED = {"attention": {"targets": ["re:.*self_attn.*"],
                       "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                       "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                             "observer": "static_minmax"}},
         "mlp": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                        "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"}}}


def skeleton():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def stage(modifier: str) -> str:
    return "quant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      ignore: [lm_head]\n      " + modifier


def test_mixed_recipe_round_trips_and_writes_the_peers_config():
    recipe = read_recipe(stage(f"config_groups: {json.dumps(MIXED)}"))
    assert recipe.scheme == "custom" and Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    model = skeleton()
    schemes = recipe.module_schemes(model, family_for(model.config))
    assert len(schemes) == 14 and schemes["model.layers.0.mlp.up_proj"].weights.strategy == "tensor_group"
    config = recipe.quantization_config(model, schemes)
    assert config.format == "mixed-precision" and config.ignore == ["lm_head"]
    assert [g.format for g in config.config_groups.values()] == ["float-quantized", "nvfp4-pack-quantized"]
    assert config.config_groups["group_0"].weights.observer == "memoryless_minmax"
    assert config.config_groups["group_0"].weights.actorder == "static"


def test_presets_keep_the_job_identity():
    assert "config_groups" not in Recipe().to_dict()  # the W4A16 job's fingerprint is what it was
    assert read_recipe(stage("scheme: NVFP4")) == Recipe(scheme="NVFP4")
    assert read_recipe(stage("scheme: INT8")) == Recipe(scheme="W8A8")
    assert Recipe(scheme="W8A8").weights.strategy == "channel"
    assert tuple(SCHEMES) == ALL_PRESETS and "FP8_BLOCK" in SCHEMES  # the command line's are compressed-tensors'


@pytest.mark.parametrize("groups, message", [
    ({"a": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}},
      "b": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "type": "float"}}},
     "matched by config groups a and b"),
    ({"a": {"targets": ["re:.*q_proj"], "weights": {"num_bits": 8, "type": "float"}},
      "b": {"targets": ["re:.*[kv]_proj"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}},
     "share their input but not their config group"),
])
def test_conflicting_groups_are_refused(groups, message):
    recipe = read_recipe(stage(f"config_groups: {json.dumps(groups)}"))
    with pytest.raises(UsageError, match=message):
        recipe.module_schemes(skeleton(), Family())


@pytest.mark.parametrize("preset", ["FP8", "NVFP4"])
def test_static_input_qparams_equal_the_peers_observer(preset):
    from llmcompressor.observers import Observer

    scheme = Recipe(scheme=preset).schemes["group_0"]
    observer = Observer.load_from_registry("static_minmax", base_name="input", args=scheme.input_activations)
    batches = [torch.randn(2, 8, 64) * s for s in (0.5, 3.0, 1.0)]
    for x in batches:
        observer(x)
    stats = torch.stack([torch.stack(batches).amin(), torch.stack(batches).amax()])
    ours = input_qparams(scheme, stats, torch.float32)
    theirs = observer.get_qparams()
    if preset == "FP8":
        assert torch.equal(ours["input_scale"], theirs["scale"]) and set(ours) == {"input_scale", "input_zero_point"}
    else:
        assert set(ours) == {"input_global_scale"} and torch.equal(ours["input_global_scale"], theirs["global_scale"])
