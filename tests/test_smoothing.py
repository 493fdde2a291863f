"""SmoothQuant and logarithmic equalization (quantization/smoothing.py) against llmcompressor 0.14 on a tiny real
Llama: the same mappings resolved, and, layer after layer from the same statistics of the layers' real inputs, the
same smoothed weights bit for bit; reduced across any split of the samples, at any thread count."""

import pytest
import torch
import transformers

from elastic_oneshot.models.family import family_for
from elastic_oneshot.quantization import smoothing
from elastic_oneshot.testing.tiny import make_model, make_tiny
from tests.peer_modifiers import load, one_thread, record, run_peer, tokens  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama"), "llama")


def smooth_layer_by_layer(path: str, strength: float, algorithm: str) -> transformers.PreTrainedModel:
    """Ours, as the layer step will run it: each layer's smooth layers observed on the inputs that the layers
    before it, already smoothed, give (its own still unsmoothed), then its scales folded."""
    model = load(path)
    ids = tokens(path)
    mappings = smoothing.resolve(model, family_for(model.config).smoothing_mappings(model.config))
    modules = dict(model.named_modules())
    for index in range(model.config.num_hidden_layers):
        mine = [m for m in mappings if m.smooth.startswith(f"model.layers.{index}.")]
        seen = record(model, ids, [m.smooth for m in mine])
        for m in mine:
            ranges = None
            for out in seen.outputs[m.smooth]:  # one sample at a time, as a rank's hooks see them
                ranges = smoothing.observe(ranges, out)
            balance = [modules[b].weight for b in m.balance]
            s = smoothing.scales(ranges, balance, strength, algorithm)
            norm, folded, _ = smoothing.fold(s, modules[m.smooth].weight, balance)
            with torch.no_grad():
                modules[m.smooth].weight.copy_(norm)
                for name, w in zip(m.balance, folded):
                    modules[name].weight.copy_(w)
    return model


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("algorithm", ["smoothquant", pytest.param("log_equalization", marks=pytest.mark.slow)])
def test_smoothed_weights_equal_the_peers(llama, algorithm):
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    theirs = run_peer(llama, [SmoothQuantModifier(smoothing_strength=0.8, algorithm=algorithm)]).state_dict()
    ours = smooth_layer_by_layer(llama, 0.8, algorithm).state_dict()
    original = load(llama).state_dict()
    changed = [k for k in theirs if not torch.equal(theirs[k], original[k])]
    assert len(changed) == 4 * 7  # two norms, q/k/v, gate/up in each of the four layers
    assert [k for k in theirs if not torch.equal(theirs[k], ours[k])] == []


def test_default_mappings_resolve_as_the_peers(tmp_path):
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    for model_type, moe in (("llama", False), ("qwen3_moe", True), ("mixtral", True), ("phi3", False)):
        config = transformers.AutoConfig.from_pretrained(make_tiny(str(tmp_path / model_type), model_type, moe=moe))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        names = {id(m): n for n, m in model.named_modules()}
        peer = SmoothQuantModifier(mappings=None)
        peer.ignore, peer.mappings = [], peer._infer_mappings_from_model(model)
        theirs = [smoothing.Mapping(m.smooth_name, tuple(names[id(b)] for b in m.balance_layers))
                  for m in peer._resolve_mappings(model)]
        ours = smoothing.resolve(model, family_for(config).smoothing_mappings(config))
        assert ours == theirs and ours, model_type


def test_scales_do_not_depend_on_the_split_or_the_threads(llama):
    model = load(llama)
    outputs = record(model, tokens(llama), ["model.layers.1.post_attention_layernorm"]).outputs
    outputs = outputs["model.layers.1.post_attention_layernorm"]
    balance = [model.model.layers[1].mlp.gate_proj.weight, model.model.layers[1].mlp.up_proj.weight]
    results = []
    for split, threads in ((8, 1), (3, 2), (5, 1)):  # ranks' ranges, reduced by MIN and MAX
        parts = []
        for part in (outputs[:split], outputs[split:]):
            ranges = None
            for out in part:
                ranges = smoothing.observe(ranges, out)
            parts.append(ranges)
        ranges = parts[0] if parts[1] is None else torch.stack([torch.minimum(parts[0][0], parts[1][0]),
                                                                 torch.maximum(parts[0][1], parts[1][1])])
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            s = smoothing.scales(ranges, balance, 0.5)
            results.append((s, *smoothing.fold(s, model.model.layers[1].post_attention_layernorm.weight, balance)[:2]))
        finally:
            torch.set_num_threads(before)
    for other in results[1:]:
        assert torch.equal(other[0], results[0][0]) and torch.equal(other[1], results[0][1])
        assert all(torch.equal(a, b) for a, b in zip(other[2], results[0][2]))


def test_fold_keeps_the_function():
    """Dividing a norm's output and multiplying the next Linear's columns by the same scales is the identity up
    to rounding; an offset norm (1 + weight) and a Linear with more rows than scales are folded in their own
    conventions."""
    g = torch.Generator().manual_seed(0)
    x, norm, w = torch.randn(16, 32, generator=g), torch.rand(32, generator=g) + 0.5, torch.randn(24, 32, generator=g)
    s = smoothing.scales(torch.stack([x.amin(0), x.amax(0)]), [w], 0.5)
    new_norm, (new_w,), _ = smoothing.fold(s, norm, [w])
    torch.testing.assert_close((x * new_norm) @ new_w.T, (x * norm) @ w.T, rtol=1e-5, atol=1e-5)
    new_offset, _, _ = smoothing.fold(s, norm - 1, [w], offset=True)
    torch.testing.assert_close(1 + new_offset, new_norm, rtol=1e-6, atol=1e-6)
    fused = torch.randn(48, 8, generator=g)  # qkv_proj's rows: the last 32 (v) are o_proj's inputs
    folded, _, _ = smoothing.fold(s, fused, [w])
    assert torch.equal(folded[:16], fused[:16]) and torch.equal(folded[16:], fused[16:] / s.view(-1, 1))
