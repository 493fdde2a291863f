"""Durability on a real link: the state on an S3-compatible server behind a token-bucket link.

    python bench/durability.py                      # SmolLM2-135M, 32 x 512 tokens, a 26 Mbit/s link each way
    python bench/durability.py --mbit 50 --samples 64
    python bench/durability.py --previous 1fee0e0   # the same runs of another revision, in the same invocation
    python bench/durability.py --threads 1          # compute on one core, the other left to the server and link
    python bench/durability.py --repeats 3          # each design three times, interleaved: the ratio of medians
    python bench/durability.py --repeats 0          # only the kill -9 and the restart

The server (moto) runs in a network namespace of its own, reached over a veth pair shaped by `tc tbf` in both
directions (elastic_oneshot/testing/netns.py; created and removed here), so concurrent uploads share the link as
they would share a real one. 26 Mbit/s (about 3.3 MB/s) is issue 24's setup: a link that carries one layer's
compressed weights in about a quarter of this CPU's layer time, and one boundary in a few layers' time. Where
network namespaces are not allowed, the state goes to a local directory whose writes sleep as a link of that
bandwidth would take, one at a time (a lock: it cannot show sharing).

Each design (`--boundary-every 0` and `auto`) runs as its own `elastic-oneshot run` process. Prints per design:
wall, the seconds the layer loop spent computing and those it waited for storage (the "commit" phase: waiting
for its own files and for a boundary write to hand over) and their share of wall, bytes written per layer, and
the CPU seconds the server spent (on this machine it takes them from the run's two cores; on a fleet the store
is elsewhere); then a run killed with SIGKILL after --kill-after commits and restarted (with boundaries every
--killed-every layers, so that restarts replay the same layers from run to run): the seconds
from the restart to its first new commit and how they split (to the epoch, verification included; the replay,
and how long of it waited for the boundary, which is read ahead from the process's start; the layers until the
commit, two with commits written behind).
"""

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs `elastic-oneshot run` with the package from sys.argv[1], counting the bytes its state writes; where
# BENCH_BANDWIDTH is set (no namespace), each write sleeps as a link of that many bytes/s would take, one at a time.
WORKER = """
import atexit, contextlib, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from elastic_oneshot.surface import cli
from elastic_oneshot.durability import state
bandwidth, written, lock = float(os.environ["BENCH_BANDWIDTH"]), [0], threading.Lock()
plain = state.StateStore.write_bytes
def counted(self, rel, data, *args, **kwargs):
    with lock if bandwidth else contextlib.nullcontext():
        if bandwidth:
            time.sleep(len(data) / bandwidth)
        written[0] += len(data)
    return plain(self, rel, data, *args, **kwargs)
state.StateStore.write_bytes = counted
atexit.register(lambda: open(os.environ["BENCH_BYTES"], "w").write(str(written[0])))
sys.exit(cli.main(sys.argv[2:]))
"""


def history(state: str):
    """The state's events.History (empty while there is no state)."""
    from elastic_oneshot.durability.state import StateStore
    from elastic_oneshot.events import History

    try:
        return History(StateStore(state).events())
    except (OSError, ValueError):
        return History([])


def run(code: str, args: list[str], env: dict, log: str, kill_after: int | None = None) -> dict:
    """One `elastic-oneshot run` of the package at `code`; with `kill_after`, SIGKILL it once that many layers
    are committed."""
    state = args[args.index("--state") + 1]
    env = {**os.environ, **env, "BENCH_BYTES": log + ".bytes"}
    t, launched, server = time.perf_counter(), time.time(), server_cpu()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", WORKER, code, "run", *args], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
        while kill_after is not None and proc.poll() is None and \
                len(history(state).commits) < kill_after:
            time.sleep(0.05)
        if kill_after is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    wall = time.perf_counter() - t
    if kill_after is None and proc.returncode != 0:
        sys.exit(f"run failed; see {log}")
    return {"wall": wall, "bytes": int(open(log + ".bytes").read()) if kill_after is None else 0,
            "launched": launched, "server_cpu": server_cpu() - server}


