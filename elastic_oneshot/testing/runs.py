"""Running jobs the way users do (a fresh interpreter, or torchrun) and comparing what they wrote: shared by the
tests and the chaos harness."""

import hashlib
import os
import subprocess
import sys

import psutil
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors.torch import load_file

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
