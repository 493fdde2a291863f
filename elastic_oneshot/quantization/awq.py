"""AWQ (Lin et al., 2023) as llmcompressor 0.14's AWQModifier runs it: a transform for the quantization modifier
after it. Pure math: no I/O, no processes; the layer step records a layer's calibration pass and runs this.

For each mapping of a layer, in order (the peer's): a smooth layer (a norm, or a Linear whose output rows can be
scaled), the balance layers that read its output, and their parent, the lowest module holding them all. Scales s
per input channel come from the mean |x| of the balance layers' input and, with duo scaling, the mean of their
normalized weights, raised to the powers of a grid of ratios; each grid point's loss is the squared error of the
parent's output over every calibration token when the balance layers' weights W s are rounded to nearest with
their scheme (W' = Q(W s) / s), against the parent's output with the weights as they are. The smallest loss wins;
its s multiplies the balance layers' input columns and divides the smooth layer's output (smoothing.fold).

Exact at any world size: both statistics are kept per calibration sample (a sample's sum of |x| per channel, a
sample's summed squared error per grid point) in slots indexed by the sample's global number. A rank fills its
samples' slots and leaves zeros elsewhere, so an all-reduce by sum adds only zeros to each slot; every rank then
sums the slots in sample order, as the peer sums its batches of one sample, and chooses the same scale, the peer's.
The work splits data-parallel: each rank runs the grid points on its own samples (the parent's forwards are the
cost: grid points x samples). `search` runs most points on only part of the samples: a point whose partial loss
already exceeds a whole point's loss cannot win, which the peer's choice is unchanged by, so it stops there (one
all-reduce per round of a point, instead of one per mapping). A sample's loss is summed on one thread, so its bits
do not depend on the thread count.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStrategy
from compressed_tensors.utils import get_lowest_common_ancestor_name, match_modules_set

from elastic_oneshot.errors import UsageError
from elastic_oneshot.quantization import rtn
from elastic_oneshot.quantization.cholesky import one_thread

FLOOR = 1e-4  # the least scale, and the damping of the weights' mean, with duo scaling
ROUNDS = 16  # the most rounds a grid point's errors are computed in (search)
ROUND_ELEMENTS = 4096  # the fewest output elements per rank a round computes: less is not worth a reduce and a sync

@dataclasses.dataclass(frozen=True)
class Mapping:
    """A resolved mapping, by full module name: `parent` is run for the loss; `hook` is the module whose input is
    the smoothed activation (the first balance layer's, or the mapping's activation hook target)."""

    smooth: str
    balance: tuple[str, ...]
    parent: str
    hook: str


def resolve(model: torch.nn.Module, mappings, schemes: dict[str, QuantizationScheme], duo_scaling=True
            ) -> list[Mapping]:
    """Each mapping's modules, one set per parent context (compressed-tensors' match_modules_set), as the peer
    resolves them: a set is skipped when it has no balance layer, when none of its layers is quantized (`schemes`:
    the quantization modifier's, by module), and when a v_proj (or fused qkv_proj) does not feed its o_proj
    channel for channel (grouped-query attention). Duo scaling needs weights quantized by channel or group.
    `model` may be on the meta device."""
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    out = []
    for smooth_pattern, balance_patterns, hook_target in mappings:
        try:
            sets = list(match_modules_set(model, [smooth_pattern, *balance_patterns]))
        except ValueError as e:
            raise UsageError(f"AWQ mapping {smooth_pattern} cannot be resolved: {e}") from None
        for smooth, *balance_sets in sets:
            if len(smooth) > 1:
                raise UsageError(f"AWQ mapping {smooth_pattern} matches {len(smooth)} smooth layers in one set "
                                 f"({', '.join(names[id(m)] for m in smooth)}): give a narrower pattern")
            smooth_name = names[id(smooth[0])]
            balance = tuple(names[id(m)] for group in balance_sets for m in group)
            if not balance or not _feeds(modules, smooth_name, balance) or \
                    not any(n in schemes for n in (smooth_name, *balance)):
                continue
            parent = _parent(modules, balance)
            hook = balance[0]
            if hook_target:
                hook = f"{parent}.{hook_target}" if parent else hook_target
                if hook not in modules:
                    raise UsageError(f"AWQ mapping {smooth_pattern}: activation_hook_target {hook_target!r} is not "
                                     f"a module of {parent or 'the model'}")
            out.append(Mapping(smooth_name, balance, parent, hook))
    if duo_scaling is not False:
        for m in out:
            for name in m.balance:
                if name in schemes and schemes[name].weights.strategy == QuantizationStrategy.TENSOR:
                    raise UsageError(f"AWQModifier duo_scaling needs weights quantized by channel or group, and "
                                     f"{name}'s are by tensor: set duo_scaling: false")
    return out


def _feeds(modules: dict, smooth: str, balance: tuple[str, ...]) -> bool:
    """False for a v_proj (or qkv_proj) whose outputs are not its o_proj's inputs one for one."""
    first = modules[smooth]
    for name in balance:
        layer = modules[name]
        if not (isinstance(first, torch.nn.Linear) and isinstance(layer, torch.nn.Linear) and name.endswith(".o_proj")):
            continue
        if smooth.endswith(".v_proj") and first.out_features != layer.in_features or \
                smooth.endswith(".qkv_proj") and first.out_features != 3 * layer.in_features:
            return False
    return True


def _parent(modules: dict, balance: tuple[str, ...]) -> str:
    """The lowest common ancestor of the balance layers that is not a ModuleList (whose forward is never called)."""
    name = get_lowest_common_ancestor_name(list(balance))
    while name and isinstance(modules[name], torch.nn.ModuleList):
        name = name.rpartition(".")[0]
    return name


# -- the statistics, per sample ------------------------------------------------------------------------------------
def activation_sum(x: torch.Tensor) -> torch.Tensor:
    """One sample's slot of the activation statistics: the sum over its tokens of |x| per channel, in fp32."""
    return x.abs().reshape(-1, x.shape[-1]).float().sum(dim=0)


def activation_mean(sums: torch.Tensor, tokens: int) -> torch.Tensor:
    """Mean |x| per channel: `sums` [samples, channels], every sample's slot, summed in sample order in fp32; over
    `tokens` in all."""
    total = torch.zeros_like(sums[0])
    for s in sums:
        total += s
    return total / torch.tensor(tokens)


def weight_mean(weights: list[torch.Tensor], args: list[QuantizationArgs]) -> torch.Tensor:
    """Duo scaling's weight statistic (fp64, per input channel): the mean over the quantized balance layers' rows of
    |W| normalized by its maximum in each group of weights that share a scale (tensor, row, group, block)."""
    total, rows = 0, 0
    for weight, a in zip(weights, args):
        w, shape = weight.clone(), weight.shape
        if a.strategy == QuantizationStrategy.BLOCK:
            height, width = a.block_structure
            w = w.unflatten(0, (-1, height)).unflatten(-1, (-1, width)).transpose(1, 2)
            blocked = w.shape
            size = height * width
        else:
            size = {QuantizationStrategy.TENSOR: w.numel(), QuantizationStrategy.CHANNEL: w.shape[1]}.get(
                a.strategy, a.group_size)
        w = w.reshape(-1, size)
        w.abs_()
        w.div_(w.amax(dim=1, keepdim=True) + 1e-6)
        if a.strategy == QuantizationStrategy.BLOCK:
            w = w.view(blocked).transpose(1, 2)
        w = w.reshape(shape)
        rows += w.shape[0]
        total += w.sum(0, dtype=torch.float64)
    return total / rows


# -- the grid search -------------------------------------------------------------------------------------------------
def grid(n_grid: int = 20, duo_scaling=True) -> list[tuple[float, bool]]:
    """The grid points (ratio, with duo scaling), in the peer's order: the identity (ratio 0) first, then ratios in
    [0, 1]; "both" tries half as many ratios, each without and with duo scaling."""
    if duo_scaling == "both":
        n = n_grid // 2
        return [(i / (n - 1), duo) for i in range(n) for duo in (False, True)]
    if duo_scaling:
        return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]
    return [(i / (n_grid - 1), False) for i in range(n_grid)]


def scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float, duo: bool) -> torch.Tensor:
    """A grid point's scales: x^r (/ (w^(1-r) + FLOOR) with duo scaling), at least FLOOR, normalized so that their
    largest and smallest multiply to 1; inf and nan become 1."""
    if duo:
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + FLOOR)).clamp(min=FLOOR)
    else:
        s = x_mean.pow(ratio).clamp(min=FLOOR).view(-1)
    s = s / (s.max() * s.min()).sqrt()
    s[torch.isinf(s)] = 1
    s[torch.isnan(s)] = 1
    return s


def candidate(weights: dict[str, torch.Tensor], s: torch.Tensor, args: dict[str, QuantizationArgs],
              fused_scales: tuple[tuple[str, ...], ...]) -> dict[str, torch.Tensor]:
    """The quantized balance layers' weights at scales s: Q(W s) / s, W s stored in the weight's dtype and rounded
    to nearest with qparams observed on it (a fusion group's siblings among them sharing a global scale)."""
    row = s.view(1, -1)
    scaled = {name: (w * row).to(w.dtype) for name, w in weights.items()}
    q = rtn.qparams(scaled, args, fused_scales)
    return {name: (rtn.fake_quantize(w, q[name], args[name]) / row).to(w.dtype) for name, w in scaled.items()}


@torch.no_grad()
def outputs(parent: torch.nn.Module, calls: Iterable[dict]) -> Iterator[torch.Tensor]:
    """The parent's output (a tuple's first) for each call, from the keyword arguments it was called with, one at
    a time: the caller holds as many as it keeps."""
    for kwargs in calls:
        y = parent(**kwargs)
        yield y[0] if isinstance(y, tuple) else y


