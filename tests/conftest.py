import hashlib
import os
import subprocess
import sys

import pytest

from elastic_oneshot.testing.tiny import make_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama"), "llama")


def run_cli(*args, check=True, **kwargs) -> subprocess.CompletedProcess:
    """`elastic-oneshot ARGS` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-m", "elastic_oneshot", *map(str, args)],
                          capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def tree_digest(root) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


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


def packed_modules(checkpoint: str) -> set[str]:
    """The modules a compressed checkpoint holds packed (weight_packed), by its names."""
    from safetensors import safe_open

    with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
        return {k.removesuffix(".weight_packed") for k in f.keys() if k.endswith(".weight_packed")}


def check_compressed(model: str, out: str, auto_class=None) -> float:
    """The sweep's checks of a checkpoint compressed from `model` (tests/test_architectures.py): transformers loads
    it (as `auto_class`, a causal LM by default) with nothing missing or unexpected, and it generates. Returns the
    relative error of its logits against the original's, for the caller's tolerance."""
    import torch
    import transformers

    auto_class = auto_class or transformers.AutoModelForCausalLM
    quantized, info = auto_class.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    original = auto_class.from_pretrained(model)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lo, lq = original(input_ids=ids).logits, quantized(input_ids=ids).logits
    assert quantized.generate(input_ids=ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)
    return (torch.linalg.norm(lq - lo) / torch.linalg.norm(lo)).item()
