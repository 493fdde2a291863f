"""One rank's part of a layer's GPTQ plan (plan.make_plan): compute and collectives, no I/O.

Every rank walks the plan's steps in the same order, computes its own and issues, for every step whose
result others need, that step's broadcast at once (asynchronously): a rank waits on a broadcast only
when a step of its own needs the result, and that result comes from an earlier step, so no rank ever
waits on a later one. Whole groups of one shape are solved in one batch (MoE experts). A shared group's
factor comes from one rank, or (spread, when wide) panel by panel from all of them; then the pieces of
its inverse, then row slices of its solve. Every rank ends with every group's result.

Each module's qparams come from its whole original weight (gptq.module_qparams), which every rank holds, so a
row slice is solved with its rows' scales: no rank needs another's rows to quantize its own.
"""

import dataclasses
import logging
from collections.abc import Callable

import torch
from compressed_tensors.quantization import QuantizationArgs

from elastic_oneshot.distributed.world import World
from elastic_oneshot.quantization import gptq
from elastic_oneshot.quantization.cholesky import (
    assemble,
    cholesky_panel,
    cholesky_panels,
    cholesky_update,
    inverse_pieces,
    inverse_rows,
    reversed_columns,
)
from elastic_oneshot.quantization.plan import Group, Plan, Step, StepKind
from elastic_oneshot.quantization.recipe import Recipe

log = logging.getLogger("elastic_oneshot")


def _batches(items: list, key, size, limit: int) -> list[list]:
    """Items of equal `key` in batches whose total `size` (elements) stays under `limit`, in order."""
    out, open_ = [], {}
    for item in items:
        batch = open_.get(key(item))
        if batch is None or sum(size(i) for i in batch) + size(item) > limit:
            batch = open_[key(item)] = []
            out.append(batch)
        batch.append(item)
    return out


def _normalized(hessian, num_samples: int):
    """The Hessian divided by the sample count in place (a copy would be a GPU's peak)."""
    gptq.packed(hessian).div_(num_samples)
    return hessian


def _wait(works):
    for w in works:
        if w is not None:
            w.wait()


@dataclasses.dataclass
class SharedFactor:
    """A shared group's factor on this rank, filled as broadcasts arrive: whole from the rank that factored
    it, or (spread) panel by panel, each rank updating and factoring the column pieces it owns; then the
    row pieces of its inverse, and the inverse factor once assembled."""

    matrix: torch.Tensor  # [1, d, d] what gptq.factor gives: the inverse's upper factor, or (wide) the
    # Cholesky factor of the reversed Hessian (gptq.Factored)
    meta: torch.Tensor  # [1, 2d + 1] the solve's column order, packed as gptq packs it
    works: list = dataclasses.field(default_factory=list)  # broadcasts of `matrix` and `meta`
    columns: dict = dataclasses.field(default_factory=dict)  # spread: start column -> column piece
    panels: dict = dataclasses.field(default_factory=dict)  # spread: start column -> (panel, its broadcast)
    placed: set = dataclasses.field(default_factory=set)  # spread: start columns of the panels in `matrix`
    inverse: dict = dataclasses.field(default_factory=dict)  # start row -> (piece of the inverse, its broadcast)
    prepared: gptq.Prepared | None = None

    def upto(self, end: int) -> torch.Tensor:
        """The factor [d, d], complete in the columns before `end`."""
        _wait(self.works)
        for start, (panel, work) in self.panels.items():
            if start < end and start not in self.placed:
                _wait([work])
                self.matrix[0, start:, start:start + panel.shape[-1]] = panel
                self.placed.add(start)
        return self.matrix[0]


