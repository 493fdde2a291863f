"""Our single-process run against llmcompressor's `oneshot`, same model, samples, length and scheme.

    python bench/vs_llmcompressor.py                 # SmolLM2-135M, W4A16 g64, 128 x 512 tokens
    python bench/vs_llmcompressor.py --scheme NVFP4  # any preset, with its own group sizes
    python bench/vs_llmcompressor.py --samples 16    # a quick look

Each side runs in its own process; wall time and peak RSS are that process's, from start to saved
checkpoint. Perplexity is measured afterwards on held-out text. Prints the ratios ours/peer, our
achieved GFLOP/s per phase, and the share of wall time spent committing.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from elastic_oneshot.testing.peer import run_peer  # llmcompressor on our tokens


def measure(cmd: list[str], log: str) -> tuple[float, float]:
    """Run `cmd`; return (wall seconds, peak RSS in GB) of that process. The writes of whatever ran before are
    flushed first (not timed): the kernel writing them back would slow this process's own writes and fsyncs."""
    os.sync()
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed; see {log}")
    return wall, usage.ru_maxrss / 2**20


def layer_flops(model: str, samples: int, seq_len: int) -> dict[str, float]:
    """FLOPs per decoder layer by phase, from the model's shapes (attention counted as causal)."""
    from elastic_oneshot.models.source import SourceModel
    from elastic_oneshot.quantization import gptq
    from elastic_oneshot.quantization.plan import input_groups

    source = SourceModel(model)
    c = source.config
    layer = source.layers[0]
    linears = [(n, m) for n, m in layer.named_modules() if isinstance(m, __import__("torch").nn.Linear)]
    tokens = samples * seq_len
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = 2 * samples * c.num_attention_heads * seq_len**2 * head_dim
    forward = sum(2 * m.in_features * m.out_features * tokens for _, m in linears) + attention
    modules = dict(linears)
    hessian, solve = 0, 0
    for group in input_groups([n for n, _ in linears], source.family.input_key(False)):
        d = modules[group[0]].in_features
        rows = sum(modules[n].out_features for n in group)
        block = gptq.HESSIAN_BLOCK  # the lower triangle by row blocks, as computed
        hessian += sum(2 * (min(r + block, d) - r) * min(r + block, d) * tokens for r in range(0, d, block))
        solve += 4 / 3 * d**3 + 2 * rows * d * d
    last = linears[-1][1]  # the calibration pass stops before the last module runs
    return {"calibrate": forward - 2 * last.in_features * last.out_features * tokens,
            "hessian": hessian, "gptq": solve, "propagate": forward}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="default: the embedded SmolLM2-135M")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--scheme", default="W4A16", help="a compressed-tensors preset (FP8, NVFP4, W8A8, ...)")
    p.add_argument("--group-size", type=int, default=64, help="W4A16 only; other presets keep their own")
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--workdir", default="bench-work")
    p.add_argument("--peer-child", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peer_child:
        return run_peer(*a.peer_child, a.samples, a.seq_len, a.group_size,
                        scheme=None if a.scheme == "W4A16" else a.scheme)

    from elastic_oneshot.durability.state import StateStore
    from elastic_oneshot.events import History
    from elastic_oneshot.models.default_model import default_model
    from elastic_oneshot.surface.evaluate import perplexity

    model = a.model or default_model()
    os.makedirs(a.workdir, exist_ok=True)
    ours, peer = os.path.join(a.workdir, "ours"), os.path.join(a.workdir, "peer")
    for d in (ours, peer, ours + ".state"):
        shutil.rmtree(d, ignore_errors=True)
    job = ["--num-samples", str(a.samples), "--seq-len", str(a.seq_len), "--scheme", a.scheme]
    job += ["--group-size", str(a.group_size)] if a.scheme == "W4A16" else []
    scheme = f"W4A16 group {a.group_size}" if a.scheme == "W4A16" else a.scheme
    print(f"model {model}\n{a.samples} samples x {a.seq_len} tokens, {scheme}, {os.cpu_count()} cores", flush=True)
    wall_o, rss_o = measure([sys.executable, "-m", "elastic_oneshot", "run", "--model", model, "--output", ours,
                             *job], ours + ".log")
    print(f"ours: {wall_o:.1f} s", flush=True)
    wall_p, rss_p = measure([sys.executable, __file__, "--peer-child", model, peer, "--samples", str(a.samples),
                             "--seq-len", str(a.seq_len), "--group-size", str(a.group_size), "--scheme", a.scheme],
                            peer + ".log")
    print(f"peer: {wall_p:.1f} s", flush=True)
    ppl = {name: perplexity(path, "builtin", a.eval_samples, a.seq_len)
           for name, path in (("base", model), ("ours", ours), ("peer", peer))}

    print(f"\n{'':24}{'ours':>10}{'peer':>10}{'ratio':>8}")
    print(f"{'wall time (s)':24}{wall_o:10.1f}{wall_p:10.1f}{wall_o / wall_p:8.3f}   target <= 0.7")
    print(f"{'peak RSS (GB)':24}{rss_o:10.2f}{rss_p:10.2f}{rss_o / rss_p:8.3f}   target <= 0.6")
    print(f"{'perplexity':24}{ppl['ours']:10.3f}{ppl['peer']:10.3f}{ppl['ours'] / ppl['peer']:8.4f}   "
          f"target <= 1.00 (unquantized {ppl['base']:.3f})")

    events = History(StateStore(ours + ".state").events()).commits
    seconds = {k: sum(e["seconds"].get(k, 0) for e in events) for k in
               ("load", "calibrate", "hessian", "gptq", "propagate", "commit")}
    flops = layer_flops(model, a.samples, a.seq_len)
    flops["propagate"] *= (len(events) - 1) / len(events)  # the last layer's output is not needed
    print(f"\nour phases over {len(events)} layers:")
    for phase, s in seconds.items():
        rate = f"{flops[phase] * len(events) / s / 1e9:8.1f} GFLOP/s" if phase in flops and s else ""
        print(f"  {phase:12}{s:8.1f} s {rate}")
    print(f"  committing: {seconds['commit'] / wall_o:.2%} of wall time (target <= 5%)")
    with open(os.path.join(a.workdir, "result.json"), "w") as f:
        json.dump({"scheme": scheme, "wall": [wall_o, wall_p], "rss_gb": [rss_o, rss_p], "ppl": ppl,
                   "seconds": seconds}, f)


if __name__ == "__main__":
    main()
