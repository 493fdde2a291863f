"""Peak host RSS and wall time per layer against depth: ours against llmcompressor 0.14's `oneshot` on a
Qwen3-30B-A3B-shaped model (hidden 2048, 128 experts, 8 routed, expert intermediate 768, the real vocabulary of
151936) with random bf16 weights, cut to 2, 4 and 8 layers, on the same random tokens (W4A16 group 128), on CPU.

    python bench/scale.py                      # depths 2,4,8; 8 samples x 128 tokens
    python bench/scale.py --no-peer            # ours only
    python bench/scale.py --peer-max-gb 18     # kill the peer when its RSS passes 18 GiB
    python bench/scale.py --depths 1,2 --experts 4 --hidden 128 --samples 2 --seq-len 16   # smoke test
    python bench/scale.py --shape deepseek-v3 --depths 1 --samples 2 --moe-calibrate routed   # one DeepSeek-V3
        # layer (26.7 GB on disk), its experts read a batch at a time (under `all`, held whole: refused on 24 GB)

Ours is one `python -m elastic_oneshot run` process, as bench/vs_llmcompressor.py launches it; the peer loads the
model in its checkpoint's dtype (bf16, as ours computes) and calibrates experts as ours does (--moe-calibrate).
Each side runs in its own process with OMP_NUM_THREADS=2; its RSS (the whole process tree, file-backed pages
included) is sampled every 50 ms, and its wall time runs from start to saved checkpoint. Either side is killed when
the machine's available memory falls below 1 GiB (there is no swap to fall back on, and other work shares the
machine), and the peer also above --peer-max-gb; a side that fails is reported with its exit status and the last
lines of its log, and the run goes on. The table is printed again as each depth finishes (wall per layer: the whole
run's wall time over its depth, imports and loading included), then ours' spread of peak RSS across depths (goal:
within 10 %), whether ours stays below the peer, and both sides' peak RSS and wall time fitted linearly in depth and
extrapolated to Qwen3-30B-A3B's 48 layers. --work/result.json holds every figure. `--shape deepseek-v3` does the
same on DeepSeek-V3's shape (hidden 7168, 256 experts of 2048, MLA attention; 61 layers), every layer with experts.

Models are written under --work, one safetensors file per layer (or per 2 GiB of it), each built alone from a
meta-device skeleton (the writer never holds more than one file's tensors); the depths share those files through
hard links, and a model directory is reused when its config matches. Outputs are deleted after each run, logs kept.
Expect about 75-80 s per layer per side on 2 cores: depths 2,4,8 take about 35 minutes, plus a few minutes to
write the models (10.4 GiB on disk); the smoke test, a minute or two.
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import torch

from elastic_oneshot.testing.gpu import SHAPES, random_token_text, word_tokenizer
from elastic_oneshot.testing.peer import run_peer  # llmcompressor on our tokens

GIB = 2**30
PART_BYTES = 2 * GIB  # the most of a layer one file holds
# --shape: (model type, sizes besides the config's defaults, the real model's depth, the config's name for the
# number of routed experts); DeepseekV3Config's defaults are DeepSeek-V3's shape, less its three dense first layers
MODELS = {"qwen3-30b-a3b": (*SHAPES["qwen3-30b-a3b"][::2], 48, "num_experts"),
          "deepseek-v3": ("deepseek_v3", dict(first_k_dense_replace=0, max_position_embeddings=4096,
                                              tie_word_embeddings=False), 61, "n_routed_experts")}
MIN_AVAILABLE = 1 * GIB  # below this much available memory, a side is killed
SAMPLE_EVERY = 0.05


def model_config(shape: str, depth: int, experts: int | None, hidden: int | None):
    """The `shape` (MODELS) at `depth` layers, in bf16, with fewer experts or a smaller hidden size if given."""
    import transformers

    model_type, sizes, _, experts_key = MODELS[shape]
    sizes = {**sizes, **({"hidden_size": hidden} if hidden else {})}
    if experts:
        sizes[experts_key] = experts
        sizes["num_experts_per_tok"] = min(sizes.get("num_experts_per_tok", 8), experts)
    return transformers.AutoConfig.for_model(model_type, num_hidden_layers=depth, dtype="bfloat16",
                                             bos_token_id=1, eos_token_id=2, pad_token_id=2, **sizes)


def save_random(path: str, shapes: dict, std: float, seed: int):
    """Write random bf16 tensors of `shapes` to one safetensors file, atomically: N(0, std) for matrices, ones for
    norms (as the config's initialization draws them); kept if already there."""
    from safetensors.torch import save_file

    if os.path.isfile(path):
        return
    print(f"  writing {path} ({sum(torch.Size(s).numel() for s in shapes.values()) * 2 / GIB:.2f} GiB)", flush=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else
               torch.empty(shape, dtype=torch.bfloat16).normal_(0, std, generator=g)
               for name, shape in shapes.items()}
    save_file(tensors, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)


def shard_shapes(skeleton) -> list[tuple[str, dict]]:
    """(file name, {stored tensor name: shape}) for the embeddings, norm and head, then one file per layer (per
    PART_BYTES of one, numbered, where a layer is larger), under the names a checkpoint stores (transformers' own
    conversion reverted: one tensor per expert and projection)."""
    from transformers.core_model_loading import revert_weight_conversion

    def stored(prefix: str, module) -> dict:
        meta = {prefix + k: v for k, v in module.state_dict().items()}
        return {k: tuple(v.shape) for k, v in revert_weight_conversion(skeleton, meta).items()}

    def parts(shapes: dict) -> list[dict]:
        out = [{}]
        for name, shape in shapes.items():
            if out[-1] and 2 * sum(torch.Size(s).numel() for s in [*out[-1].values(), shape]) > PART_BYTES:
                out.append({})
            out[-1][name] = shape
        return out

    outer = {k: tuple(v.shape) for k, v in skeleton.state_dict().items() if not k.startswith("model.layers.")}
    files = [("outer.safetensors", outer)]
    for i, layer in enumerate(skeleton.model.layers):
        split = parts(stored(f"model.layers.{i}.", layer))
        files += [(f"layer-{i:05d}" + (f"-{k}" if len(split) > 1 else "") + ".safetensors", shapes)
                  for k, shapes in enumerate(split)]
    return files


def make_model(work: str, shape: str, depth: int, experts: int | None, hidden: int | None) -> str:
    """The model directory of `depth` layers: its layer files come from a pool shared by every depth of one shape
    (hard links), so that the layers of depth 2 are those of depth 8. Reused when its config is the same."""
    import transformers

    config = model_config(shape, depth, experts, hidden)
    sizes = {k: v for k, v in config.to_dict().items() if k not in ("num_hidden_layers", "transformers_version")}
    tag = hashlib.sha256(json.dumps(sizes, sort_keys=True, default=str).encode()).hexdigest()[:8]
    path, pool = os.path.join(work, f"model-{tag}-{depth}L"), os.path.join(work, f"layers-{tag}")
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            if {**json.load(f), "transformers_version": None} == {**config.to_dict(), "transformers_version": None}:
                return path
    os.makedirs(pool, exist_ok=True)
    os.makedirs(path, exist_ok=True)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    weight_map = {}
    for seed, (name, shapes) in enumerate(shard_shapes(skeleton)):
        save_random(os.path.join(pool, name), shapes, config.initializer_range, seed)
        if not os.path.exists(os.path.join(path, name)):
            os.link(os.path.join(pool, name), os.path.join(path, name))
        weight_map.update(dict.fromkeys(shapes, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    config.save_pretrained(path)  # last: a directory with a config is complete
    return path


def tree_rss(proc: psutil.Process) -> int:
    """RSS of a process and all its descendants, in bytes."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def measured(cmd: list[str], log: str, env: dict, limit: float | None) -> dict:
    """Run `cmd`, sampling its process tree's RSS every 50 ms; kill the tree if it passes `limit` bytes or the
    machine runs short of memory. Returns wall seconds, sampled peak and the kernel's maxrss, exit code, reason."""
    t = time.perf_counter()
    reason, peak = None, 0
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    ps = psutil.Process(proc.pid)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            rss = tree_rss(ps)
        except psutil.NoSuchProcess:
            rss = 0
        peak = max(peak, rss)
        short = psutil.virtual_memory().available < MIN_AVAILABLE
        if reason is None and (short or (limit and rss > limit)):
            reason = (f"killed by this bench at {rss / GIB:.1f} GiB RSS: " +
                      (f"{psutil.virtual_memory().available / GIB:.2f} GiB left available" if short
                       else f"over --peer-max-gb {limit / GIB:g}"))
            for p in [*ps.children(recursive=True), ps]:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
        time.sleep(SAMPLE_EVERY)
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    if code and reason is None:
        reason = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        reason += " (the OOM killer?)" if code == -signal.SIGKILL else ""
    return {"wall": time.perf_counter() - t, "peak": peak, "maxrss": usage.ru_maxrss * 1024, "code": code,
            "reason": reason, "tail": tail(log) if code else []}


def tail(log: str, lines: int = 4) -> list[str]:
    """The last lines of a log, progress bars' carriage returns counted as line ends."""
    with open(log, errors="replace") as f:
        text = f.read()[-20000:]
    return [s.strip()[:160] for s in text.replace("\r", "\n").splitlines() if s.strip()][-lines:]


def run_depth(a, depth: int, data: str, env: dict) -> dict:
    """Both sides on the model of `depth` layers, one after the other; their outputs are deleted after."""
    model = make_model(a.work, a.shape, depth, a.experts, a.hidden)
    ours, peer = os.path.join(a.work, "ours"), os.path.join(a.work, "peer")
    row = {"depth": depth, "model": model}
    sides = {"ours": ([sys.executable, "-m", "elastic_oneshot", "run", "--model", model, "--dataset", data,
                       "--output", ours, "--num-samples", str(a.samples), "--seq-len", str(a.seq_len),
                       "--group-size", "128", "--moe-calibrate", a.moe_calibrate], None)}
    if not a.no_peer:
        job = dict(model_dir=model, out=peer, dataset=data, samples=a.samples, seq_len=a.seq_len, group_size=128,
                   moe=True, dtype="auto", all_experts=a.moe_calibrate == "all")
        sides["peer"] = ([sys.executable, __file__, "--peer-child", json.dumps(job)],
                         a.peer_max_gb * GIB if a.peer_max_gb else None)
    for side, (cmd, limit) in sides.items():
        for d in (ours, ours + ".state", peer):
            shutil.rmtree(d, ignore_errors=True)
        row[side] = r = measured(cmd, os.path.join(a.work, f"{side}-{depth}L.log"), env, limit)
        print(f"  {side}: {r['wall']:.1f} s, peak RSS {r['peak'] / GIB:.2f} GiB sampled ({r['maxrss'] / GIB:.2f} "
              f"GiB maxrss)" + (f"; FAILED: {r['reason']}" if r["code"] else ""), flush=True)
    for d in (ours, ours + ".state", peer):
        shutil.rmtree(d, ignore_errors=True)
    return row


def cells(r: dict | None, depth: int) -> str:
    if r is None:
        return f"{'-':>10}{'-':>10}"
    if r["code"]:
        return f"{'failed':>10}{'':>10}"
    return f"{r['peak'] / GIB:10.2f}{r['wall'] / depth:10.1f}"


def print_row(row: dict):
    """One depth's line of the table, and why a side failed."""
    d, ours, peer = row["depth"], row["ours"], row.get("peer")
    line = f"{d:6d}{cells(ours, d)}{cells(peer, d)}"
    if peer and not ours["code"] and not peer["code"]:
        line += f"{ours['peak'] / peer['peak']:10.3f}{ours['wall'] / peer['wall']:10.3f}"
    print(line, flush=True)
    for side in ("ours", "peer"):
        r = row.get(side)
        if r and r["code"]:
            print(f"{'':6}{side} stopped at {d} layers after {r['wall']:.0f} s, its RSS at {r['peak'] / GIB:.2f} "
                  f"GiB: {r['reason']}; its log ends:", flush=True)
            for s in r["tail"]:
                print(f"{'':10}{s}", flush=True)


def fit(points: list[tuple[int, float]], x: float) -> tuple[float, float] | None:
    """Least-squares line through (depth, value) points: (value at `x`, slope); None under two depths."""
    if len({d for d, _ in points}) < 2:
        return None
    n = len(points)
    md, mv = sum(d for d, _ in points) / n, sum(v for _, v in points) / n
    slope = sum((d - md) * (v - mv) for d, v in points) / sum((d - md) ** 2 for d, _ in points)
    return mv + slope * (x - md), slope


def summary(rows: list[dict], target: int):
    """Ours' spread of peak RSS across depths, ours against the peer, and both extrapolated to the real model's
    `target` layers."""
    done = {side: [(r["depth"], r[side]) for r in rows if side in r and not r[side]["code"]]
            for side in ("ours", "peer") if any(side in r for r in rows)}
    peaks = [r["peak"] for _, r in done["ours"]]
    if len(peaks) > 1:
        spread = max(peaks) / min(peaks) - 1
        print(f"\nours' peak RSS over depths {', '.join(str(d) for d, _ in done['ours'])}: {min(peaks) / GIB:.2f} to "
              f"{max(peaks) / GIB:.2f} GiB, spread {spread:.1%} (goal within 10 %): "
              f"{'met' if spread <= 0.1 else 'NOT met'}")
    pairs = [(r["depth"], r["ours"]["peak"], r["peer"]["peak"]) for r in rows
             if "peer" in r and not r["ours"]["code"] and not r["peer"]["code"]]
    if pairs:
        below = all(o < p for _, o, p in pairs)
        print(f"ours below the peer at every depth both finished ({', '.join(str(d) for d, _, _ in pairs)}): "
              f"{'yes' if below else 'NO'}")
    failed = [r["depth"] for r in rows if "peer" in r and r["peer"]["code"]]
    if failed:
        print(f"the peer did not finish at depth {', '.join(map(str, failed))} (see above)")
    print(f"\nextrapolated to {target} layers (least squares, linear in depth, over the depths that finished):")
    for side, runs in done.items():
        rss = fit([(d, r["peak"] / GIB) for d, r in runs], target)
        wall = fit([(d, r["wall"] / 3600) for d, r in runs], target)
        if rss is None:
            print(f"  {side}: needs two depths that finished")
            continue
        print(f"  {side}: peak RSS {rss[0]:6.2f} GiB ({rss[1]:+.3f} GiB per layer), wall {wall[0]:.2f} h "
              f"({wall[1] * 3600:.1f} s per layer)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depths", default="2,4,8", help="comma-separated layer counts")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--work", default="/tmp/scale", help="models, tokens, logs and result.json")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--peer-max-gb", type=float, help="kill the peer when its RSS passes this many GiB")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both sides")
    p.add_argument("--shape", choices=sorted(MODELS), default="qwen3-30b-a3b")
    p.add_argument("--moe-calibrate", choices=["all", "routed"], default="all",
                   help="both sides' expert calibration: every expert on every token, or on its routed tokens")
    p.add_argument("--experts", type=int, help="fewer routed experts than the shape's, for a smoke test")
    p.add_argument("--hidden", type=int, help="a smaller hidden size than the shape's, for a smoke test")
    p.add_argument("--peer-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peer_child:
        return run_peer(**json.loads(a.peer_child))
    os.makedirs(a.work, exist_ok=True)
    config = model_config(a.shape, 1, a.experts, a.hidden)
    vocab = config.vocab_size
    data = random_token_text(os.path.join(a.work, f"tokens-{vocab}-{a.samples}x{a.seq_len}.txt"), vocab,
                             a.samples, a.seq_len)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    experts = getattr(config, MODELS[a.shape][3])
    print(f"{a.shape} shape: hidden {config.hidden_size}, {experts} experts, vocab {vocab}, random bf16; "
          f"{a.samples} x {a.seq_len} random tokens, W4A16 group 128, {a.threads} threads, "
          f"{psutil.virtual_memory().total / GIB:.0f} GiB of memory", flush=True)
    rows = []
    for depth in (int(d) for d in a.depths.split(",")):
        print(f"\n== {depth} layers", flush=True)
        rows.append(run_depth(a, depth, data, env))
        with open(os.path.join(a.work, "result.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\n{'depth':>6}{'ours GiB':>10}{'s/layer':>10}{'peer GiB':>10}{'s/layer':>10}"
              f"{'RSS o/p':>10}{'wall o/p':>10}", flush=True)
        for row in rows:
            print_row(row)
    summary(rows, MODELS[a.shape][2])


if __name__ == "__main__":
    main()
