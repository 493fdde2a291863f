"""A recipe of several modifiers runs as the peer's independent pipeline runs it: each modifier over every layer
before the next, so each sees the model as the modifiers before it left every layer and as itself left the layers
before. Layer by layer, that is one stream of inputs per stage that changes the forward: here SmoothQuant's
(smoothed, unquantized layers) and GPTQ's (smoothed and quantized), against llmcompressor 0.14's W8A8 example."""

import pytest
import torch

from elastic_oneshot.models.family import family_for
from elastic_oneshot.quantization import gptq, smoothing
from elastic_oneshot.quantization.recipe import Recipe, SmoothQuant
from elastic_oneshot.testing.tiny import make_model
from tests.peer_modifiers import SEQ_LEN, load, one_thread, record, run_peer, tokens  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama"), "llama")


def smooth(model, index: int, ids, strength: float) -> dict[str, torch.Tensor]:
    """SmoothQuant's scales of layer `index`, observed on `model` (SmoothQuant's stream), by smooth layer."""
    modules = dict(model.named_modules())
    mappings = [m for m in smoothing.resolve(model, family_for(model.config).smoothing_mappings(model.config))
                if m.smooth.startswith(f"model.layers.{index}.")]
    seen = record(model, ids, [m.smooth for m in mappings]).outputs
    out = {}
    for m in mappings:
        ranges = None
        for y in seen[m.smooth]:
            ranges = smoothing.observe(ranges, y)
        out[m.smooth] = (m, smoothing.scales(ranges, [modules[b].weight for b in m.balance], strength))
    return out


def fold(model, found: dict):
    modules = dict(model.named_modules())
    with torch.no_grad():
        for m, s in found.values():
            norm, balance, _ = smoothing.fold(s, modules[m.smooth].weight, [modules[b].weight for b in m.balance])
            modules[m.smooth].weight.copy_(norm)
            for b, w in zip(m.balance, balance):
                modules[b].weight.copy_(w)


def quantize(model, index: int, ids, recipe: Recipe):
    """GPTQ of layer `index` on `model` (GPTQ's stream), each module's Hessian over all samples in one fp32 sum."""
    layer = model.model.layers[index]
    names = {f"model.layers.{index}.{n}": m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    seen = record(model, ids, list(names)).inputs
    args = recipe.schemes["group_0"].weights
    for name, module in names.items():
        part = torch.zeros(module.in_features, module.in_features)
        for x in seen[name]:
            gptq.hessian_add(part, x, SEQ_LEN)
        total = torch.zeros(part.shape, dtype=torch.float64)
        gptq.fold(total, part)
        solved, _, _ = gptq.quantize(module.weight.data, total / len(ids), args, recipe.block_size,
                                     recipe.dampening_frac)
        with torch.no_grad():
            module.weight.copy_(solved)


def smoothquant_then_gptq(path: str, recipe: Recipe, streams: int = 2):
    """The layer step of [SmoothQuant, GPTQ]: layer L's scales from SmoothQuant's stream, folded into both
    streams' layer L; then GPTQ's Hessians from GPTQ's stream. `streams=1` is the shortcut of one stream (the
    statistics of both from the quantized layers), which the peer does not take."""
    (stage,) = recipe.stages
    ids = tokens(path)
    quantized = load(path)
    smoothed = load(path) if streams == 2 else quantized
    for index in range(quantized.config.num_hidden_layers):
        found = smooth(smoothed, index, ids, stage.smoothing_strength)
        fold(smoothed, found)
        if smoothed is not quantized:
            fold(quantized, found)
        quantize(quantized, index, ids, recipe)
    return quantized


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_smoothquant_then_gptq_equals_the_peers_w8a8(llama):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    peer = [SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", targets="Linear",
                                                                     ignore=["lm_head"])]
    theirs = run_peer(llama, peer).state_dict()
    recipe = Recipe(scheme="W8A8", stages=(SmoothQuant(smoothing_strength=0.8),))
    ours = smoothquant_then_gptq(llama, recipe).state_dict()
    layers = [k for k in ours if k.startswith("model.layers.") and k.endswith("weight")]
    assert [k for k in layers if not torch.equal(ours[k], theirs[k])] == []
    shortcut = smoothquant_then_gptq(llama, recipe, streams=1).state_dict()
    differ = [k for k in layers if not torch.equal(shortcut[k], theirs[k])]
    assert differ and all(not k.startswith("model.layers.0.") for k in differ)  # layer 0's inputs are the same
