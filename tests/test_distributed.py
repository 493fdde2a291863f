"""Data-parallel calibration and weight-parallel GPTQ under real torchrun with gloo on CPU."""

import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.quantization import cholesky
from elastic_oneshot.quantization.plan import StepKind, layer_groups, make_plan
from elastic_oneshot.testing.runs import (
    JOB,
    assert_same_bits,
    one_thread_env,
    run_world,
    torchrun_cmd,
    tree_digest,
    workers,
)
from elastic_oneshot.testing.tiny import make_model


@pytest.fixture(scope="module")
def w1(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("w1") / "out"
    run_world(1, tiny_llama, out)
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_world_sizes_agree_with_one_rank(world, tiny_llama, w1, tmp_path):
    """The same bits at any world size (and so from run to run)."""
    out = tmp_path / "out"
    run_world(world, tiny_llama, out)
    assert_same_bits(out, w1)


WIDE = 2048  # cholesky.SHARED_INVERSE_COLS here: the product's 8192 made one job at 8704 columns take minutes


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("intermediate,kinds", [
    (WIDE + 512, {StepKind.PANEL, StepKind.UPDATE, StepKind.INVERT, StepKind.SOLVE}),
    (WIDE, {StepKind.FACTOR, StepKind.SOLVE})])
def test_shared_group_spreads_its_inverse_and_rows(intermediate, kinds, tmp_path, monkeypatch):
    """A dominant down_proj is shared: one rank factors it and ranks solve row slices; when it is wide
    (in_features above cholesky.SHARED_INVERSE_COLS, lowered to WIDE in every process) all ranks also share its
    Cholesky panels and inverse pieces. Either way the output matches one rank's."""
    monkeypatch.setattr(cholesky, "SHARED_INVERSE_COLS", WIDE)
    script = tmp_path / "wide.py"
    script.write_text(f"from elastic_oneshot.quantization import cholesky\n"
                      f"cholesky.SHARED_INVERSE_COLS = {WIDE}\nfrom elastic_oneshot.surface.cli import entry\n"
                      "entry()\n")
    model = make_model(str(tmp_path / "wide"), "llama", intermediate_size=intermediate, num_hidden_layers=1)
    source = SourceModel(model)
    steps = make_plan(layer_groups(source.layers[0], ["mlp.down_proj"], source.family.input_key(False)), 3).steps
    assert {s.kind for s in steps} == kinds
    assert all(len({s.rank for s in steps if s.kind == kind}) == 3 for kind in kinds - {StepKind.FACTOR})
    job = ["--num-samples", 12, "--seq-len", 64, "--group-size", 64, "--chunk-size", 4]
    run_world(1, model, tmp_path / "w1", job, program=[str(script)])
    run_world(3, model, tmp_path / "w3", job, program=[str(script)])
    assert_same_bits(tmp_path / "w3", tmp_path / "w1")


@pytest.mark.slow
@pytest.mark.distributed
def test_more_ranks_than_chunks(tiny_llama, tmp_path):
    job = ["--num-samples", 8, "--seq-len", 128, "--group-size", 64, "--chunk-size", 4]  # 2 chunks
    run_world(1, tiny_llama, tmp_path / "w1", job)
    run_world(3, tiny_llama, tmp_path / "w3", job)
    assert_same_bits(tmp_path / "w3", tmp_path / "w1")


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama8"), "llama", num_hidden_layers=8)


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_worker_restarts_and_output_is_identical(deep_llama, tmp_path):
    job = ["--num-samples", 48, "--seq-len", 128, "--group-size", 64, "--chunk-size", 8]
    run_world(2, deep_llama, tmp_path / "ref", job)
    out, state = tmp_path / "out", tmp_path / "state"
    cmd = torchrun_cmd(2, "run", "--model", deep_llama, "--output", out, "--state", state, *job, max_restarts=3)
    log = open(tmp_path / "run.log", "w")
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=one_thread_env())
    commits = state / "commits"
    while not (commits.is_dir() and len(os.listdir(commits)) >= 2):
        assert launcher.poll() is None, open(tmp_path / "run.log").read()[-3000:]
        time.sleep(0.05)
    time.sleep(random.Random(7).uniform(0, 0.4))  # mid-layer
    victim = workers(launcher)[1]
    victim.send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=180) == 0, open(tmp_path / "run.log").read()[-3000:]
    text = open(tmp_path / "run.log").read()
    assert "resuming" in text
    assert tree_digest(out) == tree_digest(tmp_path / "ref")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_with_different_arguments_fail_fast(tiny_llama, tmp_path):
    port = free_port()
    procs = []
    for node, seed in enumerate((0, 1)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mismatch",
               "--max-restarts=0", "-m", "elastic_oneshot", "run", "--model", tiny_llama, "--output",
               tmp_path / f"out{node}", "--seed", seed, *JOB]
        procs.append(subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=one_thread_env()))
    t = time.monotonic()
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    elapsed = time.monotonic() - t
    print(f"\nmismatched ranks stopped after {elapsed:.1f} s")
    assert all(p.returncode != 0 for p in procs)
    assert any("ranks disagree on the job" in o for o in outputs), outputs[0][-2000:]
    assert elapsed < 60
