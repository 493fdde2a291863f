"""Elastic membership with real torchrun agents (one per simulated node) and a standalone c10d store:
node loss, node join, a frozen node, a stale worker, and a chaos run."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from elastic_oneshot.durability.records import FileRecords
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.testing.runs import assert_same_bits, one_thread_env, run_cli, tree_digest
from elastic_oneshot.testing.tiny import make_model
from launch.chaos import Cluster, late_writes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = ["--num-samples", 48, "--seq-len", 256, "--group-size", 64, "--chunk-size", 8]  # nodes join, die, freeze in it
# Where no node must arrive in time: the chaos run waits for progress after each fault, the stale worker for commits
SHORT_JOB = ["--num-samples", 48, "--seq-len", 128, "--group-size", 64, "--chunk-size", 8]
TIMEOUT = 10  # --collective-timeout: the bound on noticing a frozen peer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama12"), "llama", num_hidden_layers=12)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out"
    run_cli("run", "--model", model, "--output", out, *JOB, env=one_thread_env())
    return out


def worlds(cluster: Cluster) -> list[int]:
    return [e["world_size"] for e in cluster.events() if e["event"] == "start"]


def finish(cluster: Cluster, reference):
    assert cluster.wait_done(timeout=300), "the job did not finish"
    print(f"\nworld sizes {worlds(cluster)}")
    assert_same_bits(cluster.output, reference)


@pytest.mark.slow
def test_two_nodes_one_killed_finishes_at_one(model, reference, tmp_path, clusters):
    """The survivor restarts at W=1 and replays from the last durable boundary, also the chunks it never
    held; the result is the uninterrupted W=1 run's, byte for byte."""
    cluster = clusters(str(tmp_path), model, [*JOB, "--boundary-every", 3], max_nodes=2, collective_timeout=TIMEOUT)
    nodes = [cluster.add_node(), cluster.add_node()]
    cluster.wait_commits(4, world_size=2)
    victim = next(n for n in nodes if 0 not in n.workers())
    victim.signal_all(signal.SIGKILL)
    finish(cluster, reference)
    assert worlds(cluster)[-1] == 1
    survivor = next(n for n in nodes if n is not victim)
    with open(survivor.log.name) as f:
        replays = re.findall(r"replayed layers (\d+)\.\.(\d+) for (\d+) chunks", f.read())
    print(f"replays after the loss: {replays}")
    assert replays and int(replays[-1][0]) >= 3 and replays[-1][2] == "6"  # all 6 chunks, from a boundary
    assert tree_digest(cluster.output) == tree_digest(reference)


@pytest.mark.slow
def test_a_second_node_joins(model, reference, tmp_path, clusters):
    cluster = clusters(str(tmp_path), model, JOB, max_nodes=2, collective_timeout=TIMEOUT)
    cluster.add_node()
    assert cluster.wait_progress()
    cluster.add_node()
    finish(cluster, reference)
    assert worlds(cluster)[0] == 1 and 2 in worlds(cluster)


@pytest.mark.slow
def test_standalone_store_survives_losing_rank_0(model, reference, tmp_path, clusters):
    cluster = clusters(str(tmp_path), model, JOB, max_nodes=2, collective_timeout=TIMEOUT)
    cluster.add_node(), cluster.add_node()
    assert cluster.wait_progress()
    host = cluster.rank0()
    assert host is not None
    host.signal_all(signal.SIGKILL)  # the node whose agent hosted nothing: the store is standalone
    finish(cluster, reference)
    assert worlds(cluster)[-1] == 1


@pytest.mark.slow
def test_a_frozen_node_is_detected_and_left_behind(model, reference, tmp_path, clusters):
    cluster = clusters(str(tmp_path), model, JOB, max_nodes=2, collective_timeout=TIMEOUT)
    nodes = [cluster.add_node(), cluster.add_node()]
    assert cluster.wait_progress()
    frozen = nodes[1]
    frozen.signal_all(signal.SIGSTOP)
    frozen.stopped = True
    t = time.time()
    epoch = cluster.epoch()
    assert cluster.wait_progress(after_epoch=epoch, timeout=120)
    resumed = min(e["time"] for e in cluster.events() if e["event"] == "layer" and e["epoch"] > epoch)
    print(f"\nfrozen node left behind; work resumed {resumed - t:.1f} s after the freeze "
          f"(collective timeout {TIMEOUT} s)")
    assert resumed - t < TIMEOUT + 20
    finish(cluster, reference)  # at teardown, close() sends SIGCONT and SIGKILL to the frozen node
    assert worlds(cluster)[-1] == 1


