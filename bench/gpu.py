"""Ours against llmcompressor 0.14's `oneshot` (sequential pipeline) on one GPU, on the same random tokens, W4A16
group 128: a Llama-3-8B-shaped model cut to its first 8 decoder layers, and a Qwen3-30B-A3B-shaped one (128 experts,
8 routed) cut to 2, both with random bf16 weights (GPTQ's cost does not depend on the values; nothing is downloaded).

    python bench/gpu.py                        # both models: 256 x 2048 tokens (Llama), 128 x 2048 (Qwen3-MoE)
    python bench/gpu.py --only llama3-8b       # one of them (each fits one 10-minute device call)
    python bench/gpu.py --durability           # also ours with --boundary-every 0: the overhead of boundaries
    python bench/gpu.py --memory-trace         # on a GPU: where each side's peak GPU memory was (slower runs)
    python bench/gpu.py --tiny                 # the same code on CPU, tiny shapes, 16 x 128 tokens (about a
                                               # minute of CPU, most of it five interpreters importing)

Each side runs in its own process, one after the other; wall time and peak host RSS are that process's (start to
saved checkpoint, imports included), peak GPU memory is PyTorch's allocator's in it. Our seconds per phase are summed
from the state's events (each layer's commit event); on a GPU each phase ends by waiting for the device, so its
seconds are its own, but the Hessians' share of calibration is host time (the hooks' launches). Without
llmcompressor (the GPU machine lacks it unless the wheelhouse brought it: `launch/wheelhouse.sh --peer`), ours runs
alone and the peer is reported as skipped.

On the GPU machine (docs/operations.md, "A GPU session": one device `run` per step, carrying .wheelhouse/):
    launch/wheelhouse.sh --peer                # here, before: .wheelhouse/ (git-ignored)
    bash launch/gpu_session.sh llama3-8b       # there: installs it, then this bench for one model at full size
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from elastic_oneshot.testing import gpu  # noqa: E402
from elastic_oneshot.testing.runs import tree_digest  # noqa: E402

TOKENS = {"llama3-8b": (256, 2048), "qwen3-30b-a3b": (128, 2048)}  # samples x seq_len at full size
PHASES = [("load", "load"), ("calibrate", "calibrate"), ("hessian", "Hessians"), ("gptq", "GPTQ"),
          ("propagate", "propagate"), ("commit", "durability (commit)")]


def measure(side: str, args: list[str], log: str, env: dict) -> dict:
    """Run one side in its own process; its wall seconds and peak RSS with what it reported of itself."""
    report = log + ".json"
    if os.path.exists(report):
        os.remove(report)
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "elastic_oneshot.testing.gpu", side, report, *args],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0 or not os.path.exists(report):
        with open(log) as f:
            sys.exit(f"{side} failed (exit {os.waitstatus_to_exitcode(status)}); the end of {log}:\n"
                     + "".join(f.readlines()[-30:]))
    with open(report) as f:
        return {**json.load(f), "wall": wall, "rss_bytes": usage.ru_maxrss * 1024, "log": log}


def tail(log: str, lines: int = 3) -> str:
    with open(log, errors="replace") as f:
        last = [line.rstrip()[-160:] for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(f"    | {line}" for line in last[-lines:])


def phases(state: str) -> tuple[dict, int]:
    from elastic_oneshot.durability.state import StateStore

    commits = [e for e in StateStore(state).events() if e["event"] == "commit"]
    return {k: sum(e["seconds"].get(k, 0.0) for e in commits) for k, _ in PHASES}, len(commits)


def sizes(name: str, a) -> tuple[int, int, str]:
    samples, seq_len = (16, 128) if a.tiny else TOKENS[name]
    return a.samples or samples, a.seq_len or seq_len, os.path.join(a.workdir, name + ("-tiny" if a.tiny else ""))


def prepare(names: list[str], a):
    """Every model (random weights, built on the GPU if there is one) and its random tokens, kept in the workdir for
    the next run. Called in a process of its own, so that the bench's never holds the GPU."""
    for name in names:
        samples, seq_len, work = sizes(name, a)
        os.makedirs(work, exist_ok=True)
        gpu.make_shaped(os.path.join(work, "model"), name, tiny=a.tiny)
        vocab = (gpu.TINY if a.tiny else gpu.SHAPES)[name][2]["vocab_size"]
        gpu.random_token_text(os.path.join(work, f"tokens-{samples}x{seq_len}.txt"), vocab, samples, seq_len)


