"""QuantizationModifier (quantization/rtn.py) against llmcompressor 0.14's on a tiny real Llama: every layer's
compressed tensors bit for bit, for each weight strategy; static input scales from the unquantized model's inputs
(the peer propagates its QuantizationModifier's pass with quantization disabled and its weights unchanged)."""

import math

import pytest
import safetensors.torch
import torch

from elastic_oneshot.models.family import family_for
from elastic_oneshot.quantization import rtn
from elastic_oneshot.quantization.recipe import RTN
from elastic_oneshot.quantization.recipe_loader import read_recipe
from elastic_oneshot.quantization.schemes import input_qparams, static_inputs
from elastic_oneshot.testing.tiny import make_model
from tests.peer_modifiers import load, one_thread, record, run_peer, tokens  # noqa: F401 (a fixture)

PRESETS = ["W4A16", "W4A16_ASYM", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16", "FP8", "NVFP4"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama"), "llama")


def stage(preset: str) -> str:
    return f"q_stage:\n  q_modifiers:\n    QuantizationModifier: {{scheme: {preset}, ignore: [lm_head]}}\n"


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("preset", PRESETS)
def test_compressed_tensors_equal_the_peers(llama, preset, tmp_path):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = run_peer(llama, [QuantizationModifier(scheme=preset, ignore=["lm_head"])])
    model.save_pretrained(tmp_path, save_compressed=True)
    theirs = safetensors.torch.load_file(tmp_path / "model.safetensors")

    recipe = read_recipe(stage(preset))
    assert recipe.quantizer == RTN
    model = load(llama)
    family = family_for(model.config)
    schemes = recipe.module_schemes(model, family)
    # the inputs every layer sees: the model's own, unquantized, whatever the layers before did
    seen = record(model, tokens(llama), list(schemes)).inputs
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        names = [n.removeprefix(prefix) for n in schemes if n.startswith(prefix)]
        inputs = {}
        for name in names:
            if static_inputs(schemes[prefix + name]):
                x = torch.stack(seen[prefix + name])
                inputs[name] = input_qparams(schemes[prefix + name], torch.stack([x.amin(), x.amax()]), x.dtype)
        layer_modules = dict(layer.named_modules())
        ours = rtn.compress({n: layer_modules[n].weight for n in names}, {n: schemes[prefix + n] for n in names},
                            family.fused_scales, inputs)
        for name, tensors in ours.items():
            for key, value in tensors.items():
                other = theirs[f"{prefix}{name}.{key}"]
                assert value.dtype == other.dtype and torch.equal(value, other), f"{prefix}{name}.{key}"
        assert {k for k in theirs if k.startswith(prefix) and "proj" in k} == \
            {f"{prefix}{n}.{k}" for n, t in ours.items() for k in t}


def test_fake_quantize_is_what_the_compressor_stores():
    """Round to nearest as AWQ's grid evaluates it and as the checkpoint decompresses it agree."""
    from elastic_oneshot.quantization.packing import decompress_module

    g = torch.Generator().manual_seed(0)
    weights = {"mlp.gate_proj": torch.randn(64, 128, generator=g), "mlp.up_proj": torch.randn(64, 128, generator=g)}
    for preset in ("W4A16_ASYM", "NVFP4A16", "FP8_BLOCK"):
        recipe = read_recipe(stage(preset))
        scheme = recipe.schemes["group_0"]
        args = dict.fromkeys(weights, scheme.weights)
        q = rtn.qparams(weights, args, (("gate_proj", "up_proj"),))
        packed = rtn.compress(weights, dict.fromkeys(weights, scheme), (("gate_proj", "up_proj"),))
        for name, w in weights.items():
            expected = decompress_module(packed[name], scheme, torch.float32)
            assert torch.equal(rtn.fake_quantize(w, q[name], scheme.weights), expected), preset
        if preset == "NVFP4A16":  # gate and up share the global scale of both
            assert torch.equal(q["mlp.gate_proj"].global_scale, q["mlp.up_proj"].global_scale)
            assert not math.isclose(q["mlp.gate_proj"].global_scale.item(),
                                    rtn.qparams({"x": weights["mlp.gate_proj"] * 4}, {"x": scheme.weights}, ())[
                                        "x"].global_scale.item())
