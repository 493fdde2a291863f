"""The weight-parallel plan: which rank does which GPTQ step, in which order. Pure: derived from names
and shapes only, so every rank computes the same plan and no collective can wait on a rank that saw
other modules.

A unit of work is an input group (modules sharing a Hessian, their rows stacked), costed as
    factor = a * d^3                (the peer's three steps to the inverse factor; d = input features)
    wide Hessians (cholesky.cholesky_panels) instead: a blocked fp64 Cholesky of the reversed Hessian,
    panel  = 3f * (w^3 / 3 + (d - end) * w^2)      one column panel of width w,
    update = 3f * 2 * (d - start) * w * w'         a later column piece minus a panel's product,
    invert = i * end^2 * rows                      a row piece of the triangular inverse;
    solve  = b * rows * d^2 + c * d (the blocked solve; c is the per-column overhead of the loop).
Most groups are done whole on one rank. A group costing more than half the ideal makespan (total / W)
is shared when that shortens the plan: one rank factors it, or for a wide one every rank factors the
column pieces it owns (round robin) as the panels arrive; the inverse's row pieces start as soon as the
panels they need are done; then the output rows are water-filled over the ranks (rows are independent
once the inverse is known). Steps are placed by list scheduling (earliest finish, into the first gap
that fits, honouring those dependencies) and run in the order of their modeled start, so the plan's
makespan is a simulation of the run, waits included.
"""

import bisect
import dataclasses
import enum
import re
from collections.abc import Callable, Hashable

from elastic_oneshot.errors import UsageError
from elastic_oneshot.quantization.cholesky import cholesky_panels, inverse_pieces


