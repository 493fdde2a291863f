"""`plan --fleet`: what a job would take on MIN..MAX spot GPU nodes, before renting them: expected wall time and its
spread, GPU-hours and cost, beside the same job restarted from scratch at every preemption (a tool without resume)
and on one on-demand node. A model from the model's shapes and published figures, not a measurement: it is for
comparing node counts and designs, and its constants (below) say what it assumes.

Per layer, at W = nodes x GPUs ranks: the layer's weights are read (load); calibration and propagation are
forwards of 2 x params x tokens flops (experts on their routed share: top_k / experts; with `--moe-calibrate all`
gate and up see every token in calibration) at FORWARD_EFFICIENCY of the bf16 peak, on the busiest rank's chunks
(data parallel); Hessians cost cols^2 x tokens fp32 flops per input group (the lower triangle of 2 cols^2 tokens,
gptq.hessian_add); GPTQ is the weight-parallel plan's makespan (plan.make_plan) under CostModel's coefficients
re-timed for the accelerator (`solve_cost`). The layer's commit is written behind the next layer and costs only
what exceeds it; boundaries are written as `--boundary-every auto` writes them (boundaries.auto_interval) with the
fleet's MTBF. Not modeled: attention's score flops, communication between ranks, sub-layer progress of MoE layers.

What preemptions do to a job is preemption.py's model (a replacement arrives `--replacement-minutes` after each
preemption); each row here is a seeded Monte Carlo of it. The report is drawn by fleet_render.py.

`--calibrate` (`measure`) replaces the datasheet with this machine, so that predictions can be checked against real
runs here (bench/fleet_check.py): one layer of the real model is run through the run's own code, and every node and
rank of the table is taken to run on this machine, as a local torchrun or the chaos harness runs them: ranks of one
thread each (OMP_NUM_THREADS=1, what torchrun gives several ranks) share its cores, nodes share its disk.
"""

import collections
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

from elastic_oneshot.errors import UsageError
from elastic_oneshot.surface.fleet_render import draw, duration, figure, render
from elastic_oneshot.surface.preemption import Drawn, Timeline, prefix, trial, uninterrupted


@dataclasses.dataclass(frozen=True)
class Accelerator:
    bf16_tflops: float  # dense (no sparsity)
    fp32_tflops: float
    fp64_tflops: float  # tensor core where the datasheet has one (Cholesky's bulk is GEMMs)
    bandwidth_gbps: float  # memory bandwidth, GB/s
    memory_gb: float


# NVIDIA's published datasheet figures (SXM parts): H100 SXM5, H200 SXM, A100 80GB SXM, L40S. The L40S datasheet
# gives no fp64 figure: 1.4 is Ada's 1/64 of fp32.
ACCELERATORS = {
    "H100": Accelerator(989, 67, 67, 3350, 80),
    "H200": Accelerator(989, 67, 67, 4800, 141),
    "A100-80G": Accelerator(312, 19.5, 19.5, 2039, 80),
    "L40S": Accelerator(362, 91.6, 1.4, 864, 48),
}

# Assumptions of the model (estimates, not measured here):
FORWARD_EFFICIENCY = 0.4  # of the bf16 peak: eager PyTorch forwards over chunks of 8 x seq_len tokens
FP_EFFICIENCY = 0.5  # of the fp32 / fp64 peak: Hessian GEMMs (fp32), Cholesky and inverse (fp64), GPTQ's solve (fp32)
CPU_THREAD_FLOPS = 6.6e10  # one EPYC thread as CostModel sees it: its factor step does 4/3 d^3 flops in a * d^3 s
COLUMN_S = 1.2e-4  # GPTQ's column loop on a GPU, per column: about a dozen eager ops, bound by their launches
EXPERT_CALL_S = 1e-4  # one expert called in the loop over experts, per chunk and pass: bound by launches
CHUNK_SIZE = 8  # `run --chunk-size`'s default: ranks take whole chunks of samples
SCALE_BYTES = 2  # per column group of a compressed weight (bf16 scales; fp8-scaled formats take less)
STARTUP_S = 30.0  # interpreter, imports, skeleton, resume point: "tens of seconds at most" (docs/operations.md)
COST_SLACK = 0.10  # recommend the fastest node count whose expected cost is within 10 % of the cheapest


