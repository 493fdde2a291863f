"""The recipes users run (issue 46's table: SmoothQuant + GPTQ W8A8, FP8_DYNAMIC, NVFP4, AWQ + W4A16_ASYM, 2:4
SparseGPT + FP8_DYNAMIC, W4A16) against llmcompressor 0.14 on the same tokens, on a tiny Llama, a tiny Qwen3-MoE and
SmolLM2-135M: the config's keys and quantization_config, layer 0's codes (SparseGPT's masks), perplexity, and the
output loaded as a user loads it, generating.

The tiny Qwen3-MoE's attention is zeroed: the peer calibrates its layers with bidirectional attention
(DESIGN.md, section 6), ours causally, as the model is. The peer and ours run on one thread, ours on one chunk (within
a chunk, Hessians are summed as the peer sums them)."""

import pytest
import torch

from elastic_oneshot.models.default_model import default_model
from elastic_oneshot.surface.evaluate import perplexity
from elastic_oneshot.testing.peer import run_recipe
from elastic_oneshot.testing.recipes import RECIPES, peer_recipe
from elastic_oneshot.testing.tiny import make_model, make_moe
from tests.peer_modifiers import one_thread  # noqa: F401 (a fixture)
from tests.recipe_cases import (
    UNLOADABLE_MOE,
    WITHOUT_EARLY_GUARD,
    checkpoint,
    committed,
    finished,
    loads_and_generates,
    pruned,
    run_ours,
    same_config,
    same_layer0_codes,
    start_ours,
)

SAMPLES, SEQ = 16, 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"llama": lambda: make_model(str(root / "llama"), "llama", num_key_value_heads=4),  # v_proj feeds o_proj
            "llama_bf16": lambda: make_model(str(root / "llama_bf16"), "llama", num_key_value_heads=4,
                                             dtype=torch.bfloat16),
            "qwen3_moe": lambda: make_moe(str(root / "moe"), intermediate=128, attention=False),
            "smollm2": default_model}


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    """(our run, our output, the peer's output) of a model and a recipe, each made once: ours in a process of its
    own beside the peer's (one thread each)."""
    made, paths = {}, {}

    def make(model: str, name: str, group: int = 128, samples: int = SAMPLES):
        if model not in paths:
            paths[model] = models[model]()
        if (model, name) not in made:
            root, moe = tmp_path_factory.mktemp(f"{model}-{name}"), model == "qwen3_moe"
            late = moe and name in UNLOADABLE_MOE  # refused before any work: the layers committed without that check
            ours = start_ours(paths[model], root / "ours", name, samples, SEQ, moe, group,
                              **({"program": WITHOUT_EARLY_GUARD} if late else {}))
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                peer = run_recipe(paths[model], str(root / "peer"), samples, SEQ, peer_recipe(name, moe, group),
                                  moe=moe, dtype="bfloat16" if model.endswith("bf16") else "float32")
            finally:
                torch.set_num_threads(before)
                proc = finished(ours, root / "ours")
            made[model, name] = proc, root / "ours", peer
        return made[model, name]
    return make


def check(name: str, proc, ours, peer, exact_masks: float = 0.0, perplexity_within: float = 0.01):
    """Our output against the peer's: config, layer 0's codes, perplexity (within a share `perplexity_within` of the
    peer's); ours loads and generates. SparseGPT's masks of layer 0 are the peer's, but for a fraction `exact_masks`
    of its weights."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_config(ours, peer)
    a, b = checkpoint(ours), checkpoint(peer)
    same = same_layer0_codes(a, b)
    print(f"\n{name}: layer 0's codes identical to llmcompressor 0.14's: {same:.4%}")
    assert same >= 0.995
    if name.startswith("sparse"):  # the masks: the peer's Hessian is a running average, ours summed then divided
        masks, theirs = pruned(a), pruned(b)
        assert masks.keys() == theirs.keys() and masks
        assert all(m.reshape(-1, 4).sum(1).min() >= 2 for m in masks.values())  # 2 of every 4 pruned
        layer0 = [k for k in masks if k.startswith("model.layers.0.")]
        differ = sum((masks[k] != theirs[k]).sum().item() for k in layer0)
        print(f"{name}: layer 0's masks differ from the peer's in {differ} of "
              f"{sum(masks[k].numel() for k in layer0)} weights; all layers' in "
              f"{sum((masks[k] != theirs[k]).sum().item() for k in masks)}")
        assert differ <= exact_masks * sum(masks[k].numel() for k in layer0)
    ppl = [perplexity(str(p), "builtin", 8, SEQ) for p in (ours, peer)]
    print(f"{name}: perplexity {ppl[0]:.4f} against the peer's {ppl[1]:.4f}")
    assert abs(ppl[0] / ppl[1] - 1) <= perplexity_within
    loads_and_generates(ours)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", RECIPES)
def test_tiny_llama_equals_the_peer(pair, name):
    check(name, *pair("llama", name))


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", RECIPES)
def test_tiny_bfloat16_llama_equals_the_peer(pair, name):
    """A bfloat16 model, as users' are: the peer's steps in its dtype (AWQ's errors rounded to bfloat16, as its
    mse_loss gives them). SparseGPT's masks after layer 0 follow near ties of 2:4 pairs, which bfloat16's rounding of
    each layer's outputs moves, differently on different CPUs: its perplexity is held to 3 % (on an AMD EPYC without
    AVX-512 the dense model's is 744.61, the peer's 737.59, ours 726.27, 1.5 % off, and without SparseGPT's weight
    updates 784.09, 6.3 % off; on the AVX-512 machines of earlier sessions ours was the peer's)."""
    check(name, *pair("llama_bf16", name), perplexity_within=0.03 if name.startswith("sparse") else 0.01)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", RECIPES)
def test_tiny_qwen3_moe_equals_the_peer(pair, name, tmp_path):
    """Where transformers cannot load the format for per-expert Qwen3-MoE (the peer's output fails to load too),
    our run refuses in one line before any work, and the layers a run without that check commits (its export then
    refuses) are compared."""
    proc, ours, peer = pair("qwen3_moe", name)
    if name not in UNLOADABLE_MOE:  # where a 2:4 pair is a near tie, the two Hessians' last bits may choose apart
        return check(name, proc, ours, peer, exact_masks=1e-5)
    refused = run_ours(make_moe(str(tmp_path / "moe"), intermediate=128, attention=False), tmp_path / "out", name,
                       SAMPLES, SEQ, True, check=False)
    assert refused.returncode == 2 and "refused before any work" in refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.state").exists()
    assert proc.returncode == 2 and "is not usable" in proc.stderr, proc.stderr[-3000:]
    same = same_layer0_codes(committed(f"{ours}.state"), checkpoint(peer))
    print(f"\n{name}: layer 0's committed codes identical to llmcompressor 0.14's: {same:.4%}")
    assert same >= 0.995


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["smoothquant_w8a8", "awq_w4a16_asym"])
def test_smollm2_equals_the_peer(pair, name):
    check(name, *pair("smollm2", name, group=64, samples=4))
