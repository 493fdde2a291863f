"""Mixture of experts (Qwen3-MoE): all-expert calibration, parity with llmcompressor, restarts, round trip."""

import logging
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
import transformers

from elastic_oneshot import oneshot
from elastic_oneshot.loop.data import heldout_samples
from elastic_oneshot.models.moe import Experts, _routed, streamed
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.testing.peer import run_peer
from elastic_oneshot.testing.recipes import recipe_yaml
from elastic_oneshot.testing.runs import (
    assert_same_bits,
    int_codes,
    one_thread_env,
    run_cli,
    torchrun_cmd,
    tree_digest,
    workers,
)
from elastic_oneshot.testing.tiny import make_moe, make_tiny, make_tiny_multimodal

SAMPLES, SEQ, GROUP = 16, 128, 32


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return make_moe(str(tmp_path_factory.mktemp("models") / "moe"))


@pytest.mark.slow
@pytest.mark.parametrize("all_experts", [True, False])
def test_calibration_block_output_equals_original(tiny_moe, all_experts):
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe).model.layers[0].mlp
    ours = SourceModel(tiny_moe).load_layer(0).mlp
    assert isinstance(ours.experts, Experts) and len(ours.experts) == 8
    ours.experts.all_experts = all_experts
    x = torch.randn(3, 40, 128)
    with torch.no_grad():
        expected, got = original(x), ours(x)
    print(f"\nall_experts={all_experts}: max |difference| {(expected - got).abs().max().item():.2e}")
    assert torch.allclose(expected, got, rtol=0, atol=1e-6)


@pytest.mark.parametrize("all_experts", [True, False])
@pytest.mark.parametrize("model_type", ["gpt_oss", "granitemoe", "llama4"])
def test_experts_stored_fused_reproduce_the_block_bitwise(model_type, all_experts, tmp_path):
    """GPT-OSS stores its experts fused and transposed, gate and up interleaved, with biases, gated by a clamped
    SwiGLU; GraniteMoE fused as (out, in); Llama 4 transposed, its container called with the tokens repeated
    once per expert. Split per expert from the checkpoint, the block's output is the original's bit for bit
    (GPT-OSS's clamp engaged)."""
    if model_type == "llama4":
        model = make_tiny_multimodal(str(tmp_path / model_type), model_type)
        original = transformers.AutoModelForImageTextToText.from_pretrained(model).language_model.model
    else:
        model = make_tiny(str(tmp_path / model_type), model_type, moe=True)
        original = transformers.AutoModelForCausalLM.from_pretrained(model).model
    block = {"gpt_oss": "mlp", "granitemoe": "block_sparse_moe", "llama4": "feed_forward"}[model_type]
    original = getattr(original.layers[0], block)
    ours = getattr(SourceModel(model).load_layer(0), block)
    assert isinstance(ours.experts, Experts) and len(ours.experts) == 4
    ours.experts.all_experts = all_experts
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0)) * 10
    if model_type == "gpt_oss":
        fused = x.reshape(-1, 64) @ original.experts.gate_up_proj[0] + original.experts.gate_up_proj_bias[0]
        assert (fused.abs() > original.experts.limit).float().mean() > 0.1
    with torch.no_grad():
        expected, got = original(x), ours(x)
    expected, got = (expected[0], got[0]) if isinstance(expected, tuple) else (expected, got)
    assert torch.equal(expected, got)


