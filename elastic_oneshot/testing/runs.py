"""Running jobs the way users do (a fresh interpreter, or torchrun) and comparing what they wrote: shared by the
tests and the chaos harness."""

import hashlib
import os
import subprocess
import sys

import psutil
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors import safe_open
from safetensors.torch import load_file

TOLERANCE = 0.6  # relative L2 error of the logits, 4-bit weights in groups of 32 on random weights
JOB = ["--num-samples", 32, "--seq-len", 128, "--group-size", 64, "--chunk-size", 4]  # a quick job on tiny Llama


def run_cli(*args, check=True, **kwargs) -> subprocess.CompletedProcess:
    """`elastic-oneshot ARGS` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-m", "elastic_oneshot", *map(str, args)],
                          capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def torchrun_cmd(nproc: int, *args, max_restarts: int = 0, extra=()) -> list[str]:
    """A single-node torchrun of `elastic-oneshot ARGS` (python -m torch.distributed.run is torchrun)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2", *extra, "-m", "elastic_oneshot",
            *map(str, args)]


def one_thread_env() -> dict:
    """Results are bitwise reproducible at a fixed thread count per rank (BLAS reductions depend on it).
    Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE, torch 2.13's restarted workers can read the previous
    round's gloo addresses from the agent's reused store and fail to connect."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run_world(world: int, model, out, job=JOB, **kw):
    """The job at `world` ranks of one thread each (one process without torchrun at 1)."""
    args = ["run", "--model", model, "--output", out, *job]
    if world == 1:
        return run_cli(*args, env=one_thread_env())
    proc = subprocess.run(torchrun_cmd(world, *args, **kw), capture_output=True, text=True, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def workers(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """torchrun's workers under `launcher`, by rank."""
    found = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "elastic_oneshot" in " ".join(child.cmdline()):
            found[int(rank)] = child
    return found


def tree_digest(root) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def int_codes(path):
    """The W4 checkpoint's int codes by packed tensor name, and all its tensors."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return {k: unpack_from_int32(v, 4, tensors[k.replace("_packed", "_shape")])
            for k, v in tensors.items() if k.endswith("weight_packed")}, tensors


def same_codes(a, b) -> float:
    """The fraction of int codes two W4 checkpoints share."""
    ca, _ = int_codes(a)
    cb, _ = int_codes(b)
    assert ca.keys() == cb.keys()
    return sum((ca[k] == cb[k]).sum().item() for k in ca) / sum(v.numel() for v in ca.values())


def assert_same_bits(out, reference):
    """`out` is the checkpoint `reference`, byte for byte, as it is at any world size and thread count; if not, the
    AssertionError names the files that differ and, for W4 checkpoints, how many int codes they share."""
    a, b = tree_digest(out), tree_digest(reference)
    if a != b:
        differ = ", ".join(sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)))
        packed = "model.safetensors" in a.keys() & b.keys() and int_codes(out)[0]
        shared = f"; {same_codes(out, reference):.4%} of int codes identical" if packed else ""
        raise AssertionError(f"{out} is not {reference}, byte for byte: {differ} differ{shared}")


def packed_modules(checkpoint: str) -> set[str]:
    """The modules a compressed checkpoint holds packed (weight_packed), by its names."""
    with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
        return {k.removesuffix(".weight_packed") for k in f.keys() if k.endswith(".weight_packed")}


def check_compressed(model: str, out: str, auto_class=None) -> float:
    """The sweep's checks of a checkpoint compressed from `model` (tests/test_architectures.py): transformers loads
    it (as `auto_class`, a causal LM by default) with nothing missing or unexpected, and it generates. Returns the
    relative error of its logits against the original's, for the caller's tolerance."""
    auto_class = auto_class or transformers.AutoModelForCausalLM
    quantized, info = auto_class.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    original = auto_class.from_pretrained(model)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lo, lq = original(input_ids=ids).logits, quantized(input_ids=ids).logits
    assert quantized.generate(input_ids=ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)
    return (torch.linalg.norm(lq - lo) / torch.linalg.norm(lo)).item()