@dataclasses.dataclass(frozen=True)
class Measured:
    """`--calibrate`'s figures for one rank of one thread on this machine: what its phases achieved on one layer
    (flop/s of the model's flop counts, so that other layers and token counts scale by them), GPTQ's seconds over
    CostModel's, the disk, and a start (launch and the run's preamble)."""

    layer: int
    samples: int  # measured on this many (forwards and Hessians scale linearly to the busiest rank's)
    load_bps: float
    calibrate_fps: float
    hessian_fps: float
    propagate_fps: float
    gptq: float  # measured GPTQ seconds / CostModel's (one EPYC thread) for the same groups
    write_bps: float
    read_bps: float
    startup_s: float
    cores: int


@dataclasses.dataclass(frozen=True)
class Fleet:
    """`plan --fleet`'s inputs (the CLI states these defaults)."""

    samples: int = 512
    seq_len: int = 2048
    accelerator: str = "H100"
    nodes: tuple[int, int] = (1, 8)
    gpus_per_node: int = 8
    mtbp_hours: float = 4.0  # mean time between preemptions of one node
    replacement_minutes: float = 5.0
    storage_gbps: float = 1.0  # GB/s per node, to and from the state (and the model)
    # $ per GPU-hour, illustrative H100 prices (pass yours): AWS p5.48xlarge on demand, about $55/h for 8 after
    # AWS's June 2025 cut ($98.32/h before); spot, about 60 % below on demand, as H100 spot commonly is.
    spot_price: float = 2.50
    on_demand_price: float = 6.88
    seed: int = 0
    trials: int = 2000
    moe_calibrate: str = "all"
    measured: Measured | None = None  # --calibrate's: this machine instead of the datasheet

    @property
    def acc(self) -> Accelerator:
        return ACCELERATORS[self.accelerator]

    @property
    def storage(self) -> float:
        """Bytes/s of one link to the state: a node's, or with --calibrate this machine's disk write."""
        return self.measured.write_bps if self.measured else self.storage_gbps * 1e9

    def links(self, nodes: int) -> int:
        """Links that write in parallel: one a node, or with --calibrate the one disk every node shares."""
        return 1 if self.measured else nodes

    @property
    def startup_s(self) -> float:
        return self.measured.startup_s if self.measured else STARTUP_S

    @property
    def mtbp_s(self) -> float:
        return self.mtbp_hours * 3600


POSITIVE = ("samples", "seq_len", "gpus_per_node", "mtbp_hours", "storage_gbps", "trials")
NOT_NEGATIVE = ("replacement_minutes", "spot_price", "on_demand_price")


def options(values: dict, calibrate: bool = False) -> Fleet:
    """A Fleet from the command line's values (None: the default), each checked: one line for the first bad one."""
    values = {k: v for k, v in values.items() if v is not None}
    if calibrate and (datasheet := [k for k in ("accelerator", "storage_gbps") if k in values]):
        raise UsageError(f"{', '.join('--' + k.replace('_', '-') for k in datasheet)}: datasheet figures, which "
                         "--calibrate replaces by this machine's")
    if "nodes" in values:
        values["nodes"] = parse_nodes(str(values["nodes"]))
    for key in POSITIVE + NOT_NEGATIVE:
        value = values.get(key, 1)
        if not (value > 0 if key in POSITIVE else value >= 0) or math.isnan(value):
            flag = "--" + key.replace("_", "-")
            raise UsageError(f"{flag} {value:g}: expected a number {'above 0' if key in POSITIVE else 'of 0 or more'}")
    return Fleet(**values)


def parse_nodes(text: str) -> tuple[int, int]:
    """`--nodes MIN:MAX` (or N, for N:N)."""
    low, _, high = text.partition(":")
    try:
        nodes = int(low), int(high or low)
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1]:
        raise UsageError(f"--nodes {text}: expected MIN:MAX, whole numbers with 1 <= MIN <= MAX")
    return nodes


# -- the model's work ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerWork:
    """One decoder layer's work: flops per calibration token, bytes and GPTQ groups whole."""

    calibrate_flops: float
    propagate_flops: float
    hessian_flops: float  # fp32
    expert_calls: int  # experts called one by one, per chunk and pass
    weight_bytes: int  # as stored: read by load and by a replay
    compressed_bytes: float  # its commit
    groups: tuple = ()  # plan.Group


@dataclasses.dataclass(frozen=True)
class ModelWork:
    model_type: str
    hidden: int
    itemsize: int  # bytes per activation (the model's dtype: boundaries are written in it)
    layers: list[LayerWork]