def test_routing_gives_each_experts_slots_and_tokens_in_the_searched_order():
    """moe._routed (one sort and one count) gives what a search per expert gives: each expert's top-k slots and
    tokens in slot-then-token order (the order its rows are computed and added in), empty for experts no token
    chose."""
    g = torch.Generator().manual_seed(0)
    for tokens, k, experts in [(40, 2, 8), (300, 8, 64), (1, 1, 4)]:
        index = torch.stack([torch.randperm(experts // 2, generator=g)[:k] for _ in range(tokens)])  # half unused
        hit = torch.nn.functional.one_hot(index, experts).permute(2, 1, 0)
        for e, (slots, ids) in enumerate(_routed(index, experts)):
            want_slots, want_ids = torch.where(hit[e])
            assert torch.equal(slots, want_slots) and torch.equal(ids, want_ids)


@pytest.fixture(scope="module")
def ours(tiny_moe, tmp_path_factory):
    return oneshot(model=tiny_moe, num_calibration_samples=SAMPLES, max_seq_length=SEQ, group_size=GROUP,
                   chunk_size=SAMPLES, output_dir=str(tmp_path_factory.mktemp("ours") / "out"))


@pytest.mark.slow
def test_parity_with_llmcompressor_qwen3_moe(tmp_path):
    """llmcompressor 0.14's traced pipeline calibrates Qwen3-MoE layers with bidirectional attention here
    (its o_proj inputs equal a non-causal attention's, to 4e-7); ours is causal, as the model is. To
    compare the MoE calibration itself, the attention outputs are zeroed (o_proj = 0), so that attention
    contributes nothing either way and every expert sees the same tokens in both."""
    model = make_moe(str(tmp_path / "moe"), attention=False)
    ours = oneshot(model=model, num_calibration_samples=SAMPLES, max_seq_length=SEQ, group_size=GROUP,
                   chunk_size=SAMPLES, output_dir=str(tmp_path / "ours"))
    a, _ = int_codes(ours)
    b, _ = int_codes(run_peer(model, str(tmp_path / "peer"), SAMPLES, SEQ, GROUP, moe=True))
    assert a.keys() == b.keys() and len(a) == 2 * (4 + 3 * 8)
    same = sum((a[k] == b[k]).sum().item() for k in a) / sum(v.numel() for v in a.values())
    print(f"\nQwen3-MoE int codes identical to llmcompressor 0.14: {same:.4%}")
    assert same >= 0.99


def test_moe_checkpoint_round_trips_through_transformers(tiny_moe, ours):
    import json

    with open(os.path.join(ours, "config.json")) as f:
        ignore = json.load(f)["quantization_config"]["ignore"]
    assert ignore == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]  # routers stay dense
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_moe)
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(ours)
    ids = heldout_samples("builtin", tokenizer, 2, SEQ)
    with torch.no_grad():
        lo, lq = original(input_ids=ids).logits, quantized(input_ids=ids).logits
    err = (torch.linalg.norm(lq - lo) / torch.linalg.norm(lo)).item()
    print(f"\nrelative logit error of the quantized MoE: {err:.4f}")
    assert 0 < err < 0.6
    assert quantized.generate(input_ids=ids[:1, :8], max_new_tokens=4, do_sample=False).shape == (1, 12)


@pytest.mark.parametrize("max_memory, all_experts", [("2MB", True), ("1MB", False)])
def test_experts_in_batches_under_max_memory_give_the_same_bits(tiny_moe, ours, tmp_path, caplog, max_memory,
                                                                 all_experts):
    """--max-memory below one layer's Hessians: each layer is calibrated and solved a batch of groups at a time
    (one more pass over its inputs per batch); below twice its weights, under routed calibration, its experts are
    streamed too (read with their batch, and one at a time, decompressed, for propagation and replay). The
    checkpoint is the one of a single batch, and so is a rerun of layer 1 whose inputs are replayed through the
    streamed layer 0."""
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    job = dict(model=tiny_moe, num_calibration_samples=SAMPLES, max_seq_length=SEQ, group_size=GROUP,
               chunk_size=SAMPLES, moe_calibrate_all_experts=all_experts)
    whole = ours if all_experts else oneshot(**job, output_dir=str(tmp_path / "whole"))  # one batch, held whole
    job.update(output_dir=out, state_dir=state, max_memory=max_memory, boundary_every=0)
    stream = not all_experts
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        oneshot(**job)
    found = re.findall(r"layer (\d): \d+ groups in (\d+) batches(, each reading its experts)?", caplog.text)
    assert [layer for layer, _, _ in found] == ["0", "1"], caplog.text
    assert all(int(n) > 1 and bool(reading) == stream for _, n, reading in found), found
    assert tree_digest(out) == tree_digest(whole)

    os.remove(os.path.join(state, "commits/00001.e00001.json"))  # layer 1 redone from scratch
    shutil.rmtree(os.path.join(state, "layers/00001"))
    shutil.rmtree(out)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        oneshot(**job)
    assert "replayed layers 0..0" in caplog.text
    assert tree_digest(out) == tree_digest(whole)


def test_sparsegpt_experts_in_batches_under_max_memory_give_the_same_bits(tiny_moe, tmp_path, caplog):
    """SparseGPT under routed calibration (a Hessian per expert) with --max-memory below one layer's Hessians: each
    batch of groups calibrated on the layer as loaded and pruned, the pruned weights put in place once all are
    done; the checkpoint is the one of a single batch."""
    job = dict(model=tiny_moe, recipe=recipe_yaml("sparse_2of4_fp8", moe=True), num_calibration_samples=SAMPLES,
               max_seq_length=SEQ, chunk_size=SAMPLES, moe_calibrate_all_experts=False, boundary_every=0)
    whole = oneshot(**job, output_dir=str(tmp_path / "whole"))
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        batched = oneshot(**job, output_dir=str(tmp_path / "out"), max_memory="1MB")
    found = re.findall(r"layer (\d): \d+ groups in (\d+) batches", caplog.text)
    assert [layer for layer, _ in found] == ["0", "1"] and all(int(n) > 1 for _, n in found), caplog.text
    assert tree_digest(batched) == tree_digest(whole)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_streamed_experts_give_the_block_bitwise_and_are_dropped_after(model_type, tmp_path):
    """A streamed layer's experts stay on the meta device: read one at a time when called (the block's output is
    the whole layer's, bit for bit), held a batch at a time by `hold`, dropped after either."""
    source = SourceModel(make_tiny(str(tmp_path / model_type), model_type, moe=True))
    index = next(i for i in range(source.num_layers) if source.streamable(i))
    whole, layer = source.load_layer(index), source.load_layer(index, budget=0)
    (name, container), = streamed(layer).items()
    assert not streamed(whole) and len(container) == 4
    block = name.rpartition(".")[0]
    resident = lambda: [not e.up_proj.weight.is_meta for e in container]  # noqa: E731
    assert not any(resident())
    x = torch.randn(2, 40, source.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(whole.get_submodule(block)(x), layer.get_submodule(block)(x))
    assert not any(resident())
    with source.hold(layer, index, [f"{name}.3.down_proj", f"{name}.1.up_proj", "self_attn.o_proj"]):
        assert resident() == [False, True, False, True]
        assert torch.equal(container[1].up_proj.weight, whole.get_submodule(name)[1].up_proj.weight)
    assert not any(resident())


@pytest.mark.slow
@pytest.mark.distributed
def test_world_size_change_with_a_kill_inside_an_moe_layer(tmp_path):
    """Killed at W=2 while an MoE layer's experts are being solved; resumed at W=1: the experts solved
    before the kill are reused, not redone."""
    model = make_moe(str(tmp_path / "moe32"), experts=32, layers=3)
    job = ["--num-samples", 32, "--seq-len", 256, "--group-size", GROUP, "--chunk-size", 8]
    out, state = tmp_path / "out", tmp_path / "state"
    log = open(tmp_path / "w2.log", "w")
    launcher = subprocess.Popen(torchrun_cmd(2, "run", "--model", model, "--output", out, "--state", state, *job),
                                stdout=log, stderr=subprocess.STDOUT, env=one_thread_env())
    layer_dir, commit = state / "layers" / "00001", state / "commits" / "00001.e00001.json"
    while not (layer_dir.is_dir() and any(p.name.endswith(".json") and p.name.startswith("e") for p in
                                          layer_dir.iterdir())):
        assert launcher.poll() is None, open(tmp_path / "w2.log").read()[-3000:]
        time.sleep(0.005)
    for proc in workers(launcher).values():
        proc.send_signal(signal.SIGKILL)
    launcher.wait(timeout=60)
    assert not commit.exists(), "the layer committed before the kill: make the job bigger"
    resumed = run_cli("run", "--model", model, "--output", out, "--state", state, *job, env=one_thread_env())
    found = re.search(r"layer 1: (\d+) of (\d+) groups were solved before this restart", resumed.stderr)
    assert found and int(found.group(1)) > 0, resumed.stderr[-2000:]
    print(f"\nafter the kill, {found.group(1)} of {found.group(2)} groups of layer 1 were reused at W=1")
    reference = tmp_path / "reference"
    run_cli("run", "--model", model, "--output", reference, *job, env=one_thread_env())
    assert_same_bits(out, reference)
