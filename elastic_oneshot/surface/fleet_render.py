"""`plan --fleet`'s report drawn: a table (`render`) and a plot (`draw`, with matplotlib, which only the test extras
install)."""

from elastic_oneshot.errors import UsageError


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def render(r: dict) -> str:
    """The report as a table, with what it assumed above it and the recommendation below."""
    f, a, p, m = r["fleet"], r["accelerator"], r["per_layer_s_at_min"], r["fleet"]["measured"]
    mtbp = "never preempted" if f["mtbp_hours"] is None else f"each preempted every {f['mtbp_hours']:g} h on average"
    where = (f"{f['accelerator']} ({a['bf16_tflops']:g} bf16 TFLOP/s, {a['bandwidth_gbps']:g} GB/s, "
             f"{a['memory_gb']:g} GB) x {f['gpus_per_node']} a node; storage {f['storage_gbps']:g} GB/s a node" if not m
             else f"calibrated on this machine: layer {m['layer']} on {m['samples']} samples, ranks of one thread "
             f"sharing {m['cores']} cores ({f['gpus_per_node']} a node), disk {m['write_bps'] / 1e9:.2f} GB/s write "
             f"and {m['read_bps'] / 1e9:.2f} read, start-up {m['startup_s']:.1f} s")
    lines = [f"{r['model']}: {r['layers']} layers, {r['scheme']}, {f['samples']} x {f['seq_len']} tokens; {where}",
             f"spot nodes {mtbp}, replaced in {f['replacement_minutes']:g} min; "
             f"${f['spot_price']:.2f} spot, ${f['on_demand_price']:.2f} on demand per GPU-hour; "
             f"{f['trials']} trials, seed {f['seed']}",
             f"a layer at {f['nodes'][0]} node{'s' if f['nodes'][0] > 1 else ''} (mean{', calibrated' if m else ''}): "
             + ", ".join(f"{k} {v:.2f}" for k, v in p.items() if k != "commit")
             + f" s; its commit {p['commit']:.2f} s behind the next; boundary {r['boundary_gb']:.1f} GB every "
             f"{r['boundary_every_at_min']} layers; per GPU about {r['gpu_memory_gb']:.1f} GB",
             "", f"{'nodes':>6} {'GPUs':>5} {'no preemption':>14} {'expected':>9} {'p10':>9} {'p90':>9} "
             f"{'GPU-h':>8} {'spot $':>9} | {'from scratch':>12} {'$':>9}"]
    for row_ in r["rows"]:
        s = row_["from_scratch"]
        scratch = (f"{duration(s['expected_s']):>12} {s['cost']:>9.2f}" if s["finishes"]
                   else f"{'never finishes':>22}")
        mine = (f"{duration(row_['expected_s']):>9} {duration(row_['p10_s']):>9} {duration(row_['p90_s']):>9} "
                f"{row_['gpu_hours']:>8.1f} {row_['cost']:>9.2f}" if row_["finishes"] else f"{'never finishes':>47}")
        lines.append(f"{f['nodes'][0]}:{row_['nodes']:<4} {row_['gpus']:>5} {duration(row_['uninterrupted_s']):>14} "
                     f"{mine} | {scratch}")
    od = r["on_demand"]
    lines += ["", f"on demand, 1 node ({od['gpus']} GPUs), no preemptions: {duration(od['wall_s'])}, "
              f"${od['cost']:.2f}",
              ("recommend " if r["recommendation"]["nnodes"] else "") + r["recommendation"]["why"]]
    return "\n".join(lines)


def draw(r: dict, path: str):
    """Expected wall, its median and its p10 to p90 band, and spot cost by node count, beside from-scratch restarts
    and on demand. The band is drawn apart from the mean: a skewed wall's mean may lie outside it."""
    Figure = figure(path)
    done = [x for x in r["rows"] if x["finishes"]]
    scratch = [x for x in r["rows"] if x["from_scratch"]["finishes"]]
    fig = Figure(figsize=(9, 4), dpi=100)
    wall, cost = fig.subplots(1, 2)
    nodes = [x["nodes"] for x in done]
    wall.fill_between(nodes, [x["p10_s"] / 60 for x in done], [x["p90_s"] / 60 for x in done], alpha=0.25,
                      label="resumable, p10 to p90")
    wall.plot(nodes, [x["p50_s"] / 60 for x in done], "x", label="resumable, median")
    wall.plot(nodes, [x["expected_s"] / 60 for x in done], "o-", label="resumable, expected")
    cost.plot([x["nodes"] for x in done], [x["cost"] for x in done], "o-", label="resumable, spot")
    wall.plot([x["nodes"] for x in scratch], [x["from_scratch"]["expected_s"] / 60 for x in scratch], "s--",
              label="from scratch")
    cost.plot([x["nodes"] for x in scratch], [x["from_scratch"]["cost"] for x in scratch], "s--", label="from scratch")
    wall.axhline(r["on_demand"]["wall_s"] / 60, color="grey", linestyle=":", label="1 node on demand")
    cost.axhline(r["on_demand"]["cost"], color="grey", linestyle=":", label="1 node on demand")
    wall.set(xlabel="nodes (MAX)", ylabel="expected wall, minutes",
             title=f"{r['model']} on {r['fleet']['accelerator']}")
    cost.set(xlabel="nodes (MAX)", ylabel="expected cost, $", title="spot, from scratch, on demand")
    for ax in (wall, cost):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def figure(path: str):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"--plot {path} needs matplotlib, which is not installed: pip install matplotlib") from None
    return Figure
