"""The GPTQ step executor on one rank, in process (World() without WORLD_SIZE: its collectives are no-ops),
on plans forced to share or spread a group: the very bits of gptq.prepare + gptq.solve on one rank."""

import dataclasses
import types

import pytest
import torch

from elastic_oneshot.distributed.world import World
from elastic_oneshot.models.family import Family
from elastic_oneshot.quantization import cholesky, gptq
from elastic_oneshot.quantization.executor import Executor
from elastic_oneshot.quantization.plan import CostModel, Group, Plan, StepKind, _schedule, make_plan
from elastic_oneshot.quantization.recipe import Recipe

RECIPE = Recipe(group_size=32)
SAMPLES = 4


@pytest.fixture
def small_pieces(monkeypatch):
    """Hessians wider than 96 columns count as wide: Cholesky panels of 32 columns, inverse pieces of 64 rows."""
    monkeypatch.setattr(cholesky, "SHARED_INVERSE_COLS", 96)
    monkeypatch.setattr(cholesky, "CHOLESKY_PANEL", 32)
    monkeypatch.setattr(cholesky, "INVERSE_PIECE", 64)


def problem(group: Group, seed: int = 0, indefinite: bool = False) -> tuple[dict, torch.Tensor]:
    """Each module's weight, and the group's Hessian summed over SAMPLES samples (fp64, one dead column)."""
    g = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(rows, group.cols, generator=g) * 0.05 for name, rows in group.modules}
    x = torch.randn(256, group.cols, generator=g) * torch.linspace(0.1, 3, group.cols)
    x[:, 5] = 0
    h = (2 * x.t() @ x).double()
    if indefinite:  # not positive definite at the recipe's damping
        h -= torch.eye(group.cols, dtype=torch.float64) * h.diagonal().mean() * 0.05
    return weights, h


def execute(plan: Plan, groups: list[Group], problems: list[tuple[dict, torch.Tensor]]):
    solved = []
    hessians = {g.name: h.clone() for g, (_, h) in zip(groups, problems)}
    weights = {k: v for w, _ in problems for k, v in w.items()}
    args = dict.fromkeys(weights, RECIPE.weights)
    qparams = {k: gptq.QParams(*gptq.qparams(w, RECIPE.weights)) for k, w in weights.items()}
    executor = Executor(World(), plan, groups, weights, RECIPE, 0, solved.append, args, qparams)
    results = executor.run(hessians, SAMPLES)
    assert not hessians  # the sums are released once normalized
    return results, executor.damping, solved


def reference(group: Group, weights: dict, h: torch.Tensor, slices) -> tuple[torch.Tensor, float]:
    """gptq.prepare + gptq.solve on one rank, by the same row slices (each with its own rows' scales)."""
    prep = gptq.prepare((h / SAMPLES)[None], RECIPE.actorder, RECIPE.dampening_frac)
    w = torch.cat([weights[name] for name, _ in group.modules])
    parts = [gptq.solve(w[None, lo:hi], prep, RECIPE.weights, RECIPE.block_size) for lo, hi in slices]
    return torch.cat([p[0] for p in parts]), prep.damping[0]


def assert_equal(a: torch.Tensor, b: torch.Tensor):
    assert torch.equal(a, b)


def sliced(plan: Plan, cuts: list[int]) -> Plan:
    """`plan` with its one solve step cut into row slices at `cuts` (at W > 1, ranks solve such slices)."""
    steps = []
    for s in plan.steps:
        bounds = [s.start, *cuts, s.end] if s.kind == StepKind.SOLVE else None
        steps += [dataclasses.replace(s, start=lo, end=hi) for lo, hi in zip(bounds, bounds[1:])] if bounds else [s]
    return Plan(steps, plan.world_size)