def model_work(model: str, recipe, all_experts: bool = True) -> ModelWork:
    """The work of every layer, from the model's config alone (SourceModel's meta skeleton); identical layers
    are computed once."""
    from elastic_oneshot.models.source import SourceModel
    from elastic_oneshot.quantization.schemes import column_width

    source = SourceModel(model)
    schemes = recipe.module_schemes(source.skeleton, source.family)
    config = source.config.get_text_config()
    top_k = source.family.experts_per_token(source.config)
    seen, layers = {}, []
    for index, layer in enumerate(source.layers):
        prefix = f"{source.layer_prefix}{index}."
        modules = dict(layer.named_modules())
        linear = tuple((n, m.in_features, m.out_features) for n, m in modules.items() if hasattr(m, "in_features"))
        local = {n[len(prefix):]: s.weights for n, s in schemes.items() if n.startswith(prefix)}
        bits = tuple((n, w.num_bits, column_width(w, modules[n].in_features)) for n, w in local.items())
        if (linear, bits) not in seen:
            seen[linear, bits] = _layer_work(layer, linear, bits, source, top_k, all_experts)
        layers.append(seen[linear, bits])
    return ModelWork(source.config.model_type, config.hidden_size, source.dtype.itemsize, layers)


def _layer_work(layer, linear, bits, source, top_k, all_experts) -> LayerWork:
    """A layer's LayerWork from its Linear modules (name, in, out) and quantized ones (name, bits, group width)."""
    from elastic_oneshot.quantization.plan import layer_groups

    expert_of = source.family.expert_of
    experts = collections.Counter(e[0] for n, *_ in linear if (e := expert_of(n)) and e[2] == "down_proj")

    def routed(name):  # the share of tokens a module sees in a routed forward
        e = expert_of(name)
        return min(1.0, (top_k or experts[e[0]]) / experts[e[0]]) if e else 1.0

    def calibrated(name):  # ... and in calibration: all-experts runs gate and up on every token
        e = expert_of(name)
        return 1.0 if all_experts and e and e[2] != "down_proj" else routed(name)

    groups = tuple(layer_groups(layer, [n for n, *_ in bits], source.family.input_key(all_experts)))
    shapes = {n: (i, o) for n, i, o in linear}
    return LayerWork(
        calibrate_flops=sum(2 * i * o * calibrated(n) for n, i, o in linear),
        propagate_flops=sum(2 * i * o * routed(n) for n, i, o in linear),
        hessian_flops=sum(g.cols**2 * (1.0 if all_experts else routed(g.name)) for g in groups),
        expert_calls=sum(experts.values()),
        weight_bytes=sum(i * o for _, i, o in linear) * source.dtype.itemsize,
        compressed_bytes=sum(_compressed(shapes[n], b, w) for n, b, w in bits),
        groups=groups)


def _compressed(shape: tuple[int, int], bits: int, width: int) -> float:
    cols, rows = shape
    return rows * cols * bits / 8 + rows * math.ceil(cols / width) * SCALE_BYTES


# -- seconds per layer --------------------------------------------------------------------------------------------
def solve_cost(acc: Accelerator):
    """CostModel (seconds for one EPYC thread) re-timed for the accelerator: its flop terms by the ratio of that
    thread's rate to FP_EFFICIENCY of the accelerator's fp64 (factor, panels, inverse) or fp32 (solve) peak; its
    per-column overhead replaced by COLUMN_S (a GPU's column loop is bound by launches, not flops)."""
    from elastic_oneshot.quantization.plan import CostModel

    base = CostModel()
    fp64 = CPU_THREAD_FLOPS / (acc.fp64_tflops * 1e12 * FP_EFFICIENCY)
    fp32 = CPU_THREAD_FLOPS / (acc.fp32_tflops * 1e12 * FP_EFFICIENCY)
    return CostModel(a=base.a * fp64, f=base.f * fp64, i=base.i * fp64, b=base.b * fp32, c=COLUMN_S)


_PLANS: dict = {}


def _makespan(groups: tuple, ranks: int, acc: Accelerator | None) -> float:
    """The plan's makespan re-timed for `acc`, or (None) under CostModel's own one-thread coefficients."""
    from elastic_oneshot.quantization.plan import CostModel, make_plan

    key = (groups, ranks, acc)
    if key not in _PLANS:
        _PLANS[key] = make_plan(list(groups), ranks, solve_cost(acc) if acc else CostModel()).makespan
    return _PLANS[key]


