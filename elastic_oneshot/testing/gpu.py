"""Comparisons on a GPU (bench/gpu.py, tests/test_cuda.py): models of real shapes with random weights (no download),
calibration text that tokenizes to exact random token ids, and each side, ours or llmcompressor's `oneshot`, run in a
process of its own that reports its peak GPU memory and the GPU's name.

    python -m elastic_oneshot.testing.gpu ours REPORT.json run --model M ...   # the CLI, measured
    python -m elastic_oneshot.testing.gpu peer REPORT.json '{"model_dir": ...}' # peer.run_peer(**JSON), measured
    python -m elastic_oneshot.testing.gpu peer-recipe REPORT.json '{"recipe": "awq_w4a16_asym", "group": 128,
        "model_dir": ...}'                      # peer.run_recipe with testing/recipes.py's recipe, measured

Both sides use the GPU when torch sees one (CUDA_VISIBLE_DEVICES= hides it).
"""

import glob
import json
import os
import sys
import time

import torch

from elastic_oneshot.testing.peer import run_peer, run_recipe
from elastic_oneshot.testing.recipes import peer_recipe

# Decoder shapes of real models, cut to a few layers: (model_type, layers, config). `TINY` has the same kinds at
# sizes that run on CPU in seconds (every Linear's input a multiple of 128, for W4A16 groups of 128).
SHAPES = {
    "llama3-8b": ("llama", 8, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "qwen3-30b-a3b": ("qwen3_moe", 2, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
TINY = {
    "llama3-8b": ("llama", 2, dict(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("qwen3_moe", 2, dict(
        vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False)),
}
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2; every other id is the word "t<id>"


def word_tokenizer(vocab_size: int):
    """A tokenizer whose every id is a word (`t<id>`), split on spaces: text of such words tokenizes to exactly
    those ids, with no special token added."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {**{t: i for i, t in enumerate(SPECIAL)}, **{f"t{i}": i for i in range(len(SPECIAL), vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def random_token_text(path: str, vocab_size: int, samples: int, seq_len: int, seed: int = 0) -> str:
    """A .txt dataset of uniformly random token ids: one line per sample of `seq_len` tokens (the line's words and
    the EOS that joins documents), enough lines for the calibration pool of `samples` (loop/data.py: four times
    the samples, every tenth held out). Written once per (vocab, samples, seq_len, seed)."""
    from elastic_oneshot.loop.data import HOLDOUT_EVERY, POOL_FACTOR

    if os.path.isfile(path):
        return path
    lines = POOL_FACTOR * samples * HOLDOUT_EVERY // (HOLDOUT_EVERY - 1) + 2
    ids = torch.randint(len(SPECIAL), vocab_size, (lines, seq_len - 1), generator=torch.Generator().manual_seed(seed))
    with open(path + ".tmp", "w") as f:
        for row in ids.tolist():
            f.write(" ".join(f"t{i}" for i in row) + "\n")
    os.replace(path + ".tmp", path)
    return path


def make_shaped(path: str, name: str, tiny: bool = False, dtype=torch.bfloat16, device: str | None = None,
                layers: int | None = None) -> str:
    """Save a SHAPES (or TINY) model with random weights (the config's own initialization, seeded) and its word
    tokenizer to `path`; built on `device` (default: the GPU if there is one). Kept if already there."""
    import transformers

    model_type, default_layers, sizes = (TINY if tiny else SHAPES)[name]
    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")) or os.path.isfile(
            os.path.join(path, "model.safetensors")):
        return path
    tokenizer = word_tokenizer(sizes["vocab_size"])
    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=layers or default_layers,
                                               bos_token_id=1, eos_token_id=2, pad_token_id=2, **sizes)
    torch.manual_seed(0)
    with torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return path


def peer_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("llmcompressor", "datasets"))


def stored_codes(path: str) -> dict[str, torch.Tensor]:
    """Every quantized weight's stored codes in a checkpoint's shards, read here so that no compressed-tensors is
    needed to compare: int4 unpacked from `pack-quantized` int32 words (8 per word, element i at bit 4i), fp4
    nibbles, int8 and fp8 bytes (a sparse one's zeros among them)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors.update(load_file(f))
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight_packed") and t.dtype == torch.int32:
            rows, cols = tensors[key.replace("_packed", "_shape")].tolist()
            shifts = torch.arange(0, 32, 4, dtype=torch.int32)
            out[key] = ((t.unsqueeze(-1) >> shifts) & 15).reshape(rows, -1)[:, :cols].to(torch.uint8)
        elif key.endswith(".weight_packed") and t.dtype == torch.uint8:
            out[key] = torch.stack((t & 15, t >> 4), -1)
        elif key.endswith(".weight") and t.dtype in (torch.int8, torch.float8_e4m3fn):
            out[key] = t.view(torch.uint8)
    return out


def identical(a: dict, b: dict) -> float:
    """The share of codes equal in two checkpoints (which must quantize the same modules)."""
    if a.keys() != b.keys():
        raise AssertionError(f"different quantized modules: {sorted(a.keys() ^ b.keys())[:5]}")
    return sum((a[k] == b[k]).sum().item() for k in a) / sum(v.numel() for v in a.values())


def peak_sites(trace: list[dict], sites: int = 10) -> list[tuple[str, int]]:
    """Where a process's peak GPU memory was: the blocks live at the peak of an allocator trace (one device's events
    of `torch.cuda.memory._snapshot()`), summed by the innermost frame of ours or the peer's (else the innermost
    Python frame) that allocated them, largest first, with the peak itself first as ("peak", bytes)."""
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] == "free_completed" and live.pop(e["addr"], None) is not None:
            total -= e["size"]
    live = {}
    for e in trace[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_site: dict[str, int] = {}
    for e in live.values():
        frames = e.get("frames") or [{"filename": "?", "line": 0, "name": "?"}]
        ours = [f for f in frames if "elastic_oneshot" in f["filename"] or "llmcompressor" in f["filename"]]
        f = (ours or frames)[0]
        site = f"{f['filename'].rsplit('site-packages/', 1)[-1].rsplit('/main/', 1)[-1]}:{f['line']} {f['name']}"
        by_site[site] = by_site.get(site, 0) + e["size"]
    return [("peak", peak), *sorted(by_site.items(), key=lambda kv: -kv[1])[:sites]]


def _report(path: str, side: str, start: float, **more):
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    facts = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
             "peak_gpu_bytes": torch.cuda.max_memory_allocated() if gpu else 0,
             "reserved_gpu_bytes": torch.cuda.max_memory_reserved() if gpu else 0, "torch": torch.__version__, **more}
    with open(path, "w") as f:
        json.dump(facts, f)
    print(f"{side}: done in {time.perf_counter() - start:.1f} s (after importing torch), on {facts['device']}, "
          f"peak GPU memory {facts['peak_gpu_bytes'] / 2**30:.2f} GB (exit {more.get('exit')})", file=sys.stderr,
          flush=True)


def main(argv: list[str]) -> int:
    start = time.perf_counter()
    side, report, *rest = argv
    trace = torch.cuda.is_available() and os.environ.get("ELASTIC_ONESHOT_MEMORY_TRACE") == "1"
    if trace:  # python stacks only: C++ ones slow every allocation
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    if side == "ours":
        from elastic_oneshot.surface.cli import main as cli

        code = cli(rest)
    elif side == "peer":
        run_peer(**json.loads(rest[0]))
        code = 0
    elif side == "peer-recipe":
        job = json.loads(rest[0])
        recipe = peer_recipe(job.pop("recipe"), job.get("moe", False), job.pop("group"))
        run_recipe(**job, recipe=recipe)
        code = 0
    else:
        raise SystemExit(f"unknown side {side}: ours, peer or peer-recipe")
    sites = peak_sites(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]) if trace else []
    _report(report, side, start, exit=code, peak_sites=sites)  # bench/gpu.py prints them in its table
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