def input_groups(names: list[str], input_of: Callable[[str], Hashable]) -> list[list[str]]:
    """Module names grouped by the input they read (`input_of`: the family's answer, Family.input_key), in
    first-appearance order: a group shares one Hessian."""
    groups: dict = {}
    for name in names:
        groups.setdefault(input_of(name), []).append(name)
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per unit for one CPU thread, fitted on an AMD EPYC (bench/scaling.py prints the error). The
    solve is far from BLAS speed: its column loop is bound by memory and per-column overhead."""

    a: float = 2.0e-11
    f: float = 1.16e-11
    i: float = 2.84e-11
    b: float = 6.4e-11
    c: float = 8.0e-5

    def factor(self, d: int) -> float:
        return (self.f if cholesky_panels(d) else self.a) * d**3

    def panel(self, d: int, start: int, end: int) -> float:  # 3f per flop: a Cholesky is d^3 / 3 flops
        return 3 * self.f * ((end - start) ** 3 / 3 + (d - end) * (end - start) ** 2)

    def update(self, d: int, start: int, end: int, width: int) -> float:
        return 3 * self.f * 2 * (d - start) * (end - start) * width

    def invert(self, d: int, start: int, end: int) -> float:
        return self.i * end**2 * (end - start)

    def solve(self, rows: int, d: int) -> float:
        return self.b * rows * d * d + self.c * d

    def whole(self, g: "Group") -> float:
        return (self.factor(g.cols) + sum(self.invert(g.cols, s, e) for s, e in inverse_pieces(g.cols)) +
                self.solve(g.rows, g.cols))


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


def layer_groups(layer, names: list[str], input_of: Callable[[str], Hashable]) -> list[Group]:
    """The input groups of a decoder layer (a module, possibly on the meta device) for `names` in it."""
    modules = dict(layer.named_modules())
    return [Group(tuple((n, modules[n].out_features) for n in g), modules[g[0]].in_features)
            for g in input_groups(names, input_of)]


HESSIAN_BYTES = 16  # per Hessian element of a group, with room: its fp64 total with the fp32 chunk sum in
# calibration, or with the fp32 copy that factoring makes of it (12 either way)
SOLVING_BYTES = 8  # per weight element of a group being solved: its fp32 copy and the fp32 result
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def memory_batches(groups: list[Group], budget: int, itemsize: int = 0) -> list[list[Group]]:
    """`groups` in order, in batches whose Hessians fit in `budget` bytes (a group larger than that alone): a
    layer of many experts is calibrated and solved a batch at a time, so its working set is bounded, at the cost
    of one more calibration pass over the layer's inputs per batch. Each group's result does not depend on the
    batches (its Hessian sees the same inputs), so neither do the bits. `itemsize`: where the weights are read
    with their batch (a streamed layer's experts), their element size; they count too, with their fp32 copies
    while solved."""
    out, used = [[]], 0
    for g in groups:
        need = HESSIAN_BYTES * g.cols**2 + ((itemsize + SOLVING_BYTES) * g.rows * g.cols if itemsize else 0)
        if out[-1] and used + need > budget:
            out.append([])
            used = 0
        out[-1].append(g)
        used += need
    return out


def parse_bytes(text: str) -> int:
    """`--max-memory`: bytes, with an optional unit (12GB, 12GiB, 500MB)."""
    found = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = _UNITS.get(found.group(2).lower()) if found else None
    try:
        value = float(found.group(1)) * unit if unit else 0.0
    except ValueError:
        value = 0.0
    if value < 1:
        raise UsageError(f"--max-memory {text!r} is not a size in bytes (e.g. 24GB, 16GiB)")
    return int(value)


class StepKind(enum.Enum):
    WHOLE = "whole"  # factor, invert and solve one group on one rank; or one step of a shared group:
    FACTOR = "factor"  # its inverse factor (for a wide group: its Cholesky factor) on one rank; or, spread,
    PANEL = "panel"  # columns start:end of the Cholesky factor, and
    UPDATE = "update"  # the column piece start:end minus the product of an earlier panel (the one at `panel`);
    INVERT = "invert"  # rows start:end of the Cholesky factor's triangular inverse;
    SOLVE = "solve"  # the stacked rows start:end


@dataclasses.dataclass(frozen=True)
class Step:
    kind: StepKind
    group: Group
    start: int
    end: int
    rank: int
    begin: float  # modeled start and duration, seconds
    cost: float
    panel: int | None = None  # update steps: the first column of the panel they apply

    def pieces(self):
        """(module, first row, last row) of each module a whole or solve step covers, in module-local rows."""
        offset = 0
        for name, rows in self.group.modules:
            lo, hi = max(self.start, offset), min(self.end, offset + rows)
            if lo < hi:
                yield name, lo - offset, hi - offset
            offset += rows


@dataclasses.dataclass
class Plan:
    steps: list[Step]  # in the order every rank executes them and broadcasts their results
    world_size: int

    def loads(self) -> list[float]:
        loads = [0.0] * self.world_size
        for s in self.steps:
            loads[s.rank] += s.cost
        return loads

    @property
    def makespan(self) -> float:
        return max((s.begin + s.cost for s in self.steps), default=0.0)

    @property
    def total(self) -> float:
        return sum(self.loads())

    @property
    def balance(self) -> float:
        """Ideal makespan (total / W) over the planned one: 1.0 is perfect."""
        return self.total / self.world_size / self.makespan if self.makespan else 1.0

    def owners(self) -> dict[str, int]:
        """The rank that receives each group's Hessian (and writes its result)."""
        owners = {}
        for s in self.steps:
            if s.kind in (StepKind.WHOLE, StepKind.FACTOR, StepKind.PANEL):
                owners.setdefault(s.group.name, s.rank)
        return owners

    def shared(self, group: Group) -> bool:
        return any(s.group is group and s.kind != StepKind.WHOLE for s in self.steps)


def make_plan(groups: list[Group], world_size: int, cost: CostModel = CostModel()) -> Plan:
    """The shortest plan of: every group whole; the large ones shared, wide Cholesky factors on one rank;
    the same with wide factors spread (every variant computes the same bits)."""
    ideal = sum(cost.whole(g) for g in groups) / world_size
    large = [g for g in groups if world_size > 1 and cost.whole(g) > ideal / 2]
    return min((_schedule(groups, world_size, cost, shared, spread) for shared, spread in
                (([], False), (large, False), (large, True))), key=lambda p: p.makespan)


def _schedule(groups: list[Group], world_size: int, cost: CostModel, shared: list[Group], spread: bool) -> Plan:
    busy: list[list[tuple[float, float]]] = [[] for _ in range(world_size)]
    steps = []

    def earliest(rank, ready, seconds):  # the first gap on `rank` after `ready` that fits
        t = ready
        for begin, end in busy[rank]:
            if t + seconds <= begin:
                return t
            t = max(t, end)
        return t

    def place(kind, g, start, end, seconds, ready, rank=None, panel=None):
        if rank is None:
            rank = min(range(world_size), key=lambda r: (earliest(r, ready, seconds) + seconds, r))
        begin = earliest(rank, ready, seconds)
        bisect.insort(busy[rank], (begin, begin + seconds))
        steps.append(Step(kind, g, start, end, rank, begin, seconds, panel))
        return begin + seconds

    def free():
        return [b[-1][1] if b else 0.0 for b in busy]

    # Factorizations others wait for first, largest first; then whole groups longest first (ties in
    # module order, so that the plan is a pure function of the shapes); then the shared inverses and rows.
    factored = {}
    for g in sorted(shared, key=lambda g: -g.cols):
        spans = cholesky_panels(g.cols)
        if not (spans and spread):
            factored[g.name] = place(StepKind.FACTOR, g, 0, 0, cost.factor(g.cols), 0.0)
            continue
        # Column pieces dealt round-robin from the rank free soonest; each owner applies every earlier
        # panel to its pieces, in panel order.
        ranks = sorted(range(world_size), key=lambda r: (free()[r], r))
        ready, factored[g.name] = [0.0] * len(spans), []
        for k, (start, end) in enumerate(spans):
            done = place(StepKind.PANEL, g, start, end, cost.panel(g.cols, start, end), ready[k],
                         ranks[k % world_size])
            factored[g.name].append(done)
            for j in range(k + 1, len(spans)):
                ready[j] = place(StepKind.UPDATE, g, *spans[j], cost.update(g.cols, *spans[j], end - start),
                                 max(done, ready[j]), ranks[j % world_size], panel=start)
    for g in sorted((g for g in groups if g not in shared), key=lambda g: -cost.whole(g)):
        place(StepKind.WHOLE, g, 0, g.rows, cost.whole(g), 0.0)
    for g in shared:
        done, spans = factored[g.name], cholesky_panels(g.cols)  # when the factor is complete, or each panel

        def needs(end, done=done, spans=spans):  # an inverse piece needs the panels before its end
            return max(t for t, (s, _) in zip(done, spans) if s < end) if spread else done
        ready = max((place(StepKind.INVERT, g, s, e, cost.invert(g.cols, s, e), needs(e))
                     for s, e in sorted(inverse_pieces(g.cols), key=lambda p: -p[1])), default=done)
        for rank, (lo, hi) in _fill(free(), ready, g.rows, cost.b * g.cols**2, cost.c * g.cols):
            place(StepKind.SOLVE, g, lo, hi, cost.solve(hi - lo, g.cols), ready, rank)
    order = {id(s): i for i, s in enumerate(steps)}
    steps.sort(key=lambda s: (s.begin, order[id(s)]))
    return Plan(steps, world_size)


def _fill(free: list[float], ready: float, rows: int, per_row: float, overhead: float):
    """(rank, row range) slices of `rows` that finish together on the ranks free soonest (water-filling)."""
    start = {r: max(f, ready) + overhead for r, f in enumerate(free)}
    ranks = sorted(start, key=lambda r: (start[r], r))[:rows]
    while True:
        end = (rows * per_row + sum(start[r] for r in ranks)) / len(ranks)
        if len(ranks) == 1 or start[ranks[-1]] < end - per_row:
            break
        ranks.pop()
    ranks.sort()
    bounds, acc = [0], 0.0
    for r in ranks:
        acc += (end - start[r]) / per_row
        bounds.append(min(rows, max(bounds[-1] + 1, round(acc))))
    bounds[-1] = rows
    return [(r, (lo, hi)) for r, lo, hi in zip(ranks, bounds, bounds[1:]) if lo < hi]


def peer_plan(groups: list[Group], world_size: int, cost: CostModel = CostModel()) -> Plan:
    """llmcompressor's assignment for comparison: one module per unit (no shared Hessians), greedy bin
    packing on in_features, costed with our model (each module's steps back to back on its rank)."""
    singles = [Group(((name, rows),), g.cols) for g in groups for name, rows in g.modules]
    bins, free, steps = [0] * world_size, [0.0] * world_size, []
    for s in sorted(singles, key=lambda s: -s.cols):
        rank = min(range(world_size), key=lambda r: (bins[r], r))
        bins[rank] += s.cols
        steps.append(Step(StepKind.WHOLE, s, 0, s.rows, rank, free[rank], cost.whole(s)))
        free[rank] += cost.whole(s)
    return Plan(steps, world_size)


def describe(plan: Plan) -> list[str]:
    """A plan in a few lines: per rank its steps (names, or counts when many) and busy time; then the
    makespan and balance."""
    lines = []
    for rank in range(plan.world_size):
        steps = [s for s in plan.steps if s.rank == rank]
        names = []
        for s in steps:
            name = "+".join([s.group.modules[0][0]] + [n.rsplit(".", 1)[-1] for n, _ in s.group.modules[1:]])
            names.append(name + {StepKind.WHOLE: "", StepKind.FACTOR: " factor",
                                 StepKind.PANEL: f" cholesky[cols {s.start}:{s.end}]",
                                 StepKind.UPDATE: f" update[{s.start}:] by [{s.panel}:]",
                                 StepKind.INVERT: f" inverse[rows {s.start}:{s.end}]",
                                 StepKind.SOLVE: f"[rows {s.start}:{s.end}]"}[s.kind])
        shown = ", ".join(names) if len(names) <= 6 else f"{len(names)} steps"
        lines.append(f"  rank {rank}: {sum(s.cost for s in steps):8.3f} s  {shown}")
    lines.append(f"  makespan {plan.makespan:.3f} s, ideal {plan.total / plan.world_size:.3f} s, "
                 f"balance {plan.balance:.3f}")
    return lines
