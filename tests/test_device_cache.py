"""loop/device_cache.py: what AWQ caches on the device for a layer stays within the run's budget, and where a tensor
is held changes no bits."""

import logging

import pytest
import torch

from elastic_oneshot.distributed.world import World
from elastic_oneshot.loop import layer_step
from elastic_oneshot.loop.device_cache import DeviceCache, tensor_ids
from elastic_oneshot.loop.passes import plan
from elastic_oneshot.models.source import Embedder, SourceModel
from elastic_oneshot.quantization import awq
from elastic_oneshot.quantization.recipe_loader import read_recipe
from elastic_oneshot.testing.recipes import recipe_yaml
from elastic_oneshot.testing.tiny import make_moe


def test_the_cache_holds_up_to_its_allowance_and_brings_back_exact_copies():
    torch.manual_seed(0)
    shared = (torch.randn(1024), torch.randn(8))  # a layer's keyword arguments: held anyway, never counted
    calls = [{"x": torch.randn(1024), "rows": [torch.randn(16)], "position_embeddings": shared, "n": 3}
             for _ in range(5)]
    cache = DeviceCache("cpu", 3 * (1024 + 16) * 4)  # three calls' own tensors
    kept = [cache.keep(c, tensor_ids(shared)) for c in calls]
    assert [type(k["x"]) is torch.Tensor for k in kept] == [True] * 3 + [False] * 2
    assert kept[4]["position_embeddings"][0] is shared[0] and kept[4]["n"] == 3
    assert cache.spilled == 2 * (1024 + 16) * 4 and cache.left == 0
    for call, k in zip(calls, kept):
        back = cache.use(k)
        assert torch.equal(back["x"], call["x"]) and torch.equal(back["rows"][0], call["rows"][0])
        assert back["position_embeddings"][1] is shared[1]
    assert cache.use(kept[0])["x"] is calls[0]["x"]  # held: not copied


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_awq_chooses_the_same_scales_with_its_calls_on_the_host(family, tiny_llama, tmp_path, monkeypatch, caplog):
    """AWQ's layer step on layer 0, its recorded calls and reference outputs all kept in the cache or all copied out
    of it (as a GPU over its budget would): the same errors at every grid point computed, the same scales, bit for
    bit, and the same weights after the folds."""
    path = tiny_llama if family == "llama" else make_moe(str(tmp_path / "moe"))
    source = SourceModel(path)
    recipe = read_recipe(recipe_yaml("awq_w4a16_asym", moe=family != "llama", group=16)).with_default_mappings(
        source.family, source.config)
    schemes = recipe.module_schemes(source.skeleton, source.family)
    passes = plan(recipe, source, schemes)
    samples, seq_len = 6, 24
    torch.manual_seed(1)
    x = torch.randn(samples, seq_len, source.config.hidden_size, dtype=source.dtype)
    kwargs = Embedder(source).layer_kwargs(0, 1, seq_len)

    errors, sample_errors = [], awq.sample_errors
    monkeypatch.setattr(awq, "sample_errors", lambda *a: errors.append(sample_errors(*a)) or errors[-1])

    def decide() -> tuple[dict, dict, list]:
        step = layer_step.LayerStep(source, schemes, recipe, World(), "cpu", seq_len, samples, False, passes, 0,
                                    [(0, 3), (3, 6)])
        module, units = step.load(0, None, {})
        tensors = {}
        step.decide(0, module, units, tensors, lambda: [(0, x[:3]), (1, x[3:])], lambda: kwargs, {},
                    lambda names, found: None, budget=2**30)
        found = torch.cat(errors)
        errors.clear()
        return tensors, module.state_dict(), found

    held, weights, held_errors = decide()
    monkeypatch.setattr(layer_step, "_cache_allowance", lambda module, budget, device: 0)
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        spilled, spilled_weights, spilled_errors = decide()
    assert "of its recorded calls on the host" in caplog.text
    assert held.keys() == spilled.keys() and any(t.numel() for t in held.values())
    assert torch.equal(held_errors, spilled_errors)  # each grid point's error of each sample: a copy is exact
    assert all(torch.equal(held[k], spilled[k]) for k in held)
    assert all(torch.equal(weights[k], spilled_weights[k]) for k in weights)