class Executor:
    """Runs `plan` for `groups` on this rank. `weights`: module name -> weight [rows, cols] on this rank's
    device; `args` and `qparams`: module name -> its weights' QuantizationArgs (one per group) and QParams.
    `on_solved` receives [(group, solved weight)] of the groups this rank owns as soon as they are solved
    (the runner persists them); `damping` holds the damping of the groups whose Hessian this rank factored
    (None: round-to-nearest)."""

    def __init__(self, world: World, plan: Plan, groups: list[Group], weights: dict, recipe: Recipe, layer: int,
                 on_solved: Callable[[list[tuple[Group, torch.Tensor]]], None],
                 args: dict[str, QuantizationArgs], qparams: dict[str, gptq.QParams]):
        self.world, self.plan, self.groups, self.weights = world, plan, groups, weights
        self.args, self.qparams = args, qparams
        self.frac, self.block = recipe.dampening_frac, recipe.block_size
        self.layer, self.on_solved = layer, on_solved
        self.owners = plan.owners()
        self.spread = {s.group.name for s in plan.steps if s.kind == StepKind.PANEL}  # every rank factors a piece
        wholes = [s for s in plan.steps if s.kind == StepKind.WHOLE and s.rank == world.rank]
        limit = gptq.SOLVE_ELEMENTS if world.device.type == "cpu" else gptq.DEVICE_SOLVE_ELEMENTS
        self.batch_of = {id(s): b for b in _batches(wholes, self._batch_key,
                                                    lambda s: s.group.cols * (s.group.rows + s.group.cols), limit)
                         for s in b}
        self.hessian: dict[str, torch.Tensor] = {}  # normalized, of the groups this rank factors
        self.shared: dict[str, SharedFactor] = {}
        self.results: dict[str, torch.Tensor] = {}  # every group's solved rows (a shared group's, step by step)
        self.pending: list = []  # broadcasts of results
        self.damping: dict[Group, float | None] = {}

    def run(self, hessians: dict, num_samples: int, ranges: dict | None = None) -> dict[str, torch.Tensor]:
        """Every group's solved weight, from this rank's Hessian sums (group name -> gptq.Lower, or the whole
        [d, d] matrix; cleared here: only the normalized ones are kept, each until its fp32 copy is made);
        `ranges` (calibration.Calibration's) reduced over all ranks in place."""
        works = [self.world.all_reduce(gptq.packed(hessians[g.name])) if g.name in self.spread else
                 self.world.reduce_to(gptq.packed(hessians[g.name]), self.owners[g.name]) for g in self.groups]
        self._reduce_ranges(ranges or {})
        _wait(works)
        self.hessian = {g.name: _normalized(hessians[g.name], num_samples) for g in self.groups
                        if self.owners[g.name] == self.world.rank or g.name in self.spread}
        hessians.clear()
        do = {StepKind.WHOLE: self.whole, StepKind.FACTOR: self.factor, StepKind.PANEL: self.panel,
              StepKind.UPDATE: self.update, StepKind.INVERT: self.invert, StepKind.SOLVE: self.solve}
        for step in self.plan.steps:
            do[step.kind](step)
        _wait(self.pending)
        return self.assemble()

    # -- one method per step kind ------------------------------------------------------------------------
    def whole(self, s: Step):
        """Factor, invert and solve a group on its rank, with the other groups of its batch."""
        g = s.group
        if s.rank != self.world.rank:
            self.results[g.name] = self._empty(g.rows, g.cols, dtype=self._dtype(g))
        elif g.name not in self.results:  # else solved with an earlier step of its batch
            batch = self.batch_of[id(s)]
            # factor, then invert, with nothing else holding the Hessians: each fp64 sum goes as its fp32 copy is
            # made, and factor works on those in place
            prep = gptq.invert(gptq.factor([gptq.dense(self.hessian.pop(o.group.name)) for o in batch],
                                           self.args[g.name].actorder, self.frac))
            r = self._solve(batch, prep, self._empty(len(batch), g.rows, g.cols, dtype=self._dtype(g)))
            for i, o in enumerate(batch):
                self.results[o.group.name] = r[i]
                self._note(o.group, prep.damping[i])
            self.on_solved([(o.group, r[i]) for i, o in enumerate(batch)])
        self.pending.append(self.world.broadcast(self.results[g.name], s.rank))

    def factor(self, s: Step):
        """A shared group's factor, on one rank, to every rank."""
        g = s.group
        if s.rank == self.world.rank:
            factored = gptq.factor([gptq.dense(self.hessian.pop(g.name))], self.args[g.name].actorder, self.frac)
            self._note(g, factored.damping[0])
            matrix, meta = factored.pack()
        else:
            matrix, meta = self._empty(1, g.cols, g.cols), self._empty(1, 2 * g.cols + 1, dtype=torch.float64)
        self.shared[g.name] = SharedFactor(matrix, meta, [self.world.broadcast(t, s.rank) for t in (matrix, meta)])

    def panel(self, s: Step):
        """Columns start:end of a spread Cholesky factor, on the rank that owns them, to every rank."""
        f, width = self._spread(s.group), s.end - s.start
        panel = cholesky_panel(f.columns[s.start]) if s.rank == self.world.rank else \
            self._empty(s.group.cols - s.start, width, dtype=torch.float64)
        f.panels[s.start] = (panel, self.world.broadcast(panel, s.rank))

    def update(self, s: Step):
        """The owner's column piece start:end minus the product of the panel at `s.panel`."""
        if s.rank == self.world.rank:
            f = self._spread(s.group)
            panel, work = f.panels[s.panel]
            _wait([work])
            cholesky_update(f.columns[s.start], panel, s.start - s.panel)

    def invert(self, s: Step):
        """Rows start:end of the factor's triangular inverse, to every rank."""
        f = self.shared[s.group.name]
        piece = inverse_rows(f.upto(s.end), s.start, s.end) if s.rank == self.world.rank else \
            self._empty(s.end - s.start, s.end)
        f.inverse[s.start] = (piece, self.world.broadcast(piece, s.rank))

    def solve(self, s: Step):
        """Rows start:end of a shared group, into the group's result, to every rank."""
        g = s.group
        if g.name not in self.results:
            self.results[g.name] = self._empty(g.rows, g.cols, dtype=self._dtype(g))
        out = self.results[g.name][s.start:s.end]
        if s.rank == self.world.rank:
            self._solve([s], self._prepared(g), out[None])
        self.pending.append(self.world.broadcast(out, s.rank))

    # -- the rest ----------------------------------------------------------------------------------------
    def assemble(self) -> dict[str, torch.Tensor]:
        """Every group's result; the shared groups this rank owns handed to `on_solved`."""
        for g in self.groups:
            if g.name in self.spread and self.owners[g.name] == self.world.rank:
                self._note(g, self._prepared(g).damping[0])
        results = self.results
        owned = [(g, results[g.name]) for g in self.groups if self.owners[g.name] == self.world.rank and
                 self.plan.shared(g)]
        if owned:
            self.on_solved(owned)
        return results

    def _spread(self, g: Group) -> SharedFactor:
        """A spread group's factor: this rank's copy of the column pieces, from the all-reduced Hessian."""
        if g.name not in self.shared:
            h, perm, dead, _ = gptq.order(gptq.dense(self.hessian[g.name])[None], self.args[g.name].actorder)
            starts = [start for start, _ in cholesky_panels(g.cols)]
            matrix = torch.zeros(1, g.cols, g.cols, device=self.world.device)
            self.shared[g.name] = SharedFactor(
                matrix, gptq.Factored(matrix, perm, dead, [self.frac]).pack()[1],
                columns=dict(zip(starts, reversed_columns(gptq.damp(h[0], self.frac)))))
        return self.shared[g.name]

    def _prepared(self, g: Group) -> gptq.Prepared:
        """A shared group's inverse factor, once its factor and every piece of its inverse have arrived."""
        f = self.shared[g.name]
        if f.prepared is None:
            matrix = f.upto(g.cols)
            _wait([work for _, work in f.inverse.values()])
            spans = inverse_pieces(g.cols)
            if g.name in self.spread and matrix.isnan().any():  # not positive definite: every rank retries alone
                f.prepared = gptq.prepare(gptq.dense(self.hessian[g.name])[None], self.args[g.name].actorder, self.frac)
            elif spans:
                order = gptq.Factored.unpack(f.matrix, f.meta)
                hinv = assemble([f.inverse[start][0] for start, _ in spans], g.cols)
                f.prepared = gptq.Prepared(hinv[None], order.perm, order.dead, order.damping)
            else:
                f.prepared = gptq.Prepared.unpack(f.matrix, f.meta)
        return f.prepared

    def _solve(self, steps: list[Step], prep: gptq.Prepared, out: torch.Tensor) -> torch.Tensor:
        """GPTQ of the steps' rows (a batch of one shape) into `out` [B, rows, cols], pass by pass (gptq.passes),
        each pass's rows taken from the modules' weights as it starts: no copy of a whole group's rows is made
        (an MoE layer's gate/up group, shared by every expert in all-experts calibration, holds all of theirs)."""
        args, (scale, zero_point) = self.args[steps[0].group.name], self._scales(steps)
        for lo, hi in gptq.passes(*out.shape, out.device):
            rows = gptq.as_batch([self._rows(s, lo, hi) for s in steps])
            gptq.solve(rows, prep, args, self.block, scale[:, lo:hi],
                       None if zero_point is None else zero_point[:, lo:hi], out=out[:, lo:hi])
        return out

    def _rows(self, s: Step, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of a step's rows, stacked from its modules' weights: a view where they lie in one module."""
        parts, at = [], 0
        for name, a, b in s.pieces():
            first, last = max(lo - at, 0), min(hi - at, b - a)
            if first < last:
                parts.append(self.weights[name][a + first:a + last])
            at += b - a
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _batch_key(self, s: Step):
        """Whole groups solved in one batch: same shape, same quantization."""
        return s.group.rows, s.group.cols, self.args[s.group.name].model_dump_json()

    def _scales(self, steps: list[Step]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, rows, column groups] effective scales and zero points (None: symmetric) of the steps' rows."""
        tables = []
        for s in steps:
            parts = [gptq.row_qparams(self.qparams[name], self.args[name], self.weights[name].shape[0])
                     for name, _, _ in s.pieces()]
            tables.append([torch.cat([t[i][lo:hi] for t, (_, lo, hi) in zip(parts, s.pieces())])
                           if parts[0][i] is not None else None for i in (0, 1)])
        scale, zero_point = zip(*tables)
        return torch.stack(scale), None if zero_point[0] is None else torch.stack(zero_point)

    def _reduce_ranges(self, ranges: dict):
        """Min and max over all ranks, exactly: every rank's values summed into its own slot of zeros (an
        all-gather by sum), then reduced here."""
        if not ranges or not self.world.distributed:
            return
        names = sorted(ranges)
        slots = torch.zeros(self.world.size, len(names), 2, dtype=torch.float64, device=self.world.device)
        slots[self.world.rank] = torch.stack([ranges[n].double() for n in names])
        _wait([self.world.all_reduce(slots)])
        for i, n in enumerate(names):
            ranges[n] = torch.stack([slots[:, i, 0].amin(), slots[:, i, 1].amax()]).to(ranges[n].dtype)

    def _dtype(self, g: Group) -> torch.dtype:
        return self.weights[g.name].dtype

    def _empty(self, *shape, dtype=torch.float32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=self.world.device)

    def _note(self, group: Group, damping: float | None):
        """Record the damping that worked; say so when it is not the recipe's, loudly when none did."""
        self.damping[group] = damping
        names = group.name + (f" (+{len(group.modules) - 1})" if len(group.modules) > 1 else "")
        if damping is None:
            log.error("!!! layer %d %s: Hessian not positive definite even with damping %.3g, or no calibration "
                      "token reached it: quantized with ROUND-TO-NEAREST, not GPTQ", self.layer, names,
                      max(self.frac, 0.01) * 10 ** gptq.DAMPING_RETRIES)
        elif damping != self.frac:
            log.warning("layer %d %s: Hessian not positive definite at damping %.3g; used %.3g", self.layer,
                        names, self.frac, damping)
