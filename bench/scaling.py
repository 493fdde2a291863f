"""Scaling: measured wall time at W=1 (2 threads) against W=2 (1 thread each), and the weight-parallel
plan's modeled GPTQ speed-up for large shapes, against llmcompressor's in_features bin packing.

    python bench/scaling.py                     # SmolLM2-135M, 64 x 512 tokens
    python bench/scaling.py --samples 16 --skip-run

The cost model (elastic_oneshot/plan.py) is checked first against measured GPTQ times on this CPU.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

import torch

from elastic_oneshot.quantization import gptq
from elastic_oneshot.quantization.plan import CostModel, Group, make_plan, peer_plan
from elastic_oneshot.quantization.recipe import Recipe


def check_cost_model(model: CostModel):
    """Measured single-thread GPTQ step times of a few (d, rows) against the model's prediction."""
    torch.set_num_threads(1)
    args = Recipe(group_size=64).weights
    errors = []
    print("cost model check (one thread):    d   rows   factor  invert   solve   total  modeled")
    for d, rows in ((576, 960), (576, 3072), (1024, 2048), (1536, 576), (2048, 768), (4096, 256), (9216, 128)):
        x = torch.randn(2 * d, d)
        h = x.t() @ x / (2 * d)
        w = torch.randn(rows, d) * 0.05
        t0 = time.perf_counter()
        factored = gptq.factor(h[None], "static")
        t1 = time.perf_counter()
        prep = gptq.invert(factored)
        t2 = time.perf_counter()
        gptq.solve(w[None], prep, args)
        t3 = time.perf_counter()
        modeled = model.whole(Group((("m", rows),), d))
        errors.append(abs(modeled - (t3 - t0)) / (t3 - t0))
        print(f"{'':33}{d:5d} {rows:6d} {t1 - t0:7.3f} {t2 - t1:7.3f} {t3 - t2:7.3f} {t3 - t0:7.3f} {modeled:7.3f} s")
    torch.set_num_threads(os.cpu_count())
    print(f"  mean absolute error of the model: {sum(errors) / len(errors):.1%}")


def llama3_8b() -> list[Group]:
    h, inter, kv = 4096, 14336, 8 * 128
    return [Group((("self_attn.q_proj", h), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)), h),
            Group((("self_attn.o_proj", h),), h),
            Group((("mlp.gate_proj", inter), ("mlp.up_proj", inter)), h),
            Group((("mlp.down_proj", h),), inter)]


def qwen3_30b_a3b() -> list[Group]:
    h, q, kv, expert = 2048, 32 * 128, 4 * 128, 768
    groups = [Group((("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)), h),
              Group((("self_attn.o_proj", h),), q)]
    for e in range(128):
        groups.append(Group(((f"mlp.experts.{e}.gate_proj", expert), (f"mlp.experts.{e}.up_proj", expert)), h))
        groups.append(Group(((f"mlp.experts.{e}.down_proj", h),), expert))
    return groups


def modeled(model: CostModel):
    print("\nmodeled GPTQ speed-up per layer (same cost model for both):")
    print(f"  {'shape':16}{'W':>3}  {'ours':>7} {'balance':>8}   {'peer packing':>12} {'balance':>8}")
    for name, groups in (("Llama-3-8B", llama3_8b()), ("Qwen3-30B-A3B", qwen3_30b_a3b())):
        serial = make_plan(groups, 1, model).makespan
        peer_serial = peer_plan(groups, 1, model).makespan
        for w in (2, 4, 8):
            ours, peer = make_plan(groups, w, model), peer_plan(groups, w, model)
            print(f"  {name:16}{w:3d}  {serial / ours.makespan:6.2f}x {ours.balance:8.3f}   "
                  f"{peer_serial / peer.makespan:11.2f}x {peer.balance:8.3f}")
        if name == "Llama-3-8B":
            down = groups[-1]
            print(f"  {'':16}     makespans simulate the steps' dependencies; down_proj's fp64 Cholesky "
                  f"({model.factor(down.cols):.0f} s of {serial:.0f} s on one rank) is spread by column panels")


def measured_run(samples: int, seq_len: int, workdir: str):
    from elastic_oneshot.models.default_model import default_model

    model = default_model()
    job = ["run", "--model", model, "--num-samples", str(samples), "--seq-len", str(seq_len), "--group-size", "64"]
    times = {}
    for world in (1, 2):
        out = os.path.join(workdir, f"w{world}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out + ".state", ignore_errors=True)
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "OMP_NUM_THREADS": str(os.cpu_count() // world)}
        cmd = ([sys.executable, "-m", "elastic_oneshot"] if world == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                "-m", "elastic_oneshot"]) + job + ["--output", out]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times[world] = time.perf_counter() - t
        print(f"  W={world} ({os.cpu_count() // world} threads each): {times[world]:.1f} s", flush=True)
    print(f"  wall-time ratio W=2 / W=1: {times[2] / times[1]:.3f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--workdir", default="bench-work")
    p.add_argument("--skip-run", action="store_true", help="only the cost model and the modeled plans")
    a = p.parse_args()
    model = CostModel()
    check_cost_model(model)
    modeled(model)
    if not a.skip_run:
        print(f"\nSmolLM2-135M, {a.samples} x {a.seq_len} tokens, W4A16 g64, {os.cpu_count()} cores:")
        measured_run(a.samples, a.seq_len, a.workdir)


if __name__ == "__main__":
    main()
