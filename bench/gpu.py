"""Ours against llmcompressor 0.14's `oneshot` (sequential pipeline) on one GPU, on the same random tokens, W4A16
group 128: a Llama-3-8B-shaped model cut to its first 8 decoder layers, and a Qwen3-30B-A3B-shaped one (128 experts,
8 routed) cut to 2, both with random bf16 weights (GPTQ's cost does not depend on the values; nothing is downloaded).

    python bench/gpu.py                        # both models: 256 x 2048 tokens (Llama), 128 x 2048 (Qwen3-MoE)
    python bench/gpu.py --only llama3-8b       # one of them (each fits one 10-minute device call)
    python bench/gpu.py --durability           # also ours with --boundary-every 0: the overhead of boundaries
    python bench/gpu.py --memory-trace         # on a GPU: where each side's peak GPU memory was (slower runs)
    python bench/gpu.py --only llama3-8b --layers 4 --samples 64 --recipe awq_w4a16_asym --recipe fp8_dynamic
                                               # issue 46's recipes (testing/recipes.py, groups of 128) from their
                                               # YAML, against the peer's oneshot of the same modifiers; a
                                               # data-free one (fp8_dynamic) also against a process that reads
                                               # every tensor and writes it (its goal: at most that)
    python bench/gpu.py --tiny                 # the same code on CPU, tiny shapes, 16 x 128 tokens (about a
                                               # minute of CPU, most of it five interpreters importing)
    python bench/gpu.py --device cpu --memory  # no GPU: one layer of each model, ours and the peer's, on paper
                                               # (testing/accountant.py): peak GPU bytes by phase, and the ratio
    python bench/gpu.py --device cpu --ops     # no GPU: our Qwen3-MoE layer's operations, FLOPs and bytes on paper,
                                               # and the seconds they model on an H100

Each side runs in its own process, one after the other; wall time and peak host RSS are that process's (start to
saved checkpoint, imports included), peak GPU memory is PyTorch's allocator's in it. Our seconds per phase are summed
from the state's events (each layer's commit event); on a GPU each phase ends by waiting for the device, so its
seconds are its own, but the Hessians' share of calibration is host time (the hooks' launches). Without
llmcompressor (the GPU machine lacks it unless the wheelhouse brought it: `launch/wheelhouse.sh --peer`), ours runs
alone and the peer is reported as skipped.

On the GPU machine (docs/operations.md, "A GPU session": one device `run` for all of it, carrying .wheelhouse/):
    launch/wheelhouse.sh --peer                # here, before: .wheelhouse/ (git-ignored)
    bash launch/gpu_session.sh all             # there: installs it, then this bench for each model under a deadline,
                                               # each side's figures merged into $OUT/result.json as it ends (--result)
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

from recipes import DATA_FREE  # noqa: E402  (bench/recipes.py: its floor, read + write, is run by its --copy-child)
from vs_llmcompressor import measure as measure_process  # noqa: E402

from elastic_oneshot.testing import accountant, gpu  # noqa: E402
from elastic_oneshot.testing.recipes import RECIPES, recipe_yaml  # noqa: E402
from elastic_oneshot.testing.runs import tree_digest  # noqa: E402

TOKENS = {"llama3-8b": (256, 2048), "qwen3-30b-a3b": (128, 2048)}  # samples x seq_len at full size
PAPER_TOKENS = {"memory": {"llama3-8b": (16, 2048), "qwen3-30b-a3b": (8, 2048)},  # --device cpu
                "ops": {"llama3-8b": (256, 2048), "qwen3-30b-a3b": (128, 2048)}}
PAPER_PHASES = ["load", "calibrate", "Hessians", "GPTQ", "propagate"]
H100 = {"launch": 10e-6, "flops": 400e12, "bytes": 3e12}  # s per op, FLOP/s, bytes/s: the --ops model
PHASES = [("load", "load"), ("calibrate", "calibrate"), ("hessian", "Hessians"), ("gptq", "GPTQ"),
          ("propagate", "propagate"), ("commit", "durability (commit)")]


def measure(side: str, args: list[str], log: str, report: str, env: dict) -> dict:
    """Run one side in its own process, its output appended to `log`; its wall seconds and peak RSS with what it
    reported of itself (in `report`)."""
    if os.path.exists(report):
        os.remove(report)
    t = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"== {side}: {' '.join(args)[:300]}\n")
        f.flush()
        since = f.tell()
        proc = subprocess.Popen([sys.executable, "-m", "elastic_oneshot.testing.gpu", side, report, *args],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    until = os.path.getsize(log)
    if os.waitstatus_to_exitcode(status) != 0 or not os.path.exists(report):
        sys.exit(f"{side} failed (exit {os.waitstatus_to_exitcode(status)}); the end of {log}:\n"
                 + tail(log, 30, since))
    with open(report) as f:
        return {**json.load(f), "wall": wall, "rss_bytes": usage.ru_maxrss * 1024, "log": log, "log_from": since,
                "log_to": until}


def tail(log: str, lines: int = 3, since: int = 0, until: int | None = None) -> str:
    """The last `lines` lines of `log` written between offsets `since` and `until` (one side's part of a log that
    both sides append to)."""
    with open(log, "rb") as f:
        f.seek(since)
        text = f.read(-1 if until is None else until - since).decode(errors="replace")
    last = [line.rstrip()[-160:] for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(f"    | {line}" for line in last[-lines:])


def save(path: str, key: str, value):
    """result.json at `path` with `key` set to `value` (the file merged, rewritten atomically): a session's
    results survive a step cut off at its deadline."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[key] = value
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def phases(state: str) -> tuple[dict, int]:
    from elastic_oneshot.durability.state import StateStore

    commits = [e for e in StateStore(state).events() if e["event"] == "commit"]
    return {k: sum(e["seconds"].get(k, 0.0) for e in commits) for k, _ in PHASES}, len(commits)