def _busiest_chunks(fleet: Fleet, nodes: int) -> int:
    """The chunks of the busiest rank at `nodes` nodes: ranks take whole chunks of samples."""
    return math.ceil(math.ceil(fleet.samples / CHUNK_SIZE) / (nodes * fleet.gpus_per_node))


def layer_seconds(work: LayerWork, fleet: Fleet, nodes: int) -> dict[str, float]:
    """One layer's phases at `nodes` nodes, in seconds; `commit` is written behind the next layer."""
    acc, ranks, mine = fleet.acc, nodes * fleet.gpus_per_node, _busiest_chunks(fleet, nodes)
    tokens = min(fleet.samples, mine * CHUNK_SIZE) * fleet.seq_len
    if fleet.measured:
        return _measured_seconds(work, fleet, ranks, tokens)

    def forward(flops):  # compute or weight reads, whichever is longer, plus the loop over experts
        return (max(flops * tokens / (acc.bf16_tflops * 1e12 * FORWARD_EFFICIENCY),
                    mine * work.weight_bytes / (acc.bandwidth_gbps * 1e9)) + mine * work.expert_calls * EXPERT_CALL_S)

    return {"load": work.weight_bytes / fleet.storage,
            "calibrate": forward(work.calibrate_flops),
            "hessian": work.hessian_flops * tokens / (acc.fp32_tflops * 1e12 * FP_EFFICIENCY),
            "gptq": _makespan(work.groups, ranks, acc),
            "propagate": forward(work.propagate_flops),
            "commit": work.compressed_bytes / (fleet.storage * fleet.links(nodes))}


def _measured_seconds(work: LayerWork, fleet: Fleet, ranks: int, tokens: int) -> dict[str, float]:
    """layer_seconds from --calibrate's rates: `ranks` one-thread ranks on this machine, slowed by their share of
    its cores when they outnumber them; the commit on its one disk."""
    m = fleet.measured
    share = max(1.0, ranks / m.cores)
    return {"load": share * work.weight_bytes / m.load_bps,
            "calibrate": share * work.calibrate_flops * tokens / m.calibrate_fps,
            "hessian": share * work.hessian_flops * tokens / m.hessian_fps,
            "gptq": share * m.gptq * _makespan(work.groups, ranks, None),
            "propagate": share * work.propagate_flops * tokens / m.propagate_fps,
            "commit": work.compressed_bytes / fleet.storage}


def timeline(model: ModelWork, fleet: Fleet, nodes: int, resume: bool = True) -> Timeline:
    """Layer times at `nodes` nodes; without `resume` (a tool that keeps nothing), no commits and no boundaries."""
    from elastic_oneshot.durability.boundaries import auto_interval

    phases = [layer_seconds(w, fleet, nodes) for w in model.layers]
    compute = [sum(v for k, v in p.items() if k != "commit") for p in phases]
    commit = [p["commit"] if resume else 0.0 for p in phases]
    durations = [c + max(0.0, (commit[i - 1] if i else 0.0) - c) for i, c in enumerate(compute)]
    write_s = fleet.samples * fleet.seq_len * model.hidden * model.itemsize / (fleet.storage * fleet.links(nodes))
    mtbf = min(fleet.mtbp_s / nodes, 1e18)  # never preempted: Young and Daly's interval is the bound
    interval = [auto_interval(write_s, c, p["propagate"], mtbf) for c, p in zip(compute, phases)]
    total = sum(w.compressed_bytes for w in model.layers)
    return Timeline(prefix(durations), commit, prefix([p["load"] + p["propagate"] for p in phases]), interval,
                    write_s, _busiest_chunks(fleet, nodes), commit[-1] + 2 * total / fleet.storage, fleet.startup_s)


# -- --calibrate: this machine's figures --------------------------------------------------------------------------
DISK_BYTES = 64 * 2**20  # written, synced and read back once to measure the disk


