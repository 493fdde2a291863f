"""Durability at GPU speed, emulated on this CPU: the state on a throttled store.

    python bench/durability.py                      # SmolLM2-135M, 128 x 512 tokens
    python bench/durability.py --samples 32         # a quicker look
    python bench/durability.py --object-store-only  # only the state on a local S3 server against a local one

Compares, in one invocation, the previous design (every layer's boundary written, hashed with sha256 and
fsynced inside its commit, then read back: git revision --baseline) with the current default
(--boundary-every auto: boundaries written behind the commits, activations kept in memory). Each runs as its own
process through `elastic-oneshot run`, its state's writes throttled by a wrapper of the storage layer
(StateStore.write_bytes sleeps as a link of --bandwidth MB/s would take; default: the bandwidth at which writing
every boundary synchronously costs about 70 % of the compute). Prints wall times, the share of the layer loop not
spent computing, bytes written per layer, the seconds from a restart after kill -9 to its first new commit, the
same job with its state on a local S3-compatible server (moto) with the MB/s moved there, and the issue's table
modeled from the per-byte costs measured here.
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASELINE = "ab11bb4"  # the last revision that wrote every boundary inside the commit

# Runs `elastic-oneshot run` with StateStore.write_bytes throttled to BANDWIDTH bytes/s (0: not throttled),
# counting the bytes; the package comes from sys.path[0] (the baseline's worktree, or this checkout).
WORKER = """
import atexit, json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from elastic_oneshot.surface import cli
from elastic_oneshot.durability import state
bandwidth, written, lock = float(os.environ["BENCH_BANDWIDTH"]), [0], threading.Lock()
plain = state.StateStore.write_bytes
def throttled(self, rel, data, *args, **kwargs):
    with lock:  # one link: writes queue behind each other
        if bandwidth:
            time.sleep(len(data) / bandwidth)
        written[0] += len(data)
    return plain(self, rel, data, *args, **kwargs)
state.StateStore.write_bytes = throttled
atexit.register(lambda: open(os.environ["BENCH_BYTES"], "w").write(str(written[0])))
sys.exit(cli.main(sys.argv[2:]))
"""


def run(code: str, args: list[str], bandwidth: float, log: str, kill_after: int | None = None) -> dict:
    """One `elastic-oneshot run`; with `kill_after`, SIGKILL it once that many layers are committed."""
    env = {**os.environ, "BENCH_BANDWIDTH": str(bandwidth), "BENCH_BYTES": log + ".bytes"}
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", WORKER, code, "run", *args], stdout=f, stderr=subprocess.STDOUT,
                                env=env)
        state = args[args.index("--state") + 1]
        while kill_after is not None and proc.poll() is None and commits(state) < kill_after:
            time.sleep(0.05)
        if kill_after is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    if kill_after is not None:
        return {}
    if proc.returncode != 0:
        sys.exit(f"run failed; see {log}")
    with open(log + ".bytes") as f:
        return {"wall": time.perf_counter() - t, "bytes": int(f.read())}


def events(state: str) -> list[dict]:
    from elastic_oneshot.durability.state import StateStore

    return StateStore(state).events()


def commits(state: str) -> int:
    try:
        return sum(e["event"] == "commit" for e in events(state))
    except (OSError, ValueError):
        return 0


def loop(state: str) -> dict:
    """From the last epoch's events: the layer loop's wall time, its compute, and the first commit's delay."""
    ev = events(state)
    start = [e for e in ev if e["event"] == "start"][-1]
    mine = [e for e in ev if e.get("epoch") == start["epoch"] and e["event"] in ("layer", "commit")]
    done = [e for e in mine if e["event"] == "commit"]
    compute = sum(v for e in done for k, v in e["seconds"].items() if k != "commit")
    return {"loop": done[-1]["time"] - mine[0]["time"], "compute": compute, "layers": len(done),
            "first_commit_s": done[0]["time"] - start["time"],
            "layer_compute": compute / len(done)}


