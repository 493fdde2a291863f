import hashlib
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny import make_model  # noqa: E402


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