def server_cpu() -> float:
    """CPU seconds the S3 server has used so far (it shares this machine's cores with the run), 0 without one."""
    import psutil

    pid = os.environ.get("BENCH_SERVER_PID")
    return sum(psutil.Process(int(pid)).cpu_times()[:2]) if pid else 0.0


def loop(state: str) -> dict:
    """From the last epoch's events: seconds waiting for storage, layers, and the first commit after the start."""
    events = history(state)
    start = events.starts[-1]
    done = [e for e in events.commits if e["epoch"] == start["epoch"]]
    return {"waited": sum(e["seconds"].get("commit", 0.0) for e in done), "layers": len(done),
            "compute": sum(v for e in done for k, v in e["seconds"].items() if k != "commit"),
            "started": start["time"], "first_commit": done[0]["time"]}


def restart_split(log: str, r: dict) -> str:
    """How a restart's time to its first new commit splits, from its events and log lines."""
    text = open(log).read()
    found = re.search(r"replayed layers (\d+\.\.\d+) for \d+ chunks in ([\d.]+) s \(([\d.]+) s of it waiting", text)
    span, replayed, waited = (found.group(1), float(found.group(2)), float(found.group(3))) if found else ("none", 0, 0)
    verify = float((re.search(r"committed layers verified in ([\d.]+) s", text) or [0, 0])[1])
    ahead = re.search(r"read ahead \d+ files \(([\d.]+) MB\) in ([\d.]+) s", text)
    ahead = f"{ahead[1]} MB in {ahead[2]} s ({float(ahead[1]) / float(ahead[2]):.2f} MB/s)" if ahead else "nothing"
    return (f"{r['first_commit'] - r['launched']:.1f} s: to the epoch {r['started'] - r['launched']:.2f} s "
            f"(verification {verify:.2f} s), replay of layers {span} {replayed:.2f} s ({waited:.2f} s of it waiting "
            f"for the boundary; read ahead from the process's start: {ahead}), the layers until the commit "
            f"{r['first_commit'] - r['started'] - replayed:.2f} s")


def tree_digest(root: str) -> dict:
    from elastic_oneshot.testing.runs import tree_digest

    return tree_digest(root)


def designs(code: str, label: str, job: list[str], states: str, env: dict, work: str, kill_after: int,
            killed_every: str, repeats: int) -> list:
    """Each design's runs (none with `repeats` 0), then the killed run and its restart."""
    rows = []
    for i in range(repeats):  # interleaved, so that a drift of the machine's speed falls on both designs
        for every in ("0", "auto"):
            name = f"{label}-{every}" + (f"-{i + 1}" if repeats > 1 else "")
            args = ["--state", f"{states}/{name}", "--output", os.path.join(work, name), *job, "--boundary-every",
                    every]
            rows.append((name, {**run(code, args, env, os.path.join(work, name + ".log")),
                                **loop(f"{states}/{name}"), "label": label, "design": every}))
    name = f"{label}-auto-killed"
    args = ["--state", f"{states}/{name}", "--output", os.path.join(work, name), *job, "--boundary-every",
            killed_every]
    run(code, args, env, os.path.join(work, name + ".log"), kill_after=kill_after)
    restarted = {**run(code, args, env, os.path.join(work, name + ".log2")), **loop(f"{states}/{name}")}
    rows.append((name, {**restarted, "split": restart_split(os.path.join(work, name + ".log2"), restarted)}))
    if repeats:
        digests = {tree_digest(os.path.join(work, n)) == tree_digest(os.path.join(work, rows[0][0]))
                   for n, _ in rows}
        print(f"{label}: checkpoints of 0, auto and the killed run byte-identical: {digests == {True}}")
    return rows


