"""Every scheme of llmcompressor 0.14's GPTQ against it on the same tokens: the quantized values, the static
activation scales and the quantization_config; the checkpoints load in transformers; W=2 writes W=1's bytes;
a recipe of two config groups round-trips."""

import json
import os

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from elastic_oneshot.loop.data import heldout_samples
from elastic_oneshot.surface.evaluate import perplexity
from elastic_oneshot.testing.peer import run_peer
from elastic_oneshot.testing.runs import run_world, tree_digest
from elastic_oneshot.testing.tiny import make_model

SCHEMES = ["W8A8", "W4A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4", "NVFP4A16", "MXFP4"]
SAMPLES, SEQ = 16, 64
JOB = ["--num-samples", SAMPLES, "--seq-len", SEQ, "--chunk-size", 8]  # two chunks: W=2 splits calibration
STATIC = ("input_scale", "input_global_scale")  # activation scales observed during calibration
MIXED = r"""
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        attention:
          targets: ['re:.*self_attn\.(q|k|v|o)_proj$']
          weights: {num_bits: 8, type: float, symmetric: true, strategy: tensor}
          input_activations: {num_bits: 8, type: float, symmetric: true, strategy: tensor, dynamic: false,
                              observer: static_minmax}
        mlp:
          targets: ['re:.*mlp\.(gate|up|down)_proj$']
          weights: {num_bits: 4, type: float, symmetric: true, strategy: tensor_group, group_size: 16,
                    scale_dtype: torch.float8_e4m3fn}
          input_activations: {num_bits: 4, type: float, symmetric: true, strategy: tensor_group, group_size: 16,
                              dynamic: local, observer: static_minmax, scale_dtype: torch.float8_e4m3fn}
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama with as many key-value heads as heads: every Linear's sides are multiples of 128, so
    FP8_BLOCK's 128 x 128 blocks, NVFP4's groups of 16 and MXFP4's of 32 all fit."""
    return make_model(str(tmp_path_factory.mktemp("models") / "llama"), "llama", num_hidden_layers=2,
                      num_key_value_heads=4)