def sizes(name: str, a) -> tuple[int, int, str]:
    samples, seq_len = (16, 128) if a.tiny else TOKENS[name]
    return a.samples or samples, a.seq_len or seq_len, os.path.join(
        a.workdir, name + ("-tiny" if a.tiny else "") + (f"-{a.layers}-layers" if a.layers else ""))


def prepare(names: list[str], a):
    """Every model (random weights, built on the GPU if there is one) and its random tokens, kept in the workdir for
    the next run. Called in a process of its own, so that the bench's never holds the GPU."""
    for name in names:
        samples, seq_len, work = sizes(name, a)
        os.makedirs(work, exist_ok=True)
        gpu.make_shaped(os.path.join(work, "model"), name, tiny=a.tiny, layers=a.layers)
        vocab = (gpu.TINY if a.tiny else gpu.SHAPES)[name][2]["vocab_size"]
        gpu.random_token_text(os.path.join(work, f"tokens-{samples}x{seq_len}.txt"), vocab, samples, seq_len)


def wall_goal(recipe: str | None) -> float:
    """The most of the peer's wall time ours may take: GPTQ's (issue 43), a recipe's (issue 46)."""
    return 0.8 if recipe else 0.6


def table(name: str, ours: dict, theirs: dict | None, out: str, peer_out: str, samples: int, seq_len: int,
          recipe: str | None):
    """The figures of one model and recipe, printed as soon as both sides have run: a deadline that cuts the
    durability run short leaves them printed. Returns the share of identical codes (None without the peer)."""
    gb = 2**30
    title = f"{name}, {recipe}" if recipe else name
    print(f"\n{title} on {ours['device']} (torch {ours['torch']}), {samples} x {seq_len} tokens")
    print(f"{'':26}{'ours':>10}{'peer':>10}{'ratio':>8}")
    for label, key, scale, target in (("wall time (s)", "wall", 1, f"target <= {wall_goal(recipe)}"),
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
        same = gpu.identical(gpu.stored_codes(out), gpu.stored_codes(peer_out))
        print(f"{'identical codes':26}{same:10.4%}   (attention: eager, ours' default)")
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
    for side, facts in (("ours", ours), ("the peer's", theirs)):
        if facts:
            print(f"last lines of {side} ({facts['log']}):\n"
                  f"{tail(facts['log'], since=facts['log_from'], until=facts['log_to'])}")
    sys.stdout.flush()
    return same


def bench(name: str, recipe: str | None, a, env: dict, peer: bool) -> dict:
    """One model with GPTQ W4A16 (groups of 128), or with `recipe` (testing/recipes.py's, from its YAML)."""
    samples, seq_len, work = sizes(name, a)
    model, data = os.path.join(work, "model"), os.path.join(work, f"tokens-{samples}x{seq_len}.txt")
    moe = "moe" in gpu.SHAPES[name][0]
    print(f"\n== {name}: {samples} x {seq_len} random tokens, {recipe or 'W4A16 group 128'}", flush=True)
    tag = f"-{recipe}" if recipe else ""
    out, peer_out = os.path.join(work, "ours" + tag), os.path.join(work, "peer" + tag)
    if recipe:
        with open(out + ".yaml", "w") as f:
            f.write(recipe_yaml(recipe, moe))
    scheme = ["--recipe", out + ".yaml"] if recipe else ["--group-size", "128"]
    key = name + tag + ("-memory" if a.memory_trace else "")
    entry = {"model": name, "recipe": recipe, "samples": samples, "seq_len": seq_len, "ours": None, "peer": None}
    runs = {}

    def kept(**more):  # what is known so far, merged into --result at once
        entry.update(more)
        if a.result:
            save(a.result, key, entry)

    def run_ours(every: str, output: str) -> dict:
        for d in (output, output + ".state"):
            shutil.rmtree(d, ignore_errors=True)
        runs[every] = measure("ours", ["run", "--model", model, "--dataset", data, "--output", output,
                                       "--state", output + ".state", "--num-samples", str(samples), "--seq-len",
                                       str(seq_len), *scheme, "--chunk-size", str(a.chunk_size),
                                       "--boundary-every", every],
                              a.log or os.path.join(work, f"ours{tag}-{every}.log"),
                              os.path.join(work, f"ours{tag}-{every}.json"), env)
        kept(**{"ours": runs[every]} if output == out else {}, boundary_runs={k: v["wall"] for k, v in runs.items()})
        runs[every]["phases"] = phases(output + ".state")
        print(f"ours (--boundary-every {every}): {runs[every]['wall']:.1f} s, peak GPU memory "
              f"{runs[every]['peak_gpu_bytes'] / 2**30:.2f} GB", flush=True)
        kept()
        return runs[every]

    ours = run_ours("auto" if a.durability else a.boundary_every, out)
    theirs = None
    if peer:
        shutil.rmtree(peer_out, ignore_errors=True)
        job = dict(model_dir=model, out=peer_out, dataset=data, samples=samples, seq_len=seq_len, dtype="auto", moe=moe)
        job.update({"recipe": recipe, "group": 128} if recipe else {"group_size": 128})
        theirs = measure("peer-recipe" if recipe else "peer", [json.dumps(job)],
                         a.log or os.path.join(work, f"peer{tag}.log"), os.path.join(work, f"peer{tag}.json"), env)
        kept(peer=theirs, wall_ratio=ours["wall"] / theirs["wall"])
        print(f"peer: {theirs['wall']:.1f} s, ratio {ours['wall'] / theirs['wall']:.3f} "
              f"(target <= {wall_goal(recipe)})", flush=True)  # once kept: a deadline may cut it off any time
    same = table(name, ours, theirs, out, peer_out, samples, seq_len, recipe)
    kept(identical=same)
    if recipe in DATA_FREE:  # its goal (issue 46): at most the time to read and write the model
        copy = os.path.join(work, "copy")
        for durable, figure in (((), "read_write"), (("--durable",), "read_write_fsync")):
            shutil.rmtree(copy, ignore_errors=True)
            floor, _ = measure_process([sys.executable, os.path.join(ROOT, "bench", "recipes.py"), "--copy-child",
                                        model, copy, *durable], os.path.join(work, "copy.log"))
            print(f"read + write of the model{' + fsync' if durable else ''}: {floor:.1f} s; ours "
                  f"x{ours['wall'] / floor:.2f} of it (target <= 1.0)", flush=True)
            kept(**{f"{figure}_wall": floor, f"{figure}_ratio": ours["wall"] / floor})
        shutil.rmtree(copy, ignore_errors=True)
    if a.durability:  # last: where a deadline cuts the bench short, the figures above are printed
        run_ours("0", out + "-0")
        off, on = runs["0"]["wall"], runs["auto"]["wall"]
        same_bits = tree_digest(out) == tree_digest(out + "-0")
        print(f"durability: --boundary-every auto {on:.1f} s, 0 {off:.1f} s: overhead {on / off - 1:+.2%} "
              f"(target <= 5 %); the two checkpoints' bytes {'are identical' if same_bits else 'DIFFER'}", flush=True)
        kept(durability_identical=same_bits)
    return entry


def on_paper(side: str, model: str, samples: int, seq_len: int, work: str, env: dict) -> dict:
    """One side's layer on the accountant's paper GPU, in a process of its own (testing/accountant.py)."""
    report, log = os.path.join(work, f"paper-{side}.json"), os.path.join(work, f"paper-{side}.log")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "elastic_oneshot.testing.accountant", side, model, str(samples),
                               str(seq_len), report, "sites"], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"the accountant failed on {side}'s layer (exit {proc.returncode}); the end of {log}:\n"
                 + tail(log, 30))
    with open(report) as f:
        return json.load(f)