def design(name: str, code: str, extra: list[str], job: list[str], bandwidth: float, work: str, seed: int) -> dict:
    """Unthrottled and throttled runs of one design, and a kill -9 at a random layer with a restart."""
    out = {}
    for label, bw in (("free", 0.0), ("throttled", bandwidth)):
        d = os.path.join(work, f"{name}-{label}")
        args = ["--state", d + ".state", "--output", d, *job, *extra]
        out[label] = {**run(code, args, bw, d + ".log"), **loop(d + ".state")}
        shutil.rmtree(d, ignore_errors=True)
    d = os.path.join(work, f"{name}-killed")
    args = ["--state", d + ".state", "--output", d, *job, *extra]
    layers = out["free"]["layers"]
    kill_at = random.Random(seed).randrange(2, layers - 2)
    run(code, args, bandwidth, d + ".log", kill_after=kill_at)
    run(code, args, bandwidth, d + ".log2")
    out["restart"] = {"killed_after": kill_at, **loop(d + ".state")}
    return out


def object_store(job: list[str], work: str) -> dict:
    """The current default with its state on a local S3-compatible server (moto), and the MB/s one rank moves
    to and from it in a boundary-sized object (multipart up, parallel ranged reads down)."""
    from elastic_oneshot.durability.storage import ObjectStorage
    from elastic_oneshot.testing.s3_server import S3Server

    with S3Server() as s3:
        os.environ.update(s3.env)
        d, url = os.path.join(work, "object-store"), f"s3://{s3.bucket}/bench"
        result = {**run(ROOT, ["--state", url, "--output", d, *job], 0.0, d + ".log"), **loop(url)}
        store, data = ObjectStorage(f"s3://{s3.bucket}/probe"), os.urandom(256 * 2**20)
        t = time.perf_counter()
        store.put("boundary", data)
        up = len(data) / (time.perf_counter() - t)
        t = time.perf_counter()
        store.get("boundary", len(data))
        down = len(data) / (time.perf_counter() - t)
    return {**result, "up": up, "down": down}


def modeled(write_bps: float, sha_bps: float, xxh_bps: float, read_bps: float):
    """The issue's table from per-byte costs: the previous design pays, per layer, writing the boundary,
    sha256 at write and at read, and reading it back; the new one keeps it off the critical path as long as the
    link carries a boundary per auto interval (Young and Daly, an hour between failures)."""
    from elastic_oneshot.durability.boundaries import DEFAULT_MTBF_S, auto_interval

    print(f"\nmodeled (per byte, measured here: fsync'd write {write_bps / 1e6:.0f} MB/s, read {read_bps / 1e6:.0f} "
          f"MB/s, sha256 {sha_bps / 1e9:.2f} GB/s, xxh3-128 {xxh_bps / 1e9:.1f} GB/s), 512 x 2048 tokens, bf16:")
    print(f"{'model':30s} {'boundary':>9s} {'s/layer':>8s} {'previous: share':>16s} {'every':>6s} "
          f"{'new: MB/s needed':>17s}")
    for name, hidden, layer_s in (("Llama-3-8B, 1 GPU", 4096, 23.0), ("Llama-3-8B, 4 GPUs", 4096, 8.3),
                                  ("Llama-3-70B", 8192, 10.0), ("Qwen3-30B-A3B", 2048, 296.0)):
        size = 512 * 2048 * hidden * 2
        previous = size / write_bps + 2 * size / sha_bps + size / read_bps
        write_s = size / write_bps + size / xxh_bps
        every = auto_interval(write_s, layer_s, layer_s / 3, DEFAULT_MTBF_S)
        print(f"{name:30s} {size / 1e9:7.1f}GB {layer_s:8.1f} {previous / (previous + layer_s):15.0%} "
              f"{every:6d} {size / (every * layer_s) / 1e6:17.0f}")