def report(rows: list, mbit: float):
    print(f"\nthe state behind a {mbit:g} Mbit/s link ({mbit / 8:.2f} MB/s) each way")
    if any("split" not in r for _, r in rows):
        print(f"{'design':22s} {'wall':>8s} {'computing':>10s} {'waited':>8s} {'share':>7s} {'MB/layer':>9s} "
              f"{'server CPU':>11s}")
    for name, r in rows:
        if "split" in r:
            print(f"{name}: from the restart's launch to its first new commit {r['split']}")
        else:
            print(f"{name:22s} {r['wall']:7.1f}s {r['compute']:9.1f}s {r['waited']:7.1f}s "
                  f"{r['waited'] / r['wall']:7.1%} {r['bytes'] / r['layers'] / 1e6:9.2f} {r['server_cpu']:10.1f}s")
    for label in sorted({r["label"] for _, r in rows if "split" not in r}):
        walls = {d: [r["wall"] for _, r in rows if r.get("label") == label and r.get("design") == d]
                 for d in ("0", "auto")}
        print(f"{label}: wall auto / wall 0 = {statistics.median(walls['auto']) / statistics.median(walls['0']):.3f}"
              + (f" (medians of {len(walls['0'])} interleaved runs each)" if len(walls["0"]) > 1 else ""))


@contextlib.contextmanager
def state_root(mbit: float, work: str):
    """Where the states go, and the environment the runs need: the server behind the link, or else a throttled
    local directory."""
    from elastic_oneshot.testing.netns import Namespace, NamespaceUnavailable
    from elastic_oneshot.testing.s3_server import S3Server

    try:
        with Namespace(mbit=mbit) as link, S3Server(namespace=link) as server:
            yield f"s3://{server.bucket}", {**server.env, "BENCH_BANDWIDTH": "0",
                                            "BENCH_SERVER_PID": str(server.proc.pid)}
    except NamespaceUnavailable as e:
        print(f"no network namespace ({e}): a local directory throttled by a lock instead")
        yield os.path.join(work, "states"), {"BENCH_BANDWIDTH": str(mbit * 1e6 / 8)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--mbit", type=float, default=26.0, help="the link's rate each way, Mbit/s (default 26)")
    p.add_argument("--kill-after", type=int, default=12, help="commits before the kill -9 (default 12)")
    p.add_argument("--killed-every", default="6",
                   help="--boundary-every of the killed run (default 6: with auto, where the kill falls in its "
                        "schedule decides how many layers the restart replays)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the runs (default: torch's, every core); one "
                   "fewer than the cores leaves one to the server, the link and the uploads, as a GPU node has")
    p.add_argument("--previous", help="a git revision to run the same way, in the same invocation")
    p.add_argument("--repeats", type=int, default=1, help="runs of each design, interleaved; the ratio is of their "
                   "medians (on a shared machine one pair of runs can differ by 10 %% for the same design); 0: only "
                   "the killed run and its restart")
    a = p.parse_args()
    from elastic_oneshot.models.default_model import default_model

    job = ["--model", default_model(), "--num-samples", str(a.samples), "--seq-len", str(a.seq_len),
           "--group-size", "64"]
    work = tempfile.mkdtemp(prefix="durability-")
    old = os.path.join(work, "previous")
    try:
        if a.previous:
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", old, a.previous], check=True,
                           capture_output=True)
        with state_root(a.mbit, work) as (states, env):
            os.environ.update(env)  # this process reads the states' events too
            env |= {"OMP_NUM_THREADS": str(a.threads)} if a.threads else {}
            rows = designs(ROOT, "current", job, states, env, work, a.kill_after, a.killed_every, a.repeats)
            if a.previous:
                rows += designs(old, "previous", job, states, env, work, a.kill_after, a.killed_every, a.repeats)
        report(rows, a.mbit)
    finally:
        if a.previous:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