def modeled(p: dict) -> float:
    """Seconds on an H100 by the --ops model: ops x 10 us + FLOPs / 400 TFLOP/s + bytes / 3 TB/s."""
    return p["ops"] * H100["launch"] + p["flops"] / H100["flops"] + p["bytes"] / H100["bytes"]


def paper_memory(name: str, a, env: dict):
    samples, seq_len = (a.samples or PAPER_TOKENS["memory"][name][0], a.seq_len or PAPER_TOKENS["memory"][name][1])
    work = os.path.join(a.workdir, f"paper-{name}" + ("-tiny" if a.tiny else ""))
    model = accountant.paper_model(os.path.join(work, "model"), name, tiny=a.tiny)
    sides = ["ours"] + (["peer"] if gpu.peer_available() else [])
    got = {side: on_paper(side, model, samples, seq_len, work, env) for side in sides}
    gb = 2**30
    print(f"\n{name}: one layer{' (tiny)' if a.tiny else ''}, {samples} x {seq_len} tokens: peak GPU memory (GB) by "
          "phase, on paper")
    print(f"{'':14}" + "".join(f"{s:>10}" for s in sides) + ("   ratio" if "peer" in got else ""))
    for ph in [*PAPER_PHASES, "peak"]:
        values = [got[s]["peak"] if ph == "peak" else got[s]["phases"].get(ph, {}).get("peak", 0) for s in sides]
        ratio = f"{values[0] / values[1]:8.3f}" if len(values) > 1 and values[1] else ""
        print(f"  {ph:12}" + "".join(f"{v / gb:10.3f}" for v in values) + ratio)
    for side in sides:
        print(f"{side} at its peak, by where the live blocks were allocated:")
        for site, size in got[side]["at_peak"]:
            print(f"  {size / gb:9.3f} GB  {site}")
        for site, n in got[side].get("assumed", {}).items():
            print(f"  ({n} float reads taken as 0 at {site})")
    if "peer" in got:
        print(f"memory {name}: ours {got['ours']['peak'] / gb:.2f} GB, peer {got['peer']['peak'] / gb:.2f} GB, "
              f"ratio {got['ours']['peak'] / got['peer']['peak']:.3f}   (target <= 0.9)", flush=True)
    else:
        print(f"memory {name}: ours {got['ours']['peak'] / gb:.2f} GB, peer skipped (llmcompressor is not installed)")


