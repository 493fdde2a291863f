"""Our run of a recipe of issue 46's table (elastic_oneshot/testing/recipes.py) and the checks of an output against
the peer's: shared by test_recipe_parity.py and test_recipe_resume.py."""

import json
import os
import subprocess
import sys

import torch

from elastic_oneshot.durability.coordinator import open_records
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.testing.recipes import recipe_yaml
from elastic_oneshot.testing.runs import CLI, checkpoint_tensors, start_cli

# transformers 5.17 loads none of these formats for Qwen3-MoE's experts stored one by one (nor the peer's output: it
# fails to convert them, or leaves the experts missing): our run refuses them before any work, so their parity is
# checked on the layers committed by a run whose check before work is off (WITHOUT_EARLY_GUARD), refused at export
UNLOADABLE_MOE = ("smoothquant_w8a8", "nvfp4", "awq_w4a16_asym")
WITHOUT_EARLY_GUARD = ("-c", "from elastic_oneshot.surface import api, cli; "
                       "api.check_exportable = lambda *a, **k: None; cli.entry()")


def start_ours(model: str, out, name: str, samples: int, seq_len: int, moe: bool = False, group: int = 128,
               chunk: int | None = None, program=CLI):
    """Our CLI started in a process of its own (one thread; runs.start_cli) on the recipe, its samples in one chunk by
    default: within a chunk, Hessians are summed as the peer sums them. One thread each, so the peer's run can go on
    beside it. Its stdout and stderr go to OUT.stdout and OUT.stderr."""
    recipe = f"{out}.yaml"
    with open(recipe, "w") as f:
        f.write(recipe_yaml(name, moe, group))
    with open(f"{out}.stdout", "w") as stdout, open(f"{out}.stderr", "w") as stderr:
        proc = start_cli("run", "--model", model, "--recipe", recipe, "--num-samples", samples, "--seq-len", seq_len,
                         "--chunk-size", chunk or samples, "--output", out, program=program, stdout=stdout,
                         stderr=stderr, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc


def finished(proc, out) -> subprocess.CompletedProcess:
    """start_ours(..., out, ...) waited for, with what it printed."""
    code = proc.wait()
    stdout, stderr = (open(f"{out}.{stream}").read() for stream in ("stdout", "stderr"))
    return subprocess.CompletedProcess(proc.args, code, stdout, stderr)


def run_ours(model: str, out, *args, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """start_ours, waited for; `check`: a failure raises."""
    proc = finished(start_ours(model, out, *args, **kwargs), out)
    if check and proc.returncode:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def codes(tensors: dict) -> dict:
    """The stored codes of every quantized weight (int8 and fp8 as bytes, packed int4 words and fp4 as nibbles)."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight_packed"):
            t = t.view(torch.uint8) if t.dtype == torch.int32 else t
            out[key] = torch.stack((t & 15, t >> 4), -1)
        elif key.endswith(".weight") and t.dtype in (torch.int8, torch.float8_e4m3fn):
            out[key] = t.view(torch.uint8)
    return out


def checkpoint(path) -> dict:
    return checkpoint_tensors(path)


def committed(state_dir) -> dict:
    """Every tensor the last pass of the job in `state_dir` committed, by name (as the export would write them)."""
    state = StateStore(str(state_dir))
    records = open_records(state)
    protocol = CommitProtocol(state, records, records.committed())
    out = {}
    for layer in sorted(protocol.view):
        out.update(protocol.tensors(layer))
    return out


def same_layer0_codes(ours: dict, theirs: dict, prefix: str = "model.layers.0.") -> float:
    """The fraction of layer 0's stored codes that are the peer's (every quantized module of the layer)."""
    a, b = codes(ours), codes(theirs)
    keys = sorted(k for k in a if k.startswith(prefix))
    assert keys and keys == sorted(k for k in b if k.startswith(prefix)), (keys, sorted(b)[:6])
    assert all(a[k].shape == b[k].shape for k in keys)
    return sum((a[k] == b[k]).sum().item() for k in keys) / sum(a[k].numel() for k in keys)


def pruned(tensors: dict) -> dict:
    """Each pruned Linear's mask (the zeros of its weight, dense or FP8)."""
    return {k: t.float() == 0 for k, t in tensors.items() if k.endswith(".weight") and t.dim() == 2 and "proj" in k}


def config(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def flat(d: dict, prefix: str = "") -> dict:
    return {key: value for k, v in d.items()
            for key, value in (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(prefix + k, v)])}


def same_config(ours: str, peer: str):
    """config.json's keys equal, and the quantization_config equal value for value (ignore lists as sets)."""
    a, b = config(ours), config(peer)
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    qa, qb = a.get("quantization_config"), b.get("quantization_config")
    assert (qa is None) == (qb is None)
    if qa is not None:
        qa["ignore"], qb["ignore"] = sorted(qa.get("ignore") or []), sorted(qb.get("ignore") or [])
        fa, fb = flat(qa), flat(qb)
        diff = {k: (fa.get(k), fb.get(k)) for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}
        assert not diff, diff


LOAD = """
import sys, torch, transformers
from elastic_oneshot.quantization.schemes import load_dtype
path = sys.argv[1]
dtype = load_dtype(transformers.AutoConfig.from_pretrained(path).to_dict().get("quantization_config"))
model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                **({"dtype": dtype} if dtype else {}))
assert not info["missing_keys"] and not info["unexpected_keys"], info
ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(0))
out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
assert out.shape == (1, 12), out.shape
print("loaded and generated")
"""


def loads_and_generates(path):
    """As a user loads it: a fresh interpreter, transformers decompressing, nothing missing or unexpected, and it
    generates."""
    proc = subprocess.run([sys.executable, "-c", LOAD, str(path)], capture_output=True, text=True)
    assert proc.returncode == 0 and "loaded and generated" in proc.stdout, proc.stderr[-3000:]