def measure(model: str, recipe, fleet: Fleet, work: ModelWork) -> Measured:
    """One layer of the real model (the one of most calibration flops) through the run's own code, at one thread: its
    weights read (load), min(samples, CHUNK_SIZE) samples of seq_len through the calibration hooks (calibrate, with
    Hessians timed apart), the weight-parallel plan at one rank with packing (gptq), the layer again (propagate);
    then the disk under the temp dir, and a start: a torchrun launch of a worker that imports the run, plus the run's
    preamble here (the model's checks, drawing builtin samples, the embeddings and the trial of layer 0)."""
    import torch

    from elastic_oneshot.models.source import SourceModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        began = time.perf_counter()
        source = SourceModel(model)
        try:
            source.check_weights()
        except UsageError as e:
            raise UsageError(f"--calibrate runs one layer of the real model, which needs its weights: {e}") from None
        index = max(range(len(work.layers)), key=lambda i: work.layers[i].calibrate_flops)
        samples = min(fleet.samples, CHUNK_SIZE)
        checks = time.perf_counter() - began
        seconds, preamble = _one_layer(source, recipe, index, samples, fleet)
    finally:
        torch.set_num_threads(threads)
    w, tokens = work.layers[index], samples * fleet.seq_len
    write_bps, read_bps = _disk()
    return Measured(index, samples, w.weight_bytes / seconds["load"], w.calibrate_flops * tokens / seconds["calibrate"],
                    w.hessian_flops * tokens / seconds["hessian"], w.propagate_flops * tokens / seconds["propagate"],
                    seconds["gptq"] / _makespan(w.groups, 1, None), write_bps, read_bps,
                    _launch_s() + checks + preamble,
                    os.cpu_count() or 1)


def _one_layer(source, recipe, index: int, samples: int, fleet: Fleet) -> tuple[dict[str, float], float]:
    """Layer `index`'s phases in seconds, by the run's own step (loop/layer_step.py) as the runner times them, and the
    seconds of the run's own preamble that came along (drawing the samples, the trial of layer 0)."""
    import torch
    import transformers

    from elastic_oneshot.distributed.world import World
    from elastic_oneshot.loop.data import calibration_samples
    from elastic_oneshot.loop.layer_step import LayerStep
    from elastic_oneshot.models.source import Embedder

    began = time.perf_counter()
    ids = calibration_samples("builtin", transformers.AutoTokenizer.from_pretrained(source.path), samples,
                              fleet.seq_len, 0)
    step = LayerStep(source, recipe.module_schemes(source.skeleton, source.family), recipe, World(), "cpu",
                     fleet.seq_len, samples, fleet.moe_calibrate == "all")
    embedder, seconds = Embedder(source), {}
    with torch.inference_mode():
        trial = embedder(torch.zeros(1, fleet.seq_len, dtype=torch.int64))  # the run's trial of layer 0
        step.forward(source.load_layer(0), trial, embedder.layer_kwargs(0, 1, fleet.seq_len))
        x, kwargs = embedder(ids), embedder.layer_kwargs(index, 1, fleet.seq_len)
        preamble = time.perf_counter() - began
        module, groups = step.load(index, None, seconds)
        tensors, _ = step.compress(index, module, groups, lambda: [x], kwargs, seconds)
        for _ in step.propagate(index, module, tensors, [(0, x)], kwargs, seconds):
            pass
    return seconds, preamble


def _disk() -> tuple[float, float]:
    """Bytes/s of a synced write and of a read back, under the temp dir (where the check bench keeps its states)."""
    data = os.urandom(DISK_BYTES)
    with tempfile.TemporaryDirectory() as d:
        path, t = os.path.join(d, "probe"), time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        write, t = time.perf_counter() - t, time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        return DISK_BYTES / write, DISK_BYTES / (time.perf_counter() - t)


def _launch_s() -> float:
    """Seconds for a torchrun agent to start a worker that imports the run, and for both to end."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                    "--no-python", sys.executable, "-c", "import elastic_oneshot.surface.api"], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


# -- the report ---------------------------------------------------------------------------------------------------
def row(tls: dict[int, Timeline], nodes: int, low: int, fleet: Fleet, resume: bool = True) -> dict:
    """A node count's statistics over `fleet.trials` seeded trials; as soon as one trial never finishes, only that."""
    rng = random.Random(f"{fleet.seed}:{nodes}:{low}:{resume}")
    walls, paid = [], 0.0
    for _ in range(fleet.trials):
        result = trial(tls, nodes, low, fleet.replacement_minutes * 60, Drawn(fleet.mtbp_s, rng), resume)
        if result is None:
            return {"finishes": False, "uninterrupted_s": uninterrupted(tls[nodes])}
        walls.append(result[0])
        paid += result[1]
    walls.sort()
    gpu_hours = paid / len(walls) * fleet.gpus_per_node / 3600
    return {"finishes": True, "uninterrupted_s": uninterrupted(tls[nodes]), "expected_s": sum(walls) / len(walls),
            "p10_s": walls[round(0.1 * (len(walls) - 1))],
            "p50_s": walls[round(0.5 * (len(walls) - 1))], "p90_s": walls[round(0.9 * (len(walls) - 1))],
            "gpu_hours": gpu_hours, "cost": gpu_hours * fleet.spot_price}


