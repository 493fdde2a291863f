"""launch/wheelhouse.sh: an offline install. Its wheels install with --no-index into a fresh venv that holds only torch,
and elastic-oneshot then imports and runs there (slow: about 3 minutes, and it needs the package registry)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "wheelhouse.sh")
# pip with no configuration (no index, no find-links), and nothing of this checkout on the path
OFFLINE = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"} | {
    "PIP_CONFIG_FILE": os.devnull}


def test_wheelhouse_script_parses_and_explains_itself():
    subprocess.run(["bash", "-n", SCRIPT], check=True)
    usage = subprocess.run([SCRIPT, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--python" in usage and "--platform" in usage and "--peer" in usage and "--check" in usage


def test_a_wheelhouse_over_60_mib_is_refused(tmp_path):
    """The device tool carries the checkout and .wheelhouse within 64 MiB: a larger wheelhouse would fail the call
    there, after the machine's start; it is refused here (and removed), at the end of every build too."""
    for name, mib in (("big-1.0-py3-none-any.whl", 59), ("small-1.0-py3-none-any.whl", 2)):
        with open(tmp_path / name, "wb") as f:
            f.truncate(mib * 2**20)
    refused = subprocess.run([SCRIPT, "--check", "--dest", str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode != 0 and "over 60 MiB" in refused.stderr and "big-1.0" in refused.stderr
    assert not list(tmp_path.glob("*.whl"))
    with open(tmp_path / "small-1.0-py3-none-any.whl", "wb") as f:
        f.truncate(2 * 2**20)
    kept = subprocess.run([SCRIPT, "--check", "--dest", str(tmp_path)], capture_output=True, text=True)
    assert kept.returncode == 0 and "within 60 MiB" in kept.stderr


def registry_reachable(tmp_path) -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp_path),
                           "tenacity==9.2.1"], capture_output=True, timeout=120).returncode == 0


@pytest.mark.slow
def test_wheelhouse_installs_offline_into_a_venv_holding_only_torch(tmp_path):
    if not registry_reachable(tmp_path / "probe"):
        pytest.skip("the package registry is not reachable from here")
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # torch as the README installs it (here, this machine's configured wheel): the environment to complete
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", f"torch=={torch.__version__.split('+')[0]}"],
                   check=True)  # no bytecode for torch's thousands of modules: only its import is used
    wheels = tmp_path / "wheels"
    made = subprocess.run([SCRIPT, "--have", python, "--platform", "manylinux_2_28_x86_64", "--dest", str(wheels)],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-3000:]
    line = made.stdout.strip().splitlines()[-1]
    print("\n" + next(x for x in made.stderr.splitlines() if " MiB, in " in x) + "\n" + line)
    assert line.startswith("python3 -m pip install --no-index --find-links ")
    names = [w.split("-")[0].lower() for w in os.listdir(wheels) if w.endswith(".whl")]
    assert "torch" not in names and not any(n.startswith("nvidia_") for n in names)
    assert "etcd3" in names and "compressed_tensors" in names
    # the printed line, run by the venv's python, with no index, no configuration and no other wheels in reach
    subprocess.run([python, *line.split()[1:]], check=True, env=OFFLINE)
    subprocess.run([python, "-m", "pip", "check"], check=True, env=OFFLINE)
    modules = subprocess.run(
        [python, "-c", "import pkgutil, importlib, elastic_oneshot as e\n"  # testing/ needs the test extras
                       "names = [m.name for m in pkgutil.walk_packages(e.__path__, 'elastic_oneshot.')\n"
                       "         if not m.name.startswith(('elastic_oneshot.testing', 'elastic_oneshot.__main__'))]\n"
                       "[importlib.import_module(n) for n in names]; print(len(names), e.__file__)"],
        capture_output=True, text=True, cwd=tmp_path, env=OFFLINE)
    assert modules.returncode == 0, modules.stderr[-3000:]
    assert str(venv) in modules.stdout  # the installed copy, not this checkout
    usage = subprocess.run([str(venv / "bin" / "elastic-oneshot"), "--help"], capture_output=True, text=True,
                           cwd=tmp_path, env=OFFLINE)
    assert usage.returncode == 0 and "run" in usage.stdout, usage.stderr
