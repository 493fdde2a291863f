"""Each recipe of issue 46's table, ours against llmcompressor 0.14's oneshot on the same model and tokens: wall time
and peak RSS of each side's process, from its start to its saved checkpoint, and their ratios.

    python bench/recipes.py                                   # every recipe, SmolLM2-135M, 128 x 512 tokens
    python bench/recipes.py --recipe awq_w4a16_asym --samples 16
    python bench/recipes.py --recipe fp8_dynamic --synthetic   # a 2.5 GB bf16 Llama: the data-free row's bytes
    python bench/recipes.py --recipe fp8_dynamic --synthetic 48   # three times the layers: the cost per layer

The recipes are elastic_oneshot/testing/recipes.py's (the parity tests'), with groups of 64 for the W4A16 ones
(SmolLM2's 576 columns); ours runs them from their YAML in one process, the peer from the same YAML's modifier
objects in its default pipeline (testing.peer.run_recipe), both in the checkpoint's dtype. Goal (issue 46): ours at
most 0.8 of the peer's wall, and QuantizationModifier without calibration data (fp8_dynamic) at most the time to read
and write the model, timed as a process that reads every tensor of the checkpoint and writes them all to a new file
("read + write"; "+ fsync": on the disk before it exits, as our checkpoint and commits are). Beside it, the
data-free recipe's arithmetic alone ("FP8 codes alone": its imports, and the codes of every decoder layer's weights,
nothing written), for where the floor cannot be met by I/O alone.
"""

import argparse
import json
import os
import shutil
import sys

from vs_llmcompressor import measure

from elastic_oneshot.testing.recipes import RECIPES, peer_recipe, recipe_yaml

GROUP = 64
DATA_FREE = ("fp8_dynamic",)


def copy_model(model: str, out: str, durable: bool = False):
    """Every tensor of the model's safetensors files read, then written to `out` (the data-free floor); `durable`:
    every file and `out` fsynced at the end, as our checkpoint is before the run exits (storage._fsync_tree, the
    export's own); without, the writes are still in the page cache when the copy exits."""
    from safetensors.torch import load_file, save_file

    from elastic_oneshot.durability.storage import _fsync_tree

    os.makedirs(out, exist_ok=True)
    for name in sorted(f for f in os.listdir(model) if f.endswith(".safetensors")):
        save_file(load_file(os.path.join(model, name)), os.path.join(out, name))
    if durable:
        _fsync_tree(out)


def codes_alone(model: str):
    """The data-free recipe's arithmetic alone: each decoder layer's Linear weights (its 2-D tensors) read and given
    FP8_DYNAMIC's qparams and codes by the code our run uses (rtn.compress), nothing written: with the imports it
    needs, what no design that computes the peer's codes on this machine can go below."""
    import time

    import psutil
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors import safe_open

    from elastic_oneshot.quantization import rtn

    started = psutil.Process().create_time()
    imported = time.time() - started  # this process's start and every import (this file's too)
    scheme, layers = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]), {}
    for name in sorted(f for f in os.listdir(model) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model, name), "pt") as f:
            for key in f.keys():
                if key.startswith("model.layers.") and len(f.get_slice(key).get_shape()) == 2:
                    layers.setdefault(int(key.split(".")[2]), {})[key] = name
    files = {name: safe_open(os.path.join(model, name), "pt") for names in layers.values() for name in names.values()}
    seconds = 0.0
    for layer in sorted(layers):
        weights = {key: files[name].get_tensor(key) for key, name in layers[layer].items()}
        t = time.perf_counter()
        rtn.compress(weights, dict.fromkeys(weights, scheme), ())
        seconds += time.perf_counter() - t
    print(f"start and imports {imported:.1f} s, codes {seconds:.1f} s over {len(layers)} layers, reads "
          f"{time.time() - started - imported - seconds:.1f} s")