def per_byte(work: str) -> tuple[float, float, float, float]:
    import hashlib

    import xxhash

    data = os.urandom(256 * 2**20)
    path = os.path.join(work, "bytes.bin")
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    write = len(data) / (time.perf_counter() - t)
    t = time.perf_counter()
    with open(path, "rb") as f:
        f.read()
    read = len(data) / (time.perf_counter() - t)  # from the page cache: an upper bound
    t = time.perf_counter()
    hashlib.sha256(data).digest()
    sha = len(data) / (time.perf_counter() - t)
    t = time.perf_counter()
    xxhash.xxh3_128_digest(data)
    xxh = len(data) / (time.perf_counter() - t)
    os.remove(path)
    return write, sha, xxh, read


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--bandwidth", type=float, help="MB/s of the throttled store (default: 70 %% of compute)")
    p.add_argument("--baseline", default=BASELINE, help="git revision of the previous design")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--object-store-only", action="store_true",
                   help="only the state on a local S3 server against a local directory (no baseline)")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="durability-")
    if a.object_store_only:
        try:
            job = _job(a)
            local = run(ROOT, ["--state", work + "/local.state", "--output", work + "/local", *job], 0.0,
                        work + "/local.log")
            compare_object_store({**local, **loop(work + "/local.state")}, object_store(job, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    old = os.path.join(work, "baseline")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", old, a.baseline], check=True,
                   capture_output=True)
    try:
        job = _job(a)
        probe = os.path.join(work, "probe")
        free = {**run(ROOT, ["--state", probe + ".state", "--output", probe, *job], 0.0, probe + ".log"),
                **loop(probe + ".state")}
        hidden = 576  # SmolLM2-135M
        boundary = a.samples * a.seq_len * hidden * 4
        bandwidth = a.bandwidth * 1e6 if a.bandwidth else boundary / (0.7 * free["layer_compute"])
        print(f"boundary {boundary / 1e6:.1f} MB per layer; compute {free['layer_compute']:.2f} s per layer; "
              f"throttle {bandwidth / 1e6:.1f} MB/s")
        results = {"previous": design("previous", old, [], job, bandwidth, work, a.seed),
                   "new": design("new", ROOT, ["--boundary-every", "auto"], job, bandwidth, work, a.seed)}
        report(results)
        compare_object_store(results["new"]["free"], object_store(job, work))
        modeled(*per_byte(work))
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _job(a) -> list[str]:
    from elastic_oneshot.models.default_model import default_model

    return ["--model", default_model(), "--num-samples", str(a.samples), "--seq-len", str(a.seq_len),
            "--group-size", "64"]


def compare_object_store(local: dict, remote: dict):
    idle = {k: 1 - r["compute"] / r["loop"] for k, r in (("remote", remote), ("local", local))}
    print(f"\nstate on a local S3 server (moto): wall {remote['wall']:.1f} s against {local['wall']:.1f} s with a "
          f"local directory ({remote['wall'] / local['wall']:.3f}); not computing {idle['remote']:.1%} against "
          f"{idle['local']:.1%}; one rank moves {remote['up'] / 1e6:.0f} MB/s up, "
          f"{remote['down'] / 1e6:.0f} MB/s down")


def report(results: dict):
    print(f"\n{'design':10s} {'wall free':>10s} {'wall thr.':>10s} {'overhead':>9s} {'not computing':>14s} "
          f"{'MB/layer':>9s} {'restart->commit':>16s} {'layer compute':>14s}")
    for name, r in results.items():
        free, thr, restart = r["free"], r["throttled"], r["restart"]
        overhead = (thr["loop"] - free["loop"]) / thr["loop"]
        idle = 1 - thr["compute"] / thr["loop"]
        print(f"{name:10s} {free['wall']:9.1f}s {thr['wall']:9.1f}s {overhead:9.1%} {idle:14.1%} "
              f"{thr['bytes'] / thr['layers'] / 1e6:9.1f} {restart['first_commit_s']:15.1f}s "
              f"{restart['layer_compute']:13.2f}s   (killed after {restart['killed_after']} layers)")
    ratio = results["new"]["free"]["wall"] / results["previous"]["free"]["wall"]
    print(f"unthrottled wall time, new / previous: {ratio:.3f}")


if __name__ == "__main__":
    main()
