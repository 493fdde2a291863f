"""Issue 45's types, held to the sweep's bar and a stricter one (to be folded into tests/test_architectures.py): Gemma 4
(dense, and with its MoE block; per-layer inputs and keys and values shared across layers), DeepSeek-V4 (token ids
routing its first layers, hyper-connected hidden states), GLM-MoE-DSA (top-k indices handed from layer to layer),
Kimi Linear and OLMo hybrid (short convolutions stored in parts), MiniCPM3 (an integer buffer built), BLOOM, GPT-J and
GPTBigCode (`transformer.h` stacks), GraniteMoeShared. Tiny random models of each are compressed with GPTQ everywhere
(no module fell back to round-to-nearest), loaded in a fresh interpreter that never imported elastic_oneshot with
nothing missing or unexpected (Gemma 4's MoE and GraniteMoeShared once taught, as their README.md says: FRESH_FUSED),
generate there, and their logits there are closer to the original's than those of their round-to-nearest twin from the
same scales on the same held-out tokens (testing.runs.check_compressed, as the sweep checks them).

Beside them: the layer loop's call of each layer gives transformers' own hidden states bit for bit; what rides with
the hidden states gives the same bytes at two ranks and after replays from a boundary or the embeddings; a decoder whose
layers take arguments that depend on the tokens is refused unless its family carries them; and a checkpoint the
export's guard would refuse by its names is refused before any work (DeepSeek-V4's `model.norm.weight`, GPTBigCode's
quantized output projections)."""

import glob
import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from elastic_oneshot import oneshot
from elastic_oneshot.errors import UsageError
from elastic_oneshot.loop.layer_step import LayerStep
from elastic_oneshot.models import family, stored_names
from elastic_oneshot.models.families import gpt_blocks
from elastic_oneshot.models.source import Embedder, SourceModel
from elastic_oneshot.quantization.recipe import Recipe
from elastic_oneshot.testing.runs import check_compressed, packed_modules, run_world, tree_digest
from elastic_oneshot.testing.tiny import TINY_TYPE, make_tiny
from tests.peer_modifiers import one_thread  # noqa: F401 (a fixture)

TYPES = [("gemma4_text", False), ("gemma4_text", True), ("deepseek_v4", True), ("glm_moe_dsa", True),
         ("kimi_linear", True), ("olmo_hybrid", False), ("minicpm3", False), ("bloom", False), ("gptj", False),
         ("gpt_bigcode", False), ("granitemoeshared", True)]
# Routed expert projections where not 2 layers x 4 experts x 3: Gemma 4's tiny model has four layers.
ROUTED = {("gemma4_text", True): 4 * 4 * 3}
# Missing in a fresh interpreter: the fused experts, which transformers 5.17 loads from per-expert weights only once
# taught (Gemma 4's and GraniteMoeShared's checkpoints store them fused): the checkpoint's README.md says to call
# elastic_oneshot.teach_transformers(path) first, as for GPT-OSS and GraniteMoE.
FRESH_FUSED = {("gemma4_text", True), ("granitemoeshared", True)}
SAMPLES, SEQ, GROUP = 16, 64, 32

