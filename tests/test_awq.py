"""AWQ (quantization/awq.py) against llmcompressor 0.14's AWQModifier followed by its QuantizationModifier on a tiny
real Llama: the same mappings, and layer after layer, from the same inputs, the same grid search and the same
folded weights bit for bit; the choice the same for any split of the samples across ranks and any thread count."""

import threading

import pytest
import torch

from elastic_oneshot.models import mappings
from elastic_oneshot.models.family import family_for
from elastic_oneshot.quantization import awq, smoothing
from elastic_oneshot.quantization.recipe import AWQ, RTN, Recipe
from elastic_oneshot.testing.tiny import make_model
from tests.peer_modifiers import load, one_thread, record, run_peer, tokens  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Keys and values in as many heads as queries, so that v_proj feeds o_proj one for one (its mapping runs)."""
    return make_model(str(tmp_path_factory.mktemp("models") / "llama"), "llama", num_key_value_heads=4)


def recipe(scheme: str, duo_scaling) -> Recipe:
    return Recipe(scheme=scheme.removesuffix("_ASYM"), symmetric=not scheme.endswith("_ASYM"), actorder=None,
                  quantizer=RTN, stages=(AWQ(duo_scaling=duo_scaling),))


def layer_step(model, ids, mappings: list[awq.Mapping], schemes: dict, stage: AWQ, ranks: int = 1):
    """AWQ on one layer, as the layer step will run it over `ranks` ranks: one calibration pass records each
    mapping's hooked inputs and its parent's calls; then, mapping after mapping, each rank's samples' statistics go
    into per-sample slots, are reduced (a sum where only one rank's slot is nonzero), and every rank chooses (the
    search in rounds, on every sample's errors computed beforehand) and folds the same scales."""
    modules = dict(model.named_modules())
    fused = family_for(model.config).fused_scales
    seen = record(model, ids, sorted({m.hook for m in mappings}), sorted({m.parent for m in mappings}))
    parts = torch.tensor_split(torch.arange(len(ids)), ranks)
    for m in mappings:
        calls, inputs = seen.calls[m.parent], seen.inputs[m.hook]
        quantized = {b: modules[b] for b in m.balance if b in schemes}
        args = {b: schemes[b].weights for b in quantized}
        sums = torch.stack([awq.activation_sum(x) for x in inputs])  # the slots, all ranks' at once
        tokens_ = sum(x.numel() // x.shape[-1] for x in inputs)
        x_mean = awq.activation_mean(sums, tokens_)
        w_mean = awq.weight_mean([w.weight for w in quantized.values()], list(args.values())) \
            if stage.duo_scaling else None
        points = awq.grid(stage.n_grid, stage.duo_scaling)
        errors = torch.zeros(len(points), len(ids))
        elements = 0
        for part in parts:  # each rank: its samples only
            mine = [calls[i] for i in part]
            reference = list(awq.outputs(modules[m.parent], mine))
            assert all(y.isfinite().all() for y in reference)
            elements += sum(r.numel() for r in reference)
            with awq.Candidates(quantized, points, x_mean, w_mean, args, fused) as held:
                for point in range(len(points)):
                    held.hold(point)
                    errors[point, part] = awq.sample_errors(reference, list(awq.outputs(modules[m.parent], mine)))
        chosen, _ = search_on(errors, ranks, 4, 0, elements)
        s = awq.scales(x_mean, w_mean, *points[chosen[0]])
        smooth = modules[m.smooth]
        new, balance, bias = smoothing.fold(s, smooth.weight, [modules[b].weight for b in m.balance],
                                            getattr(smooth, "bias", None))
        with torch.no_grad():
            smooth.weight.copy_(new)
            if bias is not None:
                smooth.bias.copy_(bias)
            for b, w in zip(m.balance, balance):
                modules[b].weight.copy_(w)


def awq_layer_by_layer(path: str, r: Recipe, ranks: int = 1, layers: int | None = None):
    model = load(path)
    ids = tokens(path)
    schemes = r.module_schemes(model, family_for(model.config))
    (stage,) = r.stages
    mappings = awq.resolve(model, family_for(model.config).awq_mappings(model.config), schemes, stage.duo_scaling)
    for index in range(layers or model.config.num_hidden_layers):
        layer_step(model, ids, [m for m in mappings if m.smooth.startswith(f"model.layers.{index}.")], schemes, stage,
                   ranks)
    return model


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("scheme, duo_scaling", [("W4A16_ASYM", True), ("W4A16", "both"), ("NVFP4A16", False)])
def test_awq_weights_equal_the_peers(llama, scheme, duo_scaling):
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier

    peer = [AWQModifier(duo_scaling=duo_scaling), QuantizationModifier(scheme=scheme, ignore=["lm_head"])]
    theirs = run_peer(llama, peer, pin_memory=False).state_dict()
    ours = awq_layer_by_layer(llama, recipe(scheme, duo_scaling)).state_dict()
    original = load(llama).state_dict()
    changed = [k for k in ours if not torch.equal(ours[k], original[k])]
    assert len(changed) > 4 * 9 // 2  # of the two norms, q/k/v, o_proj, gate/up, down (the identity may win)
    assert [k for k in ours if not torch.equal(theirs[k], ours[k])] == []


def test_default_mappings_resolve_as_the_peers(llama):
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier
    from llmcompressor.modifiers.transform.awq.base import get_lowest_common_ancestor_with_avoid

    for kv_heads in (4, 2):  # grouped-query attention: v_proj does not feed o_proj one for one
        model = load(llama)
        if kv_heads == 2:
            model.model.layers[0].self_attn.v_proj = torch.nn.Linear(128, 64, bias=False)
        r = recipe("W4A16", True)
        schemes = r.module_schemes(model, family_for(model.config))
        QuantizationModifier(scheme="W4A16", ignore=["lm_head"]).initialize_quantization(model)
        peer = AWQModifier()
        peer.mappings = mappings.awq_mappings("LlamaForCausalLM")
        peer.mappings = [type("M", (), dict(smooth_layer=s, balance_layers=list(b), activation_hook_target=t))
                         for s, b, t in peer.mappings]
        peer._set_resolved_mappings(model)
        theirs = [awq.Mapping(m.smooth_name, tuple(m.balance_names), m.parent_name, m.balance_names[0])
                  for m in peer._resolved_mappings]
        ours = awq.resolve(model, mappings.awq_mappings("LlamaForCausalLM"), schemes)
        assert ours == theirs and len(ours) == 4 * 4 - (kv_heads == 2)
        assert get_lowest_common_ancestor_with_avoid([ours[0].balance[0]], model)[0] == ours[0].balance[0]


def test_a_tensor_scheme_refuses_duo_scaling(llama):
    model = load(llama)
    r = recipe("FP8", True)
    with pytest.raises(Exception, match="duo_scaling needs weights quantized by channel or group"):
        awq.resolve(model, mappings.awq_mappings("LlamaForCausalLM"), r.module_schemes(model, family_for(model.config)))


@pytest.mark.slow
def test_the_choice_does_not_depend_on_the_ranks_or_the_threads(llama):
    """Layers 0 and 1 (layer 1 on layer 0's smoothed outputs); two threads beside other work are slow here."""
    results = []
    for ranks, threads in ((1, 1), (3, 2), (8, 1)):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results.append(awq_layer_by_layer(llama, recipe("W4A16_ASYM", True), ranks, layers=2).state_dict())
        finally:
            torch.set_num_threads(before)
    for other in results[1:]:
        assert [k for k in other if not torch.equal(other[k], results[0][k])] == []


def test_grid_points_are_the_peers():
    from llmcompressor.modifiers.transform import AWQModifier

    for duo in (True, False, "both"):
        for n in (4, 5, 20):
            assert awq.grid(n, duo) == AWQModifier(duo_scaling=duo, n_grid=n)._get_grid_search_params()


def test_a_samples_statistics_do_not_depend_on_the_threads():
    """At real sizes a whole-tensor sum splits by thread (here 2 threads moved mse_loss's sum of 2M elements by one
    ulp): a sample's error is summed on one thread; its per-channel sums split by channel, which keeps them."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 2048, 1024, generator=g), torch.randn(1, 2048, 1024, generator=g)
    before, seen = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            seen.append((awq.sample_errors([a], [b]), awq.activation_sum(a)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(seen[0][0], seen[1][0]) and torch.equal(seen[0][1], seen[1][1])


def search_on(errors: torch.Tensor, ranks: int, rounds: int, first: int, elements: int = 1000
              ) -> tuple[list[int], int]:
    """awq.search on `ranks` threads, each holding a contiguous share of the samples, a barrier summing their rows
    in rank order (the all-reduce): every rank's choice, and how many (point, sample) errors were computed."""
    points, samples = errors.shape
    parts = torch.tensor_split(torch.arange(samples), ranks)
    barrier, pending, chosen, computed = threading.Barrier(ranks, timeout=60), [None] * ranks, [None] * ranks, []

    def rank(r: int):
        def reduce(t: torch.Tensor):
            pending[r] = t.clone()
            barrier.wait()
            total = sum(pending)
            barrier.wait()
            t.copy_(total)

        def of(point: int, calls: list[int]) -> torch.Tensor:
            computed.append(len(calls))
            return errors[point, parts[r][calls]]

        try:
            chosen[r] = awq.search(of, parts[r].tolist(), points, rounds, samples, elements, reduce, first=first)
        except ValueError as e:  # every rank's, after the same reduces
            chosen[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return chosen, sum(computed)


def test_the_search_chooses_as_best_does_on_fewer_forwards():
    """A U-shaped loss over the grid, its least at another point for the first third of the samples, samples of
    unequal weight (some zero: a bound equal to the least loss before the last round), a tie for the least loss, NaN
    and inf rows: at any ranks, rounds and first point, every rank chooses what `best` chooses from every error;
    with rounds, fewer errors are computed."""
    g = torch.Generator().manual_seed(0)
    points, samples = 20, 24
    weight = torch.rand(samples, generator=g) * 2
    weight[[3, 10, 17, 23]] = 0
    centre = torch.where(torch.arange(samples) < 8, 3.0, 11.0)  # each rank's own samples would choose another point
    curve = 1 + (torch.arange(points)[:, None] - centre[None]) ** 2 / 40
    base = curve * weight[None] * (1 + 0.05 * torch.rand(points, samples, generator=g))
    tie = base.clone()
    tie[12] = tie[5] = tie[5] * 0.5
    odd = base.clone()
    odd[2, 4], odd[9] = float("nan"), float("inf")
    for errors in (base, tie, odd):
        want = awq.best(errors, 1000)
        for ranks in (1, 2, 3):
            for rounds in (1, 3, 8):
                for first in (0, 7, 12, 19):
                    chosen, computed = search_on(errors, ranks, rounds, first)
                    assert chosen == [want] * ranks, (ranks, rounds, first)
                    assert computed < points * samples if rounds > 1 else computed == points * samples
    assert (awq.best(tie, 1000), awq.best(odd, 1000)) == (5, awq.best(base, 1000))
    with pytest.raises(ValueError, match="finite loss"):
        awq.best(torch.full((points, samples), float("nan")), 1000)
    chosen, _ = search_on(torch.full((points, samples), float("nan")), 2, 3, 0)
    assert all(isinstance(c, ValueError) for c in chosen)
