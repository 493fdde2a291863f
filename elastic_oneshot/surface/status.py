"""`elastic-oneshot status`: where a job stands and what its failures cost, read from its state directory.

Layers done come from the commit records (the truth: files, or the etcd coordinator job.json records);
everything about time (speed, ETA, epochs and their world sizes, faults, time lost) comes from events.jsonl,
which is history only.

Time lost to failures is events.History.lost_spans; layers redone (committed again after a file was found damaged)
are reported apart, as a count.
"""

import datetime
import json
import sys
import time

from elastic_oneshot.durability import layout
from elastic_oneshot.durability.coordinator import open_records
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.events import History

RECENT = 5  # layers that set the speed behind the ETA
REFRESH_S = 5.0


def report(state: StateStore | str, now: float | None = None, records: Records | None = None) -> dict:
    """Every fact `status` shows, as JSON-ready values (times in seconds since the epoch). `records`: the state's,
    opened here if not given."""
    state = state if isinstance(state, StateStore) else StateStore(state)
    job = state.job()
    total, coordinator = job["num_layers"], job["job"].get("coordinator")
    records = records or open_records(state)
    committed = records.committed()
    done = len(committed)
    history = History(state.events())
    now = time.time() if now is None else now
    commits = history.commits

    began = {(e["epoch"], e["layer"]): e["time"] for e in history.layers}
    took = [(c["epoch"], c["time"] - began[c["epoch"], c["layer"]])
            for c in commits if (c["epoch"], c["layer"]) in began]
    latest = [s for e, s in took if e == took[-1][0]] if took else []
    speed = sum(latest[-RECENT:]) / len(latest[-RECENT:]) if latest else None
    remaining = total - done
    eta = 0.0 if remaining == 0 else None if speed is None else remaining * speed

    epochs = [{"epoch": s["epoch"], "time": s["time"], "world_size": s["world_size"],
               "committed_at_start": s["committed"], "commits": sum(c["epoch"] == s["epoch"] for c in commits)}
              for s in history.starts]
    lost = history.lost_spans(total, now)
    return {
        "state": state.root, "model": job["job"]["model"], "coordinator": coordinator,
        "layers_done": done, "layers_total": total, "complete": remaining == 0,
        "seconds_per_layer": _round(speed), "eta_s": _round(eta),
        "epochs": epochs, "world_sizes": [e["world_size"] for e in epochs], "restarts": history.restarts,
        "lost_s": _round(sum(b - a for a, b in lost)), "lost_spans": [[_round(a), _round(b)] for a, b in lost],
        "redone_layers": history.redone(), "faults": history.faults,
        "commits": [{"layer": c["layer"], "epoch": c["epoch"], "time": c["time"]} for c in commits],
        **_replay(state, records, committed, total, commits),
        **_passes(state, job),
    }


def _passes(state: StateStore, job: dict) -> dict:
    """For a recipe of several passes, each pass's layers committed: {"passes": [{"modifier", "layers_done"}]} (the
    last pass's are the report's own); nothing for a recipe of one."""
    recipe = job["job"].get("recipe") or {}
    names = [s["modifier"] for s in recipe.get("stages", [])] + ([recipe.get("quantizer", "GPTQModifier")]
                                                                  if recipe.get("quantizer", "") is not None else [])
    if len(names) < 2:
        return {}
    done = [len(open_records(state, stage=layout.stage(i, name)).committed()) for i, name in enumerate(names[:-1])]
    return {"passes": [{"modifier": n, "layers_done": d} for n, d in zip(names, done + [None])]}


def _replay(state: StateStore, records: Records, committed: dict[int, int], total: int, commits: list[dict]) -> dict:
    """The newest durable boundary below the next layer to do, and what a restart now would replay from it: the
    layers in between, and their propagation seconds as last measured."""
    following = next((layer for layer in range(total) if layer not in committed), total)
    boundary = next((b for b, _ in CommitProtocol(state, records, committed).durable(following)), 0)
    propagate = {c["layer"]: c.get("seconds", {}).get("propagate", 0.0) for c in commits}
    return {"durable_boundary": boundary, "replay_layers": following - boundary,
            "replay_s": _round(sum(propagate.get(layer, 0.0) for layer in range(boundary, following)))}