def tiny(path, model_type: str, moe: bool, monkeypatch) -> str:
    """The tiny model of the type; Gemma 4's MoE with its MoE block on (and keys equal to values in full attention);
    DeepSeek-V4's table from token id to experts (its hash routing) drawn, where the config class leaves it zeros."""
    if model_type == "gemma4_text" and moe:
        monkeypatch.setitem(TINY_TYPE, model_type, {**TINY_TYPE[model_type], "enable_moe_block": True,
                                                    "attention_k_eq_v": True})
    model = make_tiny(str(path / f"{model_type}{'_moe' if moe else ''}"), model_type, moe=moe)
    if model_type == "deepseek_v4":
        weights = load_file(os.path.join(model, "model.safetensors"))
        draw = torch.Generator().manual_seed(0)
        for name in [n for n in weights if n.endswith(".tid2eid")]:
            vocab, top_k = weights[name].shape
            weights[name] = torch.stack([torch.randperm(4, generator=draw)[:top_k] for _ in range(vocab)])
        save_file(weights, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    return model


@pytest.mark.slow
@pytest.mark.parametrize("model_type, moe", TYPES)
def test_compressed_beats_round_to_nearest_and_loads_in_a_fresh_interpreter(model_type, moe, tmp_path, monkeypatch,
                                                                          table):
    model = tiny(tmp_path, model_type, moe, monkeypatch)
    source = SourceModel(model)
    dense = source.family.default_ignores(source.skeleton)
    out = oneshot(model=model, num_calibration_samples=SAMPLES, max_seq_length=SEQ, group_size=GROUP, chunk_size=8,
                  output_dir=str(tmp_path / "out"))
    schemes = Recipe(group_size=GROUP).module_schemes(source.skeleton, source.family)

    # GPTQ everywhere: a round-to-nearest fallback is committed with damping null
    commits = [json.load(open(f))["body"] for f in sorted(glob.glob(str(tmp_path / "out.state/commits/*.json")))]
    damping = {f"{source.layer_prefix}{c['layer']}.{n}": m["damping"] for c in commits for n, m in c["modules"].items()}
    assert damping.keys() == schemes.keys() and None not in damping.values()
    codes = packed_modules(out)
    assert codes == {source.stored_name(f"{n}.weight").removesuffix(".weight") for n in schemes}
    linears = [n for n, m in source.skeleton.named_modules() if isinstance(m, torch.nn.Linear)]
    routed = [n for n in linears if ".experts." in n and n not in dense]
    shared = [n for n in linears if ".shared_" in n and not n.endswith("_gate")]
    assert len(routed) == ROUTED.get((model_type, moe), 2 * 4 * 3 if moe else 0)
    assert set(routed + shared) <= set(schemes)

    # loaded as a user loads it, in a fresh interpreter, with its round-to-nearest twin (testing.runs); taught first
    # where the checkpoint's README.md says so
    fused = (model_type, moe) in FRESH_FUSED
    err, err_rtn = check_compressed(model, out, teach=fused)
    table.append(f"{model_type:17} {'moe' if moe else 'dense':5} {len(codes):3} quantized {len(routed):3} routed "
                 f"{len(shared):2} shared expert projections {len(dense):2} kept dense  logit error {err:.4f} "
                 f"(round-to-nearest {err_rtn:.4f})  fresh interpreter: {'taught' if fused else 'as written'}")
    assert 0 < err < err_rtn < 1


@pytest.mark.parametrize("model_type, moe", [pytest.param(t, m, marks=[] if (t, m) in (
    ("gemma4_text", False), ("deepseek_v4", True), ("glm_moe_dsa", True)) else [pytest.mark.slow]) for t, m in TYPES])
@pytest.mark.usefixtures("one_thread")
def test_the_layer_loop_gives_transformers_hidden_states_bit_for_bit(model_type, moe, tmp_path, monkeypatch):
    """Layer by layer with the original weights, as the loop calls each layer (one sample at a time, what rides with
    the hidden states included), the last layer's output equals transformers' own forward's, bit for bit. On one
    thread: transformers' fused experts multiply other shapes than our Linear experts, which several threads split
    otherwise (GLM-MoE-DSA's and GraniteMoeShared's last bits differ at two)."""
    model = tiny(tmp_path, model_type, moe, monkeypatch)
    source = SourceModel(model)
    embedder = Embedder(source)
    ids = torch.randint(3, 500, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        x = embedder(ids)
        for index in range(source.num_layers):
            x = LayerStep.forward(source.load_layer(index), x, embedder.layer_kwargs(index, 1, ids.shape[1]))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager").eval()
    outputs = []
    source.family.layers(source.family.decoder(reference))[-1].register_forward_hook(
        lambda module, args, output: outputs.append(output[0] if isinstance(output, tuple) else output))
    with torch.inference_mode():
        for sample in ids.split(1):
            reference(input_ids=sample, use_cache=False)
    expected = torch.cat(outputs).flatten(2)
    assert torch.equal(x[..., :expected.shape[-1]], expected)


def test_token_dependent_layer_arguments_are_refused_unless_carried(tmp_path, monkeypatch):
    """DeepSeek-V4's layers take the token ids (its hash-routed layers pick experts by them). Without its family's
    adapter, which carries them with the hidden states, every sample would be routed as the zeros the keyword
    arguments are built from: refused before any work instead."""
    model = make_tiny(str(tmp_path / "deepseek_v4"), "deepseek_v4", moe=True)
    monkeypatch.setitem(family.FAMILIES, "deepseek_v4", family.Family)
    with pytest.raises(UsageError, match=r"'deepseek_v4'\) is not supported: its decoder layers take input_ids, which "
                                         r"depend on the tokens, besides the hidden states"):
        oneshot(model=model, num_calibration_samples=8, max_seq_length=32, group_size=32,
                output_dir=str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.state" / "commits")


def test_a_checkpoint_the_guard_would_refuse_is_refused_before_any_work(tmp_path, monkeypatch):
    """DeepSeek-V4's conversions rename `.norm.` to `.kv_norm.` (its attention's norms); transformers' loader keeps a
    key whose renaming names no tensor of the model (`model.norm.weight`) under its own name, and so do our stored
    names and the guard. Without that, the export's guard refused the checkpoint after every layer was compressed;
    the same check on the names the export would write refuses it before layer 0."""
    model = make_tiny(str(tmp_path / "deepseek_v4"), "deepseek_v4", moe=True)
    monkeypatch.setattr(stored_names, "loaded_name", lambda key, renamings, converters, prefix, expected:
                        stored_names.rename_source_key(key, renamings, converters, prefix, expected))
    with pytest.raises(UsageError, match=r"'deepseek_v4'\) is not supported: its compressed checkpoint could not be "
                                         r"loaded \(transformers would find 1 tensors missing: model.norm.weight\), so "
                                         r"it is refused before any work"):
        oneshot(model=model, num_calibration_samples=8, max_seq_length=32, group_size=32,
                output_dir=str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.state")


def test_a_checkpoint_transformers_could_not_initialize_is_refused_before_any_work(tmp_path, monkeypatch):
    """GPTBigCode's output projections (`c_proj`) quantized, were they not kept dense by its family: transformers'
    weight initialization of GPTBigCode reads their `weight`, which the guard finds after the export; the same check
    on the names the export would write refuses the model before layer 0."""
    model = make_tiny(str(tmp_path / "gpt_bigcode"), "gpt_bigcode", moe=False)
    monkeypatch.setattr(gpt_blocks.GPTBigCode, "default_ignores", family.Family.default_ignores)
    with pytest.raises(UsageError, match=r"'gpt_bigcode'\) is not supported: its compressed checkpoint could not be "
                                         r"loaded \(transformers cannot initialize the model it describes: 'Linear' "
                                         r"object has no attribute 'weight'\), so it is refused before any work"):
        oneshot(model=model, num_calibration_samples=8, max_seq_length=32, group_size=32,
                output_dir=str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.state")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("model_type, moe", [("gemma4_text", False), ("glm_moe_dsa", True), ("deepseek_v4", True)])
def test_what_rides_gives_the_same_bits_at_two_ranks_and_after_replays(model_type, moe, tmp_path, monkeypatch):
    """The stream that rides with the hidden states (Gemma 4's per-layer inputs and shared keys and values, GLM-DSA's
    top-k indices, DeepSeek-V4's token ids) is written to boundaries and replayed through committed layers: two
    ranks, a last layer redone from its boundary, and one redone from the embeddings write the same bytes. Which
    boundary is durable is the commits' to say (one that was still being written when the last commit left was not
    recorded, and the restart replays from the embeddings): it is read from them, as tests/test_boundaries.py does."""
    model = tiny(tmp_path, model_type, moe, monkeypatch)
    job = ["--num-samples", SAMPLES, "--seq-len", SEQ, "--group-size", GROUP, "--chunk-size", 4, "--boundary-every", 1]
    run_world(1, model, tmp_path / "w1", job)
    reference = tree_digest(tmp_path / "w1")
    run_world(2, model, tmp_path / "w2", job)
    assert tree_digest(tmp_path / "w2") == reference
    state, last = tmp_path / "w1.state", SourceModel(model).num_layers - 1
    for replay in ("boundary", "embeddings"):
        os.remove(*glob.glob(str(state / "commits" / f"{last:05d}.*.json")))
        if replay == "embeddings":
            shutil.rmtree(state / "boundaries")
        durable = replay == "boundary" and any(json.load(open(f))["body"]["boundary"]
                                               for f in glob.glob(str(state / "commits" / "*.json")))
        shutil.rmtree(tmp_path / "w1")
        log = run_world(1, model, tmp_path / "w1", job).stderr
        assert (f"replayed layers 0..{last - 1}" in log) != durable, log[-2000:]
        assert tree_digest(tmp_path / "w1") == reference, replay