@pytest.mark.slow
def test_a_stale_worker_cannot_commit(model, tmp_path):
    """A worker frozen mid-layer wakes after a newer epoch finished the job: its commit is refused and it
    changes nothing."""
    out, state = tmp_path / "out", tmp_path / "state"
    args = ["-m", "elastic_oneshot", "run", "--model", model, "--output", out, "--state", state, *SHORT_JOB]
    stale = subprocess.Popen([sys.executable, *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=one_thread_env())
    commits = state / "commits"
    while not (commits.is_dir() and len(os.listdir(commits)) >= 2):
        assert stale.poll() is None
        time.sleep(0.01)
    stale.send_signal(signal.SIGSTOP)
    run_cli(*args[2:], env=one_thread_env())  # a new epoch finishes the job
    before = tree_digest(state), tree_digest(out)
    stale.send_signal(signal.SIGCONT)
    output = stale.communicate(timeout=120)[0]
    print("\n" + [line for line in output.splitlines() if "fenced off" in line][0])
    assert stale.returncode == 3
    errors = [line for line in output.splitlines() if "elastic-oneshot: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("elastic-oneshot: error: fenced off: epoch 1 is stale (epoch 2 "
                                                     "has begun)"), errors
    after = tree_digest(state), tree_digest(out)
    # It may add unused files, and finish or drop its own temporary file if frozen in the middle of a write.
    own = f".tmp{stale.pid}"
    changed = [k for k, v in before[0].items()
               if k != "events.jsonl" and not k.endswith(own) and after[0].get(k) != v]
    assert not changed, f"the stale worker changed or deleted {changed}"
    assert after[1] == before[1]


def test_the_chaos_invariants_see_a_late_commit_and_a_late_write(tmp_path):
    """And an unreadable commit record, unless the harness corrupted it (after the job's last read of it)."""
    state = StateStore(tmp_path / "state")
    records = FileRecords(state)
    records.begin_epoch({})
    weights = state.write_tensors("layers/00000/e00001.r0.b0000.safetensors", {"w": torch.zeros(2)})
    records.commit(0, 1, {"weights": [weights]})
    records.begin_epoch({0: 1})
    assert late_writes(state, records, records.committed(), set()) == []
    later = time.time() + 5
    os.utime(state.root + "/layers/00000/e00001.r0.b0000.safetensors", (later, later))
    assert late_writes(state, records, records.committed(), set())[0].startswith(
        "layers/00000/e00001.r0.b0000.safetensors was written 5")
    os.utime(state.root + "/commits/00000.e00001.json", (later + 1, later + 1))
    assert late_writes(state, records, records.committed(), set())[0].startswith(
        "layer 0 was committed in epoch 1 6")
    with open(state.root + "/commits/00000.e00001.json", "w") as f:  # a record made unreadable
        f.write("{")
    os.utime(state.root + "/commits/00000.e00001.json", (1, 1))  # and not late
    assert late_writes(state, records, records.committed(), set()) == [
        "layer 0's commit record of epoch 1 is unreadable"]
    assert late_writes(state, records, records.committed(), {0}) == []  # the harness corrupted it


@pytest.mark.slow
@pytest.mark.distributed
def test_chaos_run_with_ten_faults(tmp_path):
    model = make_model(str(tmp_path / "llama64"), "llama", num_hidden_layers=64)  # enough work for ten faults
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "chaos.py"), "--model", model,
                           "--workdir", str(tmp_path / "chaos"), "--faults", "10", "--seed", "3",
                           "--collective-timeout", str(TIMEOUT), "--report", "--", *map(str, SHORT_JOB)],
                          capture_output=True, text=True, timeout=1200)
    print("\n" + proc.stdout[-2500:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "10 faults, invariants hold" in proc.stdout
    kinds = {line.split()[3] for line in proc.stdout.splitlines() if " fault " in line}
    assert len(kinds) >= 4, kinds