def render(r: dict) -> str:
    """The report as text; --json prints the same report (with commit times besides)."""
    where = f", coordinator {r['coordinator']}" if r["coordinator"] else ""
    lines = [f"state {r['state']} (model {r['model']}{where})"]
    if "passes" in r:  # a recipe's passes before the last: their layers committed
        lines.append("passes: " + ", then ".join(
            f"{p['modifier']} {r['layers_done'] if p['layers_done'] is None else p['layers_done']}/"
            f"{r['layers_total']}" for p in r["passes"]) + " (below: the last pass)")
    lines.append(f"layers: {r['layers_done']}/{r['layers_total']} committed" + (" (complete)" if r["complete"] else ""))
    if r["seconds_per_layer"] is not None:
        lines.append(f"speed: {r['seconds_per_layer']:.1f} s per layer (last {RECENT} layers of the latest epoch), "
                     f"ETA {_duration(r['eta_s'])}")
    else:
        lines.append("speed: no layer timed yet, ETA unknown" if not r["complete"] else "ETA 0s")
    lines.append(f"epochs: {len(r['epochs'])} ({r['restarts']} restarts); world sizes "
                 f"{' -> '.join(map(str, r['world_sizes'])) or '-'}")
    for e in r["epochs"]:
        lines.append(f"  epoch {e['epoch']}  {_clock(e['time'])}  world size {e['world_size']}  "
                     f"started with {e['committed_at_start']} committed, committed {e['commits']}")
    lines.append(f"time lost to failures: {r['lost_s']:.1f} s in {len(r['lost_spans'])} spans "
                 "(last commit before a restart to the next layer start)")
    lines.append(f"layers redone: {r['redone_layers']}")
    lines.append(f"newest durable boundary: inputs of layer {r['durable_boundary']}"
                 + (" (the embeddings)" if r["durable_boundary"] == 0 else "")
                 + f"; a restart now replays {r['replay_layers']} layers (about {r['replay_s']:.1f} s)")
    for f in r["faults"]:
        detail = f.get("reason") or f.get("error") or ""
        lines.append(f"fault: {f['event']} at {_clock(f['time'])} on rank {f.get('rank')} in epoch {f.get('epoch')}"
                     + (f": {detail}" if detail else ""))
    return "\n".join(lines)


def draw(r: dict, path: str):
    """Layer commits over time, epochs (restarts) and their world sizes marked, time lost shaded."""
    from matplotlib.figure import Figure

    t0 = min([e["time"] for e in r["epochs"]] + [c["time"] for c in r["commits"]], default=0.0)
    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    ax.scatter([(c["time"] - t0) / 60 for c in r["commits"]], [c["layer"] for c in r["commits"]], s=12,
               c=[c["epoch"] for c in r["commits"]], cmap="tab10", vmin=1, vmax=10, label="layer committed")
    for e in r["epochs"]:
        x = (e["time"] - t0) / 60
        ax.axvline(x, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(f"epoch {e['epoch']}, W={e['world_size']}", (x, 1), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=8)
    for a, b in r["lost_spans"]:
        ax.axvspan((a - t0) / 60, (b - t0) / 60, color="red", alpha=0.15, label="time lost")
    ax.set(xlabel="minutes since the job started", ylabel="layer", ylim=(-0.5, r["layers_total"] - 0.5),
           title=f"{r['layers_done']}/{r['layers_total']} layers, {r['restarts']} restarts, "
                 f"{r['lost_s']:.0f} s lost")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def show(root: str, as_json: bool = False, plot: str | None = None, watch: bool = False):
    """Print the report (and draw it); with `watch`, again at every change until the job is complete."""
    state = StateStore(root)
    records = open_records(state)
    try:
        for _ in _changes(records) if watch else [None]:
            r = report(state, records=records)
            if watch and not as_json and sys.stdout.isatty():
                print("\033[H\033[J", end="")
            print(json.dumps(r) if as_json else render(r), flush=True)
            if plot:
                draw(r, plot)
            if r["complete"]:
                return
    except KeyboardInterrupt:  # how a watch usually ends
        pass


def _changes(records: Records):
    """When to refresh: now, then at every change of the etcd progress key when the job has a coordinator
    (at least every REFRESH_S), else every REFRESH_S."""
    yield None
    while True:
        yield from records.watch_progress(REFRESH_S)


def _round(x):
    return None if x is None else round(x, 3)


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h {s % 3600 // 60:02d}m {s % 60:02d}s" if s >= 3600 else \
        f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
