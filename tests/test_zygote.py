"""The suite's CLI runs fork from a zygote (elastic_oneshot/testing/zygote.py): each must be what a fresh
`python -m elastic_oneshot` is, short of the imports: the same bits, exit status, lines, environment and directory."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from elastic_oneshot.testing import runs, zygote
from elastic_oneshot.testing.runs import JOB, one_thread_env, run_cli, start_cli, tree_digest


@pytest.mark.slow
def test_a_forked_run_is_a_fresh_interpreters(tiny_llama, tmp_path, monkeypatch):
    run_cli("run", "--model", tiny_llama, "--output", tmp_path / "first", *JOB, env=one_thread_env())  # a zygote
    monkeypatch.chdir(tmp_path)  # after the zygote started: relative paths resolve in the caller's directory
    args = ["run", "--model", tiny_llama, "--output", "fresh", *map(str, JOB)]
    fresh = subprocess.run([sys.executable, "-m", "elastic_oneshot", *args], env=one_thread_env(), capture_output=True,
                           text=True)
    forked = run_cli("run", "--model", tiny_llama, "--output", "forked", *JOB, env=one_thread_env())
    assert fresh.returncode == forked.returncode == 0
    assert tree_digest(tmp_path / "forked") == tree_digest(tmp_path / "fresh") == tree_digest(tmp_path / "first")
    assert forked.stderr.splitlines()[-1].endswith("wrote forked")
    assert fresh.stderr.splitlines()[-1].endswith("wrote fresh")

    other = {**os.environ, "UNREAD_BY_ANYONE": "1"}  # another environment: another zygote, started with it
    refused = run_cli("run", "--model", tiny_llama, "--output", "o", "--seq-len", 0, check=False, env=other)
    assert (refused.returncode, refused.stderr) == (2, "elastic-oneshot: error: --seq-len must be at least 2 tokens "
                                                       "(got 0)\n")
    assert psutil.Process(runs._ZYGOTES[zygote.key(other)].proc.pid).environ()["UNREAD_BY_ANYONE"] == "1"

    with open(tmp_path / "killed.log", "w") as log:
        proc = start_cli("run", "--model", tiny_llama, "--output", "killed", *JOB, env=one_thread_env(), stdout=log,
                         stderr=log)
    assert isinstance(proc, zygote.Child) and proc.poll() is None
    while not (tmp_path / "killed.state" / "commits").is_dir():
        time.sleep(0.01)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert run_cli("run", "--model", tiny_llama, "--output", "killed", *JOB, env=one_thread_env()).returncode == 0
    assert tree_digest(tmp_path / "killed") == tree_digest(tmp_path / "fresh")