def report(model: ModelWork, fleet: Fleet, scheme: str = "") -> dict:
    """Every row (MIN..MAX nodes, resumable and from scratch), one on-demand node, and the recommendation."""
    low, high = fleet.nodes
    resumable = {n: timeline(model, fleet, n) for n in range(low, high + 1)}
    rows = []
    for n in range(low, high + 1):
        scratch = {n: timeline(model, fleet, n, resume=False)}
        rows.append({"nodes": n, "gpus": n * fleet.gpus_per_node, **row(resumable, n, low, fleet),
                     "from_scratch": row(scratch, n, n, fleet, resume=False)})
    one = resumable.get(1) or timeline(model, fleet, 1)
    wall = uninterrupted(one)
    phases = [layer_seconds(w, fleet, low) for w in model.layers]
    per_layer = {k: sum(p[k] for p in phases) / len(phases) for k in phases[0]}
    memory = max(w.weight_bytes + sum(g.cols**2 * 12 for g in w.groups) for w in model.layers)  # fp64 + fp32 chunk
    memory += 2 * CHUNK_SIZE * fleet.seq_len * model.hidden * model.itemsize  # a chunk's inputs and outputs
    return {"model": model.model_type, "layers": len(model.layers), "scheme": scheme,
            "fleet": {k: (None if v == math.inf else v) for k, v in dataclasses.asdict(fleet).items()},
            "accelerator": dataclasses.asdict(fleet.acc), "per_layer_s_at_min": per_layer,
            "boundary_gb": model.hidden * model.itemsize * fleet.samples * fleet.seq_len / 1e9,
            "boundary_every_at_min": resumable[low].interval[0], "gpu_memory_gb": memory / 1e9, "rows": rows,
            "on_demand": {"nodes": 1, "gpus": fleet.gpus_per_node, "wall_s": wall,
                          "cost": wall / 3600 * fleet.gpus_per_node * fleet.on_demand_price},
            "recommendation": recommend(rows, fleet)}


def recommend(rows: list[dict], fleet: Fleet) -> dict:
    """The fastest node count whose expected cost is within COST_SLACK of the cheapest, and why, in one line."""
    finishing = [r for r in rows if r["finishes"]]
    low, high = fleet.nodes
    if not finishing:
        return {"nnodes": None, "why": f"no node count in {low}..{high} finishes: preemptions come faster than a "
                "restart and a layer; use nodes preempted less often, or on demand"}
    cheapest = min(finishing, key=lambda r: r["cost"])
    pick = min((r for r in finishing if r["cost"] <= cheapest["cost"] * (1 + COST_SLACK)),
               key=lambda r: (r["expected_s"], r["nodes"]))
    mtbf = fleet.mtbp_s / pick["nodes"]
    flags = f"--nnodes {low}:{pick['nodes']}" + (f" (run --mtbf {mtbf:.0f})" if mtbf < math.inf else "")
    return {"nnodes": f"{low}:{pick['nodes']}", "mtbf_s": None if mtbf == math.inf else round(mtbf),
            "why": f"{flags}: expected {duration(pick['expected_s'])} for ${pick['cost']:.2f}, the fastest whose "
                   f"expected cost is within {COST_SLACK:.0%} of the cheapest (${cheapest['cost']:.2f} at "
                   f"{cheapest['nodes']} node{'s' if cheapest['nodes'] > 1 else ''})"}


def show(model: str, recipe, fleet: Fleet, as_json: bool = False, plot: str | None = None, scheme: str = "",
         calibrate: bool = False):
    """`plan --fleet`: the report, as a table or JSON, and drawn when `plot` names a PNG; with `calibrate`, from
    this machine's figures (`measure`)."""
    if plot:
        figure(plot)  # before any work
    work = model_work(model, recipe, fleet.moe_calibrate == "all")
    if calibrate:
        fleet = dataclasses.replace(fleet, measured=measure(model, recipe, fleet, work))
    r = report(work, fleet, scheme)
    print(json.dumps(r) if as_json else render(r))
    if plot:
        draw(r, plot)