def table(name: str, ours: dict, theirs: dict | None, out: str, peer_out: str, samples: int, seq_len: int):
    """The figures of one model, printed as soon as both sides have run: a deadline that cuts the durability run
    short leaves them printed. Returns the share of identical codes (None without the peer)."""
    gb = 2**30
    print(f"\n{name} on {ours['device']} (torch {ours['torch']}), {samples} x {seq_len} tokens")
    print(f"{'':26}{'ours':>10}{'peer':>10}{'ratio':>8}")
    for label, key, scale, target in (("wall time (s)", "wall", 1, "target <= 0.6"),
                                      ("peak GPU memory (GB)", "peak_gpu_bytes", gb, "target <= 1.0"),
                                      ("  reserved (GB)", "reserved_gpu_bytes", gb, ""),
                                      ("peak host RSS (GB)", "rss_bytes", gb, "")):
        mine = ours[key] / scale
        if theirs:
            ratio = f"{mine / (theirs[key] / scale):8.3f}" if theirs[key] else f"{'-':>8}"
            print(f"{label:26}{mine:10.2f}{theirs[key] / scale:10.2f}{ratio}   {target}")
        else:
            print(f"{label:26}{mine:10.2f}{'skipped':>10}")
    same = None
    if theirs:
        same = gpu.identical(gpu.int4_codes(out), gpu.int4_codes(peer_out))
        print(f"{'identical int codes':26}{same:10.4%}   (attention: eager, ours' default)")
        if gpu.SHAPES[name][0] == "qwen3_moe":
            print("  (the peer's traced pipeline calibrates Qwen3-MoE with bidirectional attention, ours causal: "
                  "DESIGN.md section 6; tests/test_moe.py compares them with attention zeroed)")
    else:
        print("peer skipped: llmcompressor is not installed here (launch/wheelhouse.sh --peer brings it)")
    seconds, layers = ours["phases"]
    print(f"our seconds per phase, over {layers} layers:")
    for key, label in PHASES:
        print(f"  {label:24}{seconds[key]:9.2f} s")
    print(f"  {'the rest of the wall':24}{ours['wall'] - sum(seconds.values()):9.2f} s   (imports, tokenizing, "
          "embedding, the trial of layer 0, export)")
    print(f"  {'(not in the events)':24} boundary writes: behind the computation, in the I/O thread")
    for side, facts in (("ours", ours), ("the peer's", theirs)):
        if facts and facts.get("peak_sites"):
            print(f"{side} blocks live at the peak ({facts['peak_sites'][0][1] / 2**30:.3f} GB), by where allocated:")
            for site, size in facts["peak_sites"][1:]:
                print(f"  {size / 2**30:9.3f} GB  {site}")
    print(f"last lines of ours ({ours['log']}):\n{tail(ours['log'])}")
    if theirs:
        print(f"last lines of the peer's ({theirs['log']}):\n{tail(theirs['log'])}")
    sys.stdout.flush()
    return same