def paper_ops(name: str, a, env: dict):
    samples, seq_len = (a.samples or PAPER_TOKENS["ops"][name][0], a.seq_len or PAPER_TOKENS["ops"][name][1])
    work = os.path.join(a.workdir, f"paper-{name}" + ("-tiny" if a.tiny else ""))
    model = accountant.paper_model(os.path.join(work, "model"), name, tiny=a.tiny)
    got = on_paper("ours", model, samples, seq_len, work, env)
    print(f"\n{name}: our layer{' (tiny)' if a.tiny else ''}, {samples} x {seq_len} tokens, on paper: each operation "
          f"{H100['launch'] * 1e6:.0f} us, {H100['flops'] / 1e12:.0f} TFLOP/s, {H100['bytes'] / 1e12:.0f} TB/s "
          "(an H100)")
    print(f"  {'':12}{'ops':>10}{'in graphs':>11}{'TFLOP':>10}{'GB moved':>10}{'syncs':>8}{'modeled s':>11}")
    total = {"ops": 0, "flops": 0, "bytes": 0, "graphed": 0}
    for ph in PAPER_PHASES:
        p = got["phases"].get(ph)
        if p:
            print(f"  {ph:12}{p['ops']:10}{p['graphed']:11}{p['flops'] / 1e12:10.2f}{p['bytes'] / 1e9:10.1f}"
                  f"{p['syncs']:8}{modeled(p):11.2f}")
            total = {k: total[k] + p[k] for k in total}
    print("  (ops: launched by the host, a CUDA graph's replay one of them; in graphs: the kernels those replays run, "
          "whose bytes and FLOPs count)")
    print("  operations counted most: " + ", ".join(f"{op} {n}" for op, n in got["ops_by_name"]))
    print(f"modeled {name}: {modeled(total):.2f} s per layer on an H100 ({total['ops']} ops, "
          f"{total['flops'] / 1e12:.1f} TFLOP, {total['bytes'] / 1e9:.1f} GB)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=list(gpu.SHAPES), action="append", help="one model (repeatable; default both)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: the same code, in under a minute")
    p.add_argument("--samples", type=int, help="calibration samples (default 256 Llama, 128 Qwen3-MoE; tiny 16)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 2048; tiny 128)")
    p.add_argument("--layers", type=int, help="decoder layers of the model (default 8 Llama, 2 Qwen3-MoE; tiny 2)")
    p.add_argument("--recipe", action="append", choices=list(RECIPES),
                   help="a recipe of issue 46 instead of GPTQ W4A16, against the peer's (repeatable)")
    p.add_argument("--chunk-size", type=int, default=8, help="ours: calibration samples per chunk (its default 8)")
    p.add_argument("--boundary-every", default="auto", help="ours: auto, N or 0 (its default auto)")
    p.add_argument("--durability", action="store_true", help="run ours with --boundary-every auto and 0: overhead")
    p.add_argument("--skip-peer", action="store_true", help="ours alone")
    p.add_argument("--memory-trace", action="store_true",
                   help="on a GPU, each side records its allocations: where its peak GPU memory was (slower runs)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="cpu: no GPU, one layer on paper (testing/accountant.py), with --memory and/or --ops")
    p.add_argument("--memory", action="store_true", help="--device cpu: peak GPU memory by phase, ours and the peer's")
    p.add_argument("--ops", action="store_true",
                   help="--device cpu: our operations, FLOPs and bytes, modeled on an H100")
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench-work", "gpu"))
    p.add_argument("--log", help="append every side's output to this file (default: a log per side in the workdir)")
    p.add_argument("--result", help="merge the results into this JSON file after each side (a session's result.json; "
                   "default: result.json in the workdir, at the end)")
    p.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    names = a.only or list(gpu.SHAPES)
    if a.device == "cpu":
        if not (a.memory or a.ops):
            p.error("--device cpu counts on paper: give --memory and/or --ops")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        for name in names if a.memory else []:
            paper_memory(name, a, env)
        for name in (a.only or ["qwen3-30b-a3b"]) if a.ops else []:
            paper_ops(name, a, env)
        return
    if a.memory or a.ops:
        p.error("--memory and --ops count on paper: add --device cpu")
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
    if a.tiny:  # on the CPU: no GPU for this process to keep hold of
        prepare(names, a)
    else:
        subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--prepare-only"], check=True,
                       env=env)
    print(f"models and tokens ready in {time.perf_counter() - t:.0f} s", flush=True)
    peer = not a.skip_peer and gpu.peer_available()
    results, failed = [], []
    for name in names:
        for recipe in a.recipe or [None]:
            try:
                results.append(bench(name, recipe, a, env, peer))
            except SystemExit as e:  # a side failed: its lines are printed, the next recipe runs
                if not a.recipe:
                    raise
                print(e, flush=True)
                failed.append(recipe)
    if not a.result:
        with open(os.path.join(a.workdir, "result" + ("-tiny" if a.tiny else "") + ".json"), "w") as f:
            json.dump(results, f, indent=1)
    if not peer:
        print("\nthe peer was skipped: " + ("--skip-peer" if a.skip_peer else "llmcompressor is not installed"))
    print(f"bench: {time.perf_counter() - t:.0f} s in all")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