@pytest.mark.parametrize("cols,spread,kinds", [
    (64, False, {StepKind.FACTOR, StepKind.SOLVE}),  # one rank factors, ranks solve row slices
    (160, False, {StepKind.FACTOR, StepKind.INVERT, StepKind.SOLVE}),  # wide: inverse pieces
    (160, True, {StepKind.PANEL, StepKind.UPDATE, StepKind.INVERT, StepKind.SOLVE}),  # wide, Cholesky spread
])
@pytest.mark.parametrize("indefinite", [False, True])
def test_shared_group_equals_one_rank(cols, spread, kinds, indefinite, small_pieces):
    group = Group((("q_proj", 40), ("k_proj", 24), ("v_proj", 24)), cols)
    plan = sliced(_schedule([group], 1, CostModel(), [group], spread), [30, 50])
    assert {s.kind for s in plan.steps} == kinds
    weights, h = problem(group, indefinite=indefinite)
    results, damping, solved = execute(plan, [group], [(weights, h)])
    expected, expected_damping = reference(group, weights, h, [(0, 30), (30, 50), (50, group.rows)])
    assert_equal(results[group.name], expected)
    assert damping == {group: expected_damping} and (expected_damping > RECIPE.dampening_frac) == indefinite
    assert [[g for g, _ in batch] for batch in solved] == [[group]]  # handed over once, whole
    assert solved[0][0][1] is results[group.name]


def test_whole_groups_of_one_shape_are_solved_in_one_batch():
    experts = [Group(((f"experts.{e}.gate_proj", 16), (f"experts.{e}.up_proj", 16)), 64) for e in range(3)]
    down = [Group(((f"experts.{e}.down_proj", 64),), 32) for e in range(3)]
    groups = [g for pair in zip(experts, down) for g in pair]
    problems = [problem(g, seed=i) for i, g in enumerate(groups)]
    plan = make_plan(groups, 1)
    assert {s.kind for s in plan.steps} == {StepKind.WHOLE}
    results, damping, solved = execute(plan, groups, problems)
    assert sorted(map(len, solved)) == [3, 3]  # one batch per shape, each handed over as soon as solved
    for g, (weights, h) in zip(groups, problems):
        expected, expected_damping = reference(g, weights, h, [(0, g.rows)])
        assert_equal(results[g.name], expected)  # batched bits equal one-at-a-time bits (test_gptq)
        assert damping[g] == expected_damping == RECIPE.dampening_frac


@pytest.mark.parametrize("preset", ["NVFP4", "FP8_BLOCK", "FP8", "MXFP4"])
def test_every_strategy_splits_rows_exactly(preset, small_pieces):
    """Tensor, block and tensor-group scales come from each module's whole weight (q, k and v sharing NVFP4's
    global scale): the rows that ranks solve apart, spread or not, are the one-rank solve's bits."""
    recipe = Recipe(scheme=preset)
    group = Group((("q_proj", 40), ("k_proj", 24), ("v_proj", 24)), 160)
    plan = sliced(_schedule([group], 1, CostModel(), [group], True), [30, 50])
    weights, h = problem(group)
    args = dict.fromkeys(weights, recipe.weights)
    qparams = gptq.module_qparams({n: types.SimpleNamespace(weight=w) for n, w in weights.items()}, args,
                                  Family.fused_scales)
    executor = Executor(World(), plan, [group], weights, recipe, 0, lambda solved: None, args, qparams)
    results = executor.run({group.name: h.clone()}, SAMPLES)
    prep = gptq.prepare((h / SAMPLES)[None], recipe.weights.actorder, recipe.dampening_frac)
    tables = [gptq.row_qparams(qparams[n], recipe.weights, rows) for n, rows in group.modules]
    scale = torch.cat([t[0] for t in tables])[None]
    expected = gptq.solve(torch.cat(list(weights.values()))[None], prep, recipe.weights, recipe.block_size, scale)
    assert torch.equal(results[group.name], expected[0])
    if preset == "NVFP4":
        assert len({q.global_scale.item() for q in qparams.values()}) == 1
