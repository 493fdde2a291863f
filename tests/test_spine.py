"""End to end in one process: parity with llmcompressor, and checkpoints transformers can load."""

import json
import os

import pytest
import torch
import transformers
from compressed_tensors.quantization import fake_quantize
from safetensors.torch import load_file

from elastic_oneshot import oneshot
from elastic_oneshot.loop.data import heldout_samples
from elastic_oneshot.quantization import gptq
from elastic_oneshot.quantization.recipe import Recipe
from elastic_oneshot.testing.peer import run_peer
from elastic_oneshot.testing.runs import int_codes
from elastic_oneshot.testing.tiny import make_model

SAMPLES, SEQ, GROUP = 32, 128, 128


@pytest.fixture(scope="module")
def ours(tiny_llama, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ours") / "out")
    # One chunk: within a chunk Hessian terms are summed as the peer sums them.
    return oneshot(model=tiny_llama, num_calibration_samples=SAMPLES, max_seq_length=SEQ, group_size=GROUP,
                   output_dir=out, chunk_size=SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("group_size", [GROUP, 64])
def test_parity_with_llmcompressor(tiny_llama, ours, group_size, tmp_path):
    if group_size != GROUP:
        ours = oneshot(model=tiny_llama, num_calibration_samples=SAMPLES, max_seq_length=SEQ,
                       group_size=group_size, output_dir=str(tmp_path / "ours"), chunk_size=SAMPLES)
    theirs = run_peer(tiny_llama, str(tmp_path / "peer"), SAMPLES, SEQ, group_size)
    a, ta = int_codes(ours)
    b, tb = int_codes(theirs)
    assert a.keys() == b.keys() and len(a) == 4 * 7
    same = sum((a[k] == b[k]).sum().item() for k in a) / sum(v.numel() for v in a.values())
    print(f"\nint codes identical to llmcompressor 0.14 (group {group_size}): {same:.4%}")
    assert same >= 0.99
    assert set(ta) == set(tb)
    for k in ta:
        if k.endswith("weight_scale"):
            assert torch.allclose(ta[k], tb[k], rtol=1e-3), k
    with open(os.path.join(ours, "config.json")) as f1, open(os.path.join(theirs, "config.json")) as f2:
        q1, q2 = json.load(f1)["quantization_config"], json.load(f2)["quantization_config"]
    assert q1 == q2


def test_round_trip_through_transformers(tiny_llama, ours):
    tokenizer = transformers.AutoTokenizer.from_pretrained(ours)
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(ours)
    with open(os.path.join(ours, "config.json")) as f:
        cfg = json.load(f)["quantization_config"]
    assert {"config_groups", "format", "ignore", "quant_method", "quantization_status", "version"} <= set(cfg)
    assert cfg["format"] == "pack-quantized" and cfg["quant_method"] == "compressed-tensors"
    assert cfg["config_groups"]["group_0"]["weights"]["group_size"] == GROUP
    ids = heldout_samples("builtin", tokenizer, 4, SEQ)
    rtn = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    args = Recipe(group_size=GROUP).weights
    for name, module in rtn.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            scale, zp = gptq.qparams(module.weight.data, args)
            module.weight.data = fake_quantize(module.weight.data, scale, zp, args)
    with torch.no_grad():
        lo, lq, lr = (m(input_ids=ids).logits for m in (original, quantized, rtn))
    err, err_rtn = (torch.linalg.norm(x - lo) / torch.linalg.norm(lo) for x in (lq, lr))
    print(f"\nrelative logit error: GPTQ {err:.4f}, round-to-nearest {err_rtn:.4f}")
    assert 0 < err < err_rtn < 1
    out = quantized.generate(input_ids=ids[:1, :16], max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 24)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_other_architectures(arch, tmp_path):
    model = make_model(str(tmp_path / arch), arch)
    out = oneshot(model=model, num_calibration_samples=8, max_seq_length=64, group_size=32,
                  output_dir=str(tmp_path / "out"))
    codes, tensors = int_codes(out)
    assert len(codes) == 2 * 7
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 300, (1, 10))
    assert loaded.generate(input_ids=ids, max_new_tokens=4, do_sample=False).shape == (1, 14)
    embed = "model.embed_tokens.weight"
    assert torch.equal(tensors[embed], load_file(os.path.join(model, "model.safetensors"))[embed])
