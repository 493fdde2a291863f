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


def _special(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random weights with the values that rounding treats apart: signed zeros, subnormals, ties, values past the
    code range, infinities and NaN."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 2, rows).unsqueeze(1)
    w.view(-1)[:10] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 0.5, -2.5, 3e38, -3e38, math.inf, math.nan])
    return w.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.numel(), dtype=t.dtype).copy_(t.flatten()).view(torch.uint8)  # (any strides)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_host_path_gives_the_compressors_bits(dtype, monkeypatch):
    """packing._compress (the naive compressors' codes, slice by slice of rows, FP8 cast straight) against
    compressed-tensors' own compress, bit for bit (bfloat16's round trip through the weight dtype drops NaN's
    sign), with every FP8 code among the weights. Rows that the slices do not divide; per-channel and per-tensor
    scales; symmetric and asymmetric."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    from elastic_oneshot.quantization import packing
    from elastic_oneshot.quantization.gptq import QParams
    from elastic_oneshot.quantization.schemes import compressor

    monkeypatch.setattr(packing, "ROWS_ELEMENTS", 3 * 64)  # slices of 3 rows of 64 columns
    asym = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", strategy="channel",
                                                                            symmetric=False))
    schemes = [preset_name_to_scheme(p, ["Linear"]) for p in ("FP8_DYNAMIC", "FP8", "W8A8")] + [asym]
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    for scheme in schemes:
        for weight in (_special(40, 64, dtype), codes.reshape(4, 64).to(dtype)):
            if weight.isnan().any() and scheme.weights.type == "int":
                weight = weight.nan_to_num()  # (NaN to an integer type is undefined)
            q = QParams(*rtn.qparams({"m": weight.nan_to_num()}, {"m": scheme.weights}, ())["m"][:2])
            if weight.shape[0] == 4:  # each code against a scale of one
                q = QParams(torch.ones_like(q.scale), torch.zeros_like(q.zero_point))
            ours = packing.compress_module(weight, q, {}, scheme)
            state = {"weight": weight, "weight_scale": q.scale.to(dtype),
                     "weight_zero_point": q.zero_point.to(scheme.weights.zp_dtype)}
            theirs = compressor(scheme).compress(state, scheme)
            assert ours.keys() == theirs.keys()
            for key in ours:
                a, b = ours[key], theirs[key]
                assert a.dtype == b.dtype and a.shape == b.shape, key
                assert torch.equal(_bits(a), _bits(b)), (scheme.weights.type, scheme.weights.strategy, key)
            if weight.shape[0] == 4 and scheme.weights.type == "float":  # every code as itself, but the sign of
                every = torch.arange(256, dtype=torch.uint8)  # zero (the zero point's addition) and of NaN
                assert ((ours["weight"].view(torch.uint8).flatten() == every) | (every == 0x80) | (every == 0xFF)).all()
