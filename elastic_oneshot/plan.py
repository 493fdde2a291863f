"""The weight-parallel plan: which rank solves which GPTQ work. Pure: derived from names and shapes only,
so every rank computes the same plan and no collective can wait on a rank that saw other modules.

A unit of work is an input group (modules sharing a Hessian, their rows stacked). Its cost is
    prep  = a * d^3                (Cholesky, inverse, Cholesky of the inverse; d = input features)
    solve = b * rows * d^2 + c * d (the blocked solve; c is the per-column overhead of the loop)
Groups are assigned longest-processing-time first. A group whose cost would exceed the ideal makespan
(total / W) is split by output rows: its prep runs once on the first slice's rank, which sends the
inverse to the others (rows are independent once it is known).
"""

import dataclasses
import math
import re

# Sibling modules that read the same input tensor, and so share one Hessian.
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


EXPERT = re.compile(r"(.*\.experts)\.\d+\.(gate_proj|up_proj)$")


def input_groups(names: list[str], all_experts: bool = False) -> list[list[str]]:
    """Module names grouped by shared input, in first-appearance order. With all-experts calibration
    every expert's gate and up projections read the same tokens: one group for all of them."""
    groups: dict = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        expert = EXPERT.match(name) if all_experts else None
        key = (expert.group(1), "gate_up") if expert else next(((parent, s) for s in SHARED_INPUTS if leaf in s), name)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per unit for one CPU thread, fitted on an AMD EPYC (bench/scaling.py refits it and prints
    the error). The solve is far from BLAS speed: its column loop is bound by memory and overhead."""

    a: float = 2.0e-11
    b: float = 6.4e-11
    c: float = 8.0e-5

    def prep(self, d: int) -> float:
        return self.a * d**3

    def solve(self, rows: int, d: int) -> float:
        return self.b * rows * d * d + self.c * d


@dataclasses.dataclass(frozen=True)
class Group:
    modules: tuple[tuple[str, int], ...]  # (name, output rows) in stacking order
    cols: int

    @property
    def name(self) -> str:
        return self.modules[0][0]

    @property
    def rows(self) -> int:
        return sum(r for _, r in self.modules)


def layer_groups(layer, names: list[str], all_experts: bool = False) -> list[Group]:
    """The input groups of a decoder layer (a module, possibly on the meta device) for `names` in it."""
    modules = dict(layer.named_modules())
    return [Group(tuple((n, modules[n].out_features) for n in g), modules[g[0]].in_features)
            for g in input_groups(names, all_experts)]


@dataclasses.dataclass(frozen=True)
class Work:
    group: Group
    start: int  # stacked row range [start, end)
    end: int
    rank: int
    prep_rank: int  # the rank that computes this group's inverse Hessian (and receives the Hessian)
    cost: float

    @property
    def split(self) -> bool:
        return (self.start, self.end) != (0, self.group.rows)

    def pieces(self):
        """(module, first row, last row) of each module this slice covers, in module-local rows."""
        offset = 0
        for name, rows in self.group.modules:
            lo, hi = max(self.start, offset), min(self.end, offset + rows)
            if lo < hi:
                yield name, lo - offset, hi - offset
            offset += rows


@dataclasses.dataclass
class Plan:
    work: list[Work]  # in the order every rank executes and broadcasts them
    world_size: int

    def loads(self) -> list[float]:
        loads = [0.0] * self.world_size
        for w in self.work:
            loads[w.rank] += w.cost
        return loads

    @property
    def makespan(self) -> float:
        return max(self.loads())

    @property
    def total(self) -> float:
        return sum(self.loads())

    @property
    def balance(self) -> float:
        """Ideal makespan (total / W) over the planned one: 1.0 is perfect."""
        return self.total / self.world_size / self.makespan if self.makespan else 1.0

    def owners(self) -> dict[str, int]:
        return {w.group.name: w.prep_rank for w in self.work}


def _slices(rows: int, k: int) -> list[tuple[int, int]]:
    k = max(1, min(k, rows))
    return [(i * rows // k, (i + 1) * rows // k) for i in range(k)]


def make_plan(groups: list[Group], world_size: int, cost: CostModel = CostModel()) -> Plan:
    """LPT assignment, with dominant groups split by rows when that lowers the makespan."""
    whole = _lpt(groups, world_size, cost, split=False)
    if world_size == 1:
        return whole
    split = _lpt(groups, world_size, cost, split=True)
    return split if split.makespan < whole.makespan else whole


def _lpt(groups: list[Group], world_size: int, cost: CostModel, split: bool) -> Plan:
    totals = {g.name: cost.prep(g.cols) + cost.solve(g.rows, g.cols) for g in groups}
    ideal = sum(totals.values()) / world_size
    items = []  # (cost, order, group, start, end, holds_prep)
    for order, g in enumerate(groups):
        k = math.ceil(totals[g.name] / ideal) if split and world_size > 1 else 1
        slices = _slices(g.rows, min(k, world_size))
        for i, (start, end) in enumerate(slices):
            c = cost.solve(end - start, g.cols) + (cost.prep(g.cols) if i == 0 else 0.0)
            items.append((c, order, g, start, end, i == 0))
    loads = [0.0] * world_size
    assigned: dict[tuple[str, int], int] = {}
    prep_rank: dict[str, int] = {}
    # Longest first; ties broken by module order so that the plan is a pure function of the shapes.
    for c, order, g, start, end, holds_prep in sorted(items, key=lambda t: (-t[0], t[1], t[3])):
        taken = {r for (name, _), r in assigned.items() if name == g.name}
        candidates = [r for r in range(world_size) if r not in taken] or list(range(world_size))
        rank = min(candidates, key=lambda r: (loads[r], r))
        loads[rank] += c
        assigned[(g.name, start)] = rank
        if holds_prep:
            prep_rank[g.name] = rank
    work = [Work(g, start, end, assigned[(g.name, start)], prep_rank[g.name], c)
            for c, order, g, start, end, _ in sorted(items, key=lambda t: (t[1], t[3]))]
    # Execution order: inverses that others wait for first, then the rest in module order.
    work.sort(key=lambda w: (not (w.start == 0 and any(o.group is w.group and o.split for o in work)),
                             groups.index(w.group), w.start))
    return Plan(work, world_size)


def peer_plan(groups: list[Group], world_size: int, cost: CostModel = CostModel()) -> Plan:
    """llmcompressor's assignment for comparison: one module per unit (no shared Hessians), greedy bin
    packing on in_features, costed with our model."""
    singles = [Group(((name, rows),), g.cols) for g in groups for name, rows in g.modules]
    loads = [0.0] * world_size
    work = []
    for s in sorted(singles, key=lambda s: -s.cols):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += s.cols
        work.append(Work(s, 0, s.rows, rank, rank, cost.prep(s.cols) + cost.solve(s.rows, s.cols)))
    return Plan(work, world_size)


def describe(plan: Plan) -> list[str]:
    """A plan in a few lines: per rank its work (names, or counts when many) and load; then the balance."""
    lines = []
    for rank in range(plan.world_size):
        mine = [w for w in plan.work if w.rank == rank]
        names = ["+".join([w.group.modules[0][0]] + [n.rsplit(".", 1)[-1] for n, _ in w.group.modules[1:]]) +
                 (f"[rows {w.start}:{w.end}]" if w.split else "") for w in mine]
        shown = ", ".join(names) if len(names) <= 6 else f"{len(names)} groups"
        lines.append(f"  rank {rank}: {sum(w.cost for w in mine):8.3f} s  {shown}")
    lines.append(f"  makespan {plan.makespan:.3f} s, ideal {plan.total / plan.world_size:.3f} s, "
                 f"balance {plan.balance:.3f}")
    return lines
