"""Qwen3-MoE: our run against llmcompressor's `oneshot` on the same tokens, and batched against
unbatched GPTQ over experts.

    python bench/moe.py                 # the tiny test model and an 8-layer, 64-expert random one
    python bench/moe.py --skip-peer     # only our side and the GPTQ batching figures

Each run is its own process, timed from start to saved checkpoint. The peer linearizes the experts
itself and calibrates every expert on every token (moe_calibrate_all_experts=True), as we do.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

import torch

from elastic_oneshot.testing.peer import run_peer  # llmcompressor on our tokens

SHAPES = {  # name: (layers, experts, hidden, expert intermediate)
    "tiny (2 layers, 8 experts)": (2, 8, 128, 64),
    "8 layers, 64 experts": (8, 64, 256, 128),
}


def make(path: str, layers: int, experts: int, hidden: int, inter: int) -> str:
    import transformers

    from elastic_oneshot.testing.tiny import make_tokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tokenizer = make_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=inter,
        num_experts=experts, num_experts_per_tok=8 if experts >= 64 else 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=1024,
        tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def timed(cmd: list[str], log: str) -> float:
    t = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    return time.perf_counter() - t


def gptq_batching(experts: int, hidden: int, inter: int, group: int):
    """One layer's expert GPTQ: the peer's way (every module alone) against ours (gate and up of all
    experts as one problem with one inverse; down projections batched)."""
    from elastic_oneshot.quantization import gptq
    from elastic_oneshot.quantization.recipe import Recipe

    args = Recipe(group_size=group).weights
    x = torch.randn(4096, hidden)
    h_in = 2 * x.t() @ x / 16
    y = torch.randn(4096, experts, inter).relu()
    h_down = torch.stack([2 * y[:, e].t() @ y[:, e] / 16 for e in range(experts)])
    w_up = torch.randn(2 * experts, inter, hidden) * 0.05
    w_down = torch.randn(experts, hidden, inter) * 0.05

    t = time.perf_counter()
    for w in w_up:
        gptq.quantize(w, h_in, args)
    for w, h in zip(w_down, h_down):
        gptq.quantize(w, h, args)
    alone = time.perf_counter() - t

    t = time.perf_counter()
    gptq.solve(w_up.reshape(1, -1, hidden), gptq.prepare(h_in[None], "static"), args)
    gptq.solve(w_down, gptq.prepare(h_down, "static"), args)
    together = time.perf_counter() - t
    return alone, together


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--workdir", default="bench-work/moe")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--peer-child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peer_child:
        return run_peer(*a.peer_child, a.samples, a.seq_len, a.group_size, moe=True)
    os.makedirs(a.workdir, exist_ok=True)
    print(f"{a.samples} samples x {a.seq_len} tokens, W4A16 group {a.group_size}, {os.cpu_count()} cores")
    for name, (layers, experts, hidden, inter) in SHAPES.items():
        model = make(os.path.join(a.workdir, f"model-{layers}x{experts}"), layers, experts, hidden, inter)
        ours, peer = os.path.join(a.workdir, "ours"), os.path.join(a.workdir, "peer")
        for d in (ours, ours + ".state", peer):
            shutil.rmtree(d, ignore_errors=True)
        job = ["--samples", str(a.samples), "--seq-len", str(a.seq_len), "--group-size", str(a.group_size)]
        t_ours = timed([sys.executable, "-m", "elastic_oneshot", "run", "--model", model, "--output", ours,
                        "--num-samples", str(a.samples), "--seq-len", str(a.seq_len),
                        "--group-size", str(a.group_size)], ours + ".log")
        line = f"{name:28} ours {t_ours:7.1f} s"
        if not a.skip_peer:
            t_peer = timed([sys.executable, __file__, "--peer-child", model, peer, *job], peer + ".log")
            line += f"   peer {t_peer:7.1f} s   ratio ours/peer {t_ours / t_peer:.3f} (target <= 0.3)"
        print(line, flush=True)
        alone, together = gptq_batching(experts, hidden, inter, a.group_size)
        print(f"{'':28} GPTQ of one layer's experts: one module at a time {alone:.2f} s, shared inverse + "
              f"batched {together:.2f} s: {alone / together:.1f}x", flush=True)


if __name__ == "__main__":
    main()