def synthetic_llama(path: str, layers: int = 16) -> str:
    """A random bf16 Llama of `layers` layers of 2048 x 8192 (16: 1.2 G parameters, 2.5 GB) in two shards, built
    once at `path` with SmolLM2's tokenizer (the peer loads one even where it reads no data): large enough that
    reading and writing it outweighs the interpreter's imports. Two sizes tell each side's cost per layer apart from
    its fixed costs (imports, start): the cost that grows with the model."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers
    from safetensors.torch import save_file

    from elastic_oneshot.models.default_model import default_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model())
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                                      num_attention_heads=16, num_key_value_heads=8, vocab_size=len(tokenizer),
                                      tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.ones(s, dtype=torch.bfloat16) if k.endswith("norm.weight") else
               (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in sorted(shapes.items())}
    names = sorted(tensors)
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, f)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="default: the embedded SmolLM2-135M")
    p.add_argument("--synthetic", type=int, nargs="?", const=16, metavar="LAYERS",
                   help="the model: synthetic_llama's (of 16 layers unless given), built in the workdir")
    p.add_argument("--recipe", action="append", choices=list(RECIPES), help="repeatable; default: every recipe")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--workdir", default="bench-work/recipes")
    p.add_argument("--peer-child", nargs=3, metavar=("RECIPE", "MODEL", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--copy-child", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--durable", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--codes-child", metavar="MODEL", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peer_child:
        from elastic_oneshot.testing.peer import run_recipe

        name, model, out = a.peer_child
        return run_recipe(model, out, a.samples, a.seq_len, peer_recipe(name, group=GROUP), dtype="auto")
    if a.copy_child:
        return copy_model(*a.copy_child, durable=a.durable)
    if a.codes_child:
        return codes_alone(a.codes_child)

    from elastic_oneshot.models.default_model import default_model

    os.makedirs(a.workdir, exist_ok=True)
    model = synthetic_llama(os.path.join(a.workdir, f"synthetic-llama-{a.synthetic}"), a.synthetic) if a.synthetic \
        else a.model or default_model()
    names = a.recipe or list(RECIPES)
    print(f"model {model}\n{a.samples} samples x {a.seq_len} tokens, {os.cpu_count()} cores", flush=True)
    rows = {"read + write": measure([sys.executable, __file__, "--copy-child", model, _fresh(a.workdir, "copy")],
                                    os.path.join(a.workdir, "copy.log"))}
    if set(names) & set(DATA_FREE):  # what the data-free goal leaves for everything but the arithmetic
        rows["read + write + fsync"] = measure([sys.executable, __file__, "--copy-child", model,
                                                _fresh(a.workdir, "copy"), "--durable"],
                                               os.path.join(a.workdir, "copy.log"))
        log = os.path.join(a.workdir, "codes.log")
        rows["codes alone"] = measure([sys.executable, __file__, "--codes-child", model], log)
        with open(log) as f:
            rows["codes alone split"] = f.read().strip()
    for name in names:
        rows[name] = (*_ours(a, model, name), *_peer(a, model, name))
        print(f"{name}: ours {rows[name][0]:.1f} s, peer {rows[name][2]:.1f} s", flush=True)
    _table(rows, names)
    with open(os.path.join(a.workdir, "result.json"), "w") as f:
        json.dump({"samples": a.samples, "seq_len": a.seq_len, "rows": rows}, f)


def _fresh(workdir: str, name: str) -> str:
    path = os.path.join(workdir, name)
    for d in (path, path + ".state"):
        shutil.rmtree(d, ignore_errors=True)
    return path


def _ours(a, model: str, name: str) -> tuple[float, float]:
    out = _fresh(a.workdir, f"{name}-ours")
    with open(f"{out}.yaml", "w") as f:
        f.write(recipe_yaml(name, group=GROUP))
    return measure([sys.executable, "-m", "elastic_oneshot", "run", "--model", model, "--recipe", f"{out}.yaml",
                    "--num-samples", str(a.samples), "--seq-len", str(a.seq_len), "--output", out], f"{out}.log")


def _peer(a, model: str, name: str) -> tuple[float, float]:
    out = _fresh(a.workdir, f"{name}-peer")
    return measure([sys.executable, __file__, "--peer-child", name, model, out, "--samples", str(a.samples),
                    "--seq-len", str(a.seq_len)], f"{out}.log")


def _table(rows: dict, names: list[str]):
    copy_wall, copy_rss = rows["read + write"]
    print(f"\n{'recipe':20}{'ours s':>9}{'peer s':>9}{'ratio':>7}{'ours GB':>9}{'peer GB':>9}{'ratio':>7}")
    for name in names:
        wall_o, rss_o, wall_p, rss_p = rows[name]
        goal = f"   goal <= 0.8 of the peer's wall, <= read + write ({copy_wall:.1f} s): x{wall_o / copy_wall:.2f}, " \
            f"+ fsync ({rows['read + write + fsync'][0]:.1f} s): x{wall_o / rows['read + write + fsync'][0]:.2f}" \
            if name in DATA_FREE else "   goal <= 0.8"
        print(f"{name:20}{wall_o:9.1f}{wall_p:9.1f}{wall_o / wall_p:7.3f}{rss_o:9.2f}{rss_p:9.2f}{rss_o / rss_p:7.3f}"
              f"{goal}")
    print(f"{'read + write':20}{copy_wall:9.1f}{'':16}{copy_rss:9.2f}")
    if "read + write + fsync" in rows:
        wall, rss = rows["read + write + fsync"]
        print(f"{'read + write + fsync':20}{wall:9.1f}{'':16}{rss:9.2f}")
    if "codes alone" in rows:
        wall, rss = rows["codes alone"]
        print(f"{'FP8 codes alone':20}{wall:9.1f}{'':16}{rss:9.2f}   ({rows['codes alone split']}; no writes)")


if __name__ == "__main__":
    main()