@one_thread()
def sample_errors(reference: list[torch.Tensor], got: list[torch.Tensor]) -> torch.Tensor:
    """[samples]: each sample's summed squared error, on one thread, as the peer sums a batch's: rounded to the
    outputs' dtype (a bfloat16 model's errors are bfloat16, as the peer's mse_loss gives them), then fp32, as the
    peer adds them to its fp32 loss."""
    return torch.stack([torch.nn.functional.mse_loss(r, g.to(r.device), reduction="sum").float()
                        for r, g in zip(reference, got)]) if reference else torch.zeros(0)


class Candidates:
    """The quantized balance layers (`balance`, by name within the layer; their weights as the earlier mappings left
    them) holding one grid point's candidate at a time, each computed when its point is first held; their own
    weights put back on exit."""

    def __init__(self, balance: dict[str, torch.nn.Module], points: list, x_mean: torch.Tensor,
                 w_mean: torch.Tensor | None, args: dict[str, QuantizationArgs],
                 fused_scales: tuple[tuple[str, ...], ...]):
        self.balance, self.points, self.x_mean, self.w_mean = balance, points, x_mean, w_mean
        self.args, self.fused_scales = args, fused_scales
        self.originals = {name: m.weight.data for name, m in balance.items()}
        self.held = None

    def hold(self, point: int):
        if point != self.held:
            s = scales(self.x_mean, self.w_mean, *self.points[point])
            for name, w in candidate(self.originals, s, self.args, self.fused_scales).items():
                self.balance[name].weight.data = w
            self.held = point

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for name, w in self.originals.items():
            self.balance[name].weight.data = w


def loss(row: torch.Tensor, elements: int) -> float:
    """A grid point's loss from its per-sample errors: summed in sample order in fp32 (numpy's accumulate adds one
    after another, as a loop would), divided by the number of output elements. A row still holding zeros for
    samples not yet computed gives a lower bound of the whole row's loss: the errors are not negative, and adding
    one that is not negative never lowers a rounded sum."""
    errors = row.detach().to("cpu", torch.float32).numpy()
    total = np.add.accumulate(errors)[-1] if len(errors) else np.float32(0)
    return float(total / np.float32(elements))


def best(errors: torch.Tensor, elements: int) -> int:
    """The grid point of least loss: `errors` [grid points, samples], every sample's slot; the first of equal
    ones."""
    choice, least = None, math.inf
    for point, row in enumerate(errors):
        value = loss(row, elements)
        if value < least:
            choice, least = point, value
    if choice is None:
        raise ValueError(NO_FINITE_LOSS)
    return choice


def search(errors: Callable[[int, list[int]], torch.Tensor], samples: list[int], points: int, rounds: int,
           num_samples: int, elements: int, reduce: Callable[[torch.Tensor], None], device=None, first: int = 0
           ) -> int:
    """`best`'s choice over every rank's samples, most grid points computed on only part of them.

    `errors(point, calls)`: this rank's errors of those of its calls (indices; `samples`: each call's sample number)
    at that point; `reduce` sums a tensor over the ranks in place. Point `first` is computed whole. Every other point
    goes round by round, each round a share of every rank's calls, largest errors at `first` first, and is dropped as
    soon as its partial loss, a lower bound of its loss, can no longer win: above the least loss of a whole point,
    or equal to it and later in the grid. A dropped point is one `best` would not choose, so the choice is `best`'s
    at any split of the samples into ranks and rounds; every rank sees the same reduced rows, so all drop the same
    points. One round: every point whole, one reduce."""
    at = torch.tensor(samples, dtype=torch.long, device=device)
    order = list(range(len(samples)))

    def slots(point: int, calls: list[int]) -> torch.Tensor:
        row = torch.zeros(num_samples, device=device)
        return row.index_add_(0, at[calls], errors(point, calls)) if calls else row

    if rounds == 1:
        rows = torch.stack([slots(point, order) for point in range(points)])
        reduce(rows)
        return best(rows, elements)
    least, choice = math.inf, None
    for point in [first, *(p for p in range(points) if p != first)]:
        row = torch.zeros(num_samples)
        for step in range(rounds):
            if step and _beaten(loss(row, elements), point, least, choice):
                break
            part = slots(point, order[step * len(order) // rounds:(step + 1) * len(order) // rounds])
            reduce(part)
            row += part.cpu()
        else:
            value = loss(row, elements)
            if value < least or value == least and choice is not None and point < choice:
                choice, least = point, value
        if point == first:
            weight = row.tolist()
            order.sort(key=lambda call: -weight[samples[call]])
    if choice is None:
        raise ValueError(NO_FINITE_LOSS)
    return choice


def rounds(calls: int, elements: int) -> int:
    """How many rounds `search` takes, from the most calls a rank holds and a rank's output elements."""
    return max(1, min(ROUNDS, calls, elements // ROUND_ELEMENTS))


def _beaten(bound: float, point: int, least: float, choice: int | None) -> bool:
    return bound > least or bound == least and choice is not None and point > choice


NO_FINITE_LOSS = "no grid point of AWQ gave a finite loss: the layer's outputs hold NaN"