@pytest.fixture(scope="module")
def pair(llama, tmp_path_factory):
    """(ours, peer) checkpoints of a preset name or "mixed" (the MIXED recipe file), each made once."""
    made = {}

    def make(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            if name == "mixed":
                recipe = root / "recipe.yaml"
                recipe.write_text(MIXED)
                args, scheme = ["--recipe", recipe], yaml.safe_load(MIXED)["quant_stage"]["quant_modifiers"][
                    "GPTQModifier"]["config_groups"]
            else:
                args, scheme = ["--scheme", name], name
            run_world(1, llama, root / "ours", [*args, *JOB])
            made[name] = str(root / "ours"), run_peer(llama, str(root / "peer"), SAMPLES, SEQ, scheme=scheme)
        return made[name]
    return make


def codes(path) -> tuple[dict, dict]:
    """The stored codes of every quantized weight (int8, fp8 as bytes, packed fp4 as nibbles), and every tensor."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight_packed"):
            out[key] = torch.stack((t & 15, t >> 4), -1)
        elif key.endswith(".weight") and t.dtype in (torch.int8, torch.float8_e4m3fn):
            out[key] = t.view(torch.uint8)
    return out, tensors


def quantization_config(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["quantization_config"]


def flat(d: dict, prefix: str = "") -> dict:
    return {key: value for k, v in d.items()
            for key, value in (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(prefix + k, v)])}


def check_parity(name: str, ours: str, peer: str, modules: int):
    a, ta = codes(ours)
    b, tb = codes(peer)
    assert a.keys() == b.keys() and len(a) == modules
    assert {k: a[k].shape for k in a} == {k: b[k].shape for k in b}
    same = sum((a[k] == b[k]).sum().item() for k in a) / sum(v.numel() for v in a.values())
    print(f"\n{name}: quantized weight values identical to llmcompressor 0.14: {same:.4%}")
    assert same >= 0.99
    assert ta.keys() == tb.keys()
    for k in ta.keys() - a.keys():
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        if not k.endswith(STATIC):
            assert torch.allclose(ta[k].float(), tb[k].float(), rtol=1e-3), k
    static = sorted(k for k in ta if k.endswith(STATIC))
    if static:
        error = {k: ((ta[k] - tb[k]).abs() / tb[k].abs()).max().item() for k in static}
        print(f"  {len(static)} static activation scales, largest relative difference {max(error.values()):.2e}")
        assert max(error.values()) <= 1e-5, error
    q1, q2 = quantization_config(ours), quantization_config(peer)
    q1["ignore"], q2["ignore"] = sorted(q1.get("ignore") or []), sorted(q2.get("ignore") or [])
    f1, f2 = flat(q1), flat(q2)
    diff = {k: (f1.get(k, "<missing>"), f2.get(k, "<missing>")) for k in f1.keys() | f2.keys()
            if f1.get(k, "<missing>") != f2.get(k, "<missing>")}
    assert not diff, "quantization_config differs (ours, peer):\n" + "\n".join(
        f"  {k}: {v[0]!r} != {v[1]!r}" for k, v in sorted(diff.items()))


def check_loads(ours: str, peer: str):
    """Ours loads and generates in transformers, with logits near the peer's. compressed-tensors decompresses
    every format here on CPU, but its fp4 formats to bfloat16 weights, which a float32 model cannot multiply:
    those load in bfloat16."""
    fp4 = quantization_config(ours)["format"] in ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mixed-precision")
    dtype = torch.bfloat16 if fp4 else torch.float32
    models = [transformers.AutoModelForCausalLM.from_pretrained(p, dtype=dtype) for p in (ours, peer)]
    ids = heldout_samples("builtin", transformers.AutoTokenizer.from_pretrained(ours), 2, SEQ)
    with torch.no_grad():
        mine, theirs = (m(input_ids=ids).logits.float() for m in models)
    error = torch.linalg.norm(mine - theirs) / torch.linalg.norm(theirs)
    ppl = [perplexity(p, "builtin", 2, SEQ) for p in (ours, peer)]  # as `elastic-oneshot eval` loads it
    print(f"\nlogits relative to the peer's: {error:.4f}; perplexity ratio {ppl[0] / ppl[1]:.4f}")
    assert mine.isfinite().all() and error < 0.05 and abs(ppl[0] / ppl[1] - 1) < 0.02
    assert models[0].generate(input_ids=ids[:1, :8], max_new_tokens=4, do_sample=False).shape == (1, 12)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_parity_with_llmcompressor(scheme, pair):
    check_parity(scheme, *pair(scheme), modules=2 * 7)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_loads_in_transformers(scheme, pair):
    check_loads(*pair(scheme))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("scheme", ["FP8", "NVFP4"])
def test_world_of_two_writes_the_bytes_of_one(scheme, pair, llama, tmp_path):
    """Static activation scales too: each rank observes its own chunks, and the reduction does not depend on W."""
    ours, _ = pair(scheme)
    run_world(2, llama, tmp_path / "w2", ["--scheme", scheme, *JOB])
    assert tree_digest(tmp_path / "w2") == tree_digest(ours)


@pytest.mark.slow
def test_mixed_recipe_round_trips(pair):
    """FP8 attention and NVFP4 MLP from one recipe file: both groups in the config, each module in its format."""
    ours, peer = pair("mixed")
    config = quantization_config(ours)
    assert config["format"] == "mixed-precision"  # groups renamed group_0, group_1 as the peer names them
    assert sorted(g["format"] for g in config["config_groups"].values()) == ["float-quantized", "nvfp4-pack-quantized"]
    check_parity("FP8 attention + NVFP4 MLP", ours, peer, modules=2 * 7)
    check_loads(ours, peer)
