"""The experts of an MoE layer in one batched product per projection (moe.Experts._batched, what an accelerator
runs): the loop's outputs and calibration's Hessians (the experts' down projections' summed in one batched product,
Calibration.observe_all), its hooks called in its place. On the CPU the products give the loop's bits."""

import pytest
import torch

from elastic_oneshot.loop.calibration import Calibration
from elastic_oneshot.models.moe import Experts, experts_mode
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.quantization import gptq
from elastic_oneshot.quantization.plan import layer_groups
from elastic_oneshot.testing.tiny import make_moe

TOKENS = 64


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    source = SourceModel(make_moe(str(tmp_path_factory.mktemp("models") / "moe"), experts=8, layers=1))
    return source, source.load_layer(0)


def routing(experts: int, seed: int = 0):
    """Each token to 4 experts: with 3 or more, the order of a token's sums shows in its last bits."""
    g = torch.Generator().manual_seed(seed)
    weights, index = torch.softmax(torch.randn(TOKENS, experts, generator=g), -1).topk(4)
    return index, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_experts_give_the_loops_output(layer, dtype):
    """Same products on the CPU, so the same bits: the outputs summed per token in expert order, as the loop's
    index_add_ sums them (which matters in bfloat16)."""
    experts = next(m for m in layer[1].modules() if isinstance(m, Experts)).to(dtype)
    x = torch.randn(TOKENS, experts[0].gate_proj.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    index, weights = routing(len(experts))
    assert not experts._batchable(x)  # the CPU runs the loop
    assert torch.equal(experts._batched(x, index, weights), experts(x, index, weights))
    experts.to(torch.float32)


def test_all_experts_calibration_batched_gives_the_loops_hessians(layer, monkeypatch):
    """Calibration's hooks see every module's input as the loop's calls would show them, and the pass still stops
    at the last hooked module."""
    source, module = layer
    names = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and "mlp.gate" != n]
    groups = [[n for n, _ in g.modules] for g in layer_groups(module, names, source.family.input_key(True))]
    x = torch.randn(2, TOKENS, source.config.hidden_size, generator=torch.Generator().manual_seed(2))
    kwargs = _kwargs(source)
    hessians, batches = [], []
    add_batch = gptq.hessian_add_batch
    monkeypatch.setattr(gptq, "hessian_add_batch", lambda *a: batches.append(1) or add_batch(*a))
    for batched in (False, True):
        monkeypatch.setattr(Experts, "_batchable", lambda self, x, batched=batched: batched)
        calib = Calibration(module, groups, "cpu", TOKENS, {})
        with experts_mode(module, True):
            for sample in x.split(1):
                calib.run(module, sample, kwargs)
            calib.end_chunk()
        calib.remove()
        assert calib.last and calib.last.endswith(f"experts.{7}.down_proj")
        hessians.append({k: h.packed for k, h in calib.hessian.items()})
    assert len(batches) == len(x)  # the experts' down projections: one batched product per sample
    assert hessians[0].keys() == hessians[1].keys()
    for k in hessians[0]:
        assert torch.equal(hessians[0][k], hessians[1][k]), k


def _kwargs(source):
    from elastic_oneshot.models.source import Embedder

    return Embedder(source).layer_kwargs(0, 1, TOKENS)