def bench(name: str, a, env: dict, peer: bool) -> dict:
    samples, seq_len, work = sizes(name, a)
    model, data = os.path.join(work, "model"), os.path.join(work, f"tokens-{samples}x{seq_len}.txt")
    print(f"\n== {name}: {samples} x {seq_len} random tokens, W4A16 group 128", flush=True)
    out, peer_out = os.path.join(work, "ours"), os.path.join(work, "peer")
    runs = {}

    def run_ours(every: str, output: str) -> dict:
        for d in (output, output + ".state"):
            shutil.rmtree(d, ignore_errors=True)
        runs[every] = measure("ours", ["run", "--model", model, "--dataset", data, "--output", output,
                                       "--state", output + ".state", "--num-samples", str(samples), "--seq-len",
                                       str(seq_len), "--group-size", "128", "--chunk-size", str(a.chunk_size),
                                       "--boundary-every", every], os.path.join(work, f"ours-{every}.log"), env)
        runs[every]["phases"] = phases(output + ".state")
        print(f"ours (--boundary-every {every}): {runs[every]['wall']:.1f} s, peak GPU memory "
              f"{runs[every]['peak_gpu_bytes'] / 2**30:.2f} GB", flush=True)
        return runs[every]

    ours = run_ours("auto" if a.durability else a.boundary_every, out)
    theirs = None
    if peer:
        shutil.rmtree(peer_out, ignore_errors=True)
        theirs = measure("peer", [json.dumps(dict(model_dir=model, out=peer_out, dataset=data, samples=samples,
                                                  seq_len=seq_len, group_size=128, dtype="auto",
                                                  moe="moe" in gpu.SHAPES[name][0]))],
                         os.path.join(work, "peer.log"), env)
        print(f"peer: {theirs['wall']:.1f} s, ratio {ours['wall'] / theirs['wall']:.3f} (target <= 0.6)", flush=True)
    same = table(name, ours, theirs, out, peer_out, samples, seq_len)
    if a.durability:  # last: where a deadline cuts the bench short, the figures above are printed
        run_ours("0", out + "-0")
        off, on = runs["0"]["wall"], runs["auto"]["wall"]
        same_bits = tree_digest(out) == tree_digest(out + "-0")
        print(f"durability: --boundary-every auto {on:.1f} s, 0 {off:.1f} s: overhead {on / off - 1:+.2%} "
              f"(target <= 5 %); the two checkpoints' bytes {'are identical' if same_bits else 'DIFFER'}", flush=True)
    return {"model": name, "samples": samples, "seq_len": seq_len, "ours": ours, "peer": theirs, "identical": same,
            "boundary_runs": {k: v["wall"] for k, v in runs.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=list(gpu.SHAPES), action="append", help="one model (repeatable; default both)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: the same code, in under a minute")
    p.add_argument("--samples", type=int, help="calibration samples (default 256 Llama, 128 Qwen3-MoE; tiny 16)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 2048; tiny 128)")
    p.add_argument("--chunk-size", type=int, default=8, help="ours: calibration samples per chunk (its default 8)")
    p.add_argument("--boundary-every", default="auto", help="ours: auto, N or 0 (its default auto)")
    p.add_argument("--durability", action="store_true", help="run ours with --boundary-every auto and 0: overhead")
    p.add_argument("--skip-peer", action="store_true", help="ours alone")
    p.add_argument("--memory-trace", action="store_true",
                   help="on a GPU, each side records its allocations: where its peak GPU memory was (slower runs)")
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench-work", "gpu"))
    p.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    names = a.only or list(gpu.SHAPES)
    if a.prepare_only:
        return prepare(names, a)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if a.tiny:
        # the CPU path, whatever the machine; both sides on one thread, as in the parity tests (LAPACK's Cholesky
        # gives other bits on several threads: DESIGN.md section 6)
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    if a.memory_trace:
        env["ELASTIC_ONESHOT_MEMORY_TRACE"] = "1"
    t = time.perf_counter()
    subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--prepare-only"], check=True, env=env)
    print(f"models and tokens ready in {time.perf_counter() - t:.0f} s", flush=True)
    peer = not a.skip_peer and gpu.peer_available()
    results = [bench(name, a, env, peer) for name in names]
    with open(os.path.join(a.workdir, "result" + ("-tiny" if a.tiny else "") + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    if not peer:
        print("\nthe peer was skipped: " + ("--skip-peer" if a.skip_peer else "llmcompressor is not installed"))
    print(f"bench: {time.perf_counter() - t:.0f} s in all")


if __name__ == "__main__":
    main()
