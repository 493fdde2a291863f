"""Boundaries written behind the commits (boundaries.py): the policy, the accounting of durable ones, and
bits that do not depend on the machine's shape (thread count per rank, world size)."""

import json
import os
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from elastic_oneshot.durability.boundaries import DEFAULT_MTBF_S, Boundaries, auto_interval, mtbf_from, parse_every
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import UsageError
from elastic_oneshot.testing.runs import one_thread_env, run_cli, start_cli, torchrun_cmd, tree_digest
from elastic_oneshot.testing.tiny import make_model


def test_parse_every():
    assert parse_every("auto") is None and parse_every("0") == 0 and parse_every(3) == 3
    for bad in ("-1", "often", "1.5"):
        with pytest.raises(UsageError, match="--boundary-every"):
            parse_every(bad)


def test_auto_interval_is_young_daly_bounded_by_one_layer_of_replay_beyond_the_download():
    # sqrt(2 * 2 s * 3600 s) = 120 s = 12 layers of 10 s, but a replay of 11 layers of 3 s propagation
    # would cost 33 s, far more than the 2 s download it overlaps: at most 1 + 10 / 3 = 4.
    assert auto_interval(write_s=2, layer_s=10, propagate_s=3, mtbf_s=3600) == 4
    assert auto_interval(write_s=2, layer_s=10, propagate_s=0.1, mtbf_s=3600) == 12
    assert auto_interval(write_s=0.001, layer_s=10, propagate_s=3, mtbf_s=3600) == 1
    # A slow link: a 12 s download hides the replay of 10 layers of 1.2 s propagation, so 1 + 12 / 1.2 = 11,
    # where a replay bounded by one layer's compute (1 + 3 / 1.2 = 3) would take the write's 4 layers.
    assert auto_interval(write_s=12, layer_s=3, propagate_s=1.2, mtbf_s=3600) == 11
    assert auto_interval(write_s=50, layer_s=1, propagate_s=0.5, mtbf_s=3600) == 101  # 1 + 50 / 0.5
    assert auto_interval(write_s=50, layer_s=1, propagate_s=0.05, mtbf_s=3600) == 600  # Young and Daly's


def test_mtbf_from_the_jobs_own_restarts():
    assert mtbf_from([], now=100.0) == DEFAULT_MTBF_S
    events = [{"event": "start", "time": 0.0}, {"event": "commit", "time": 5.0}, {"event": "start", "time": 50.0}]
    assert mtbf_from(events, now=100.0) == 50.0  # two starts so far, this one is the third


def reports(*ranks):
    return [{"written": w, "busy": busy, "write_s": 1.0, "estimate_s": 1.0,
             "seconds": {"calibrate": 8.0, "propagate": 2.0}} for w, busy in ranks]


def test_a_boundary_is_durable_once_every_chunk_is_written(tmp_path):
    b = Boundaries(StateStore(str(tmp_path)), ThreadPoolExecutor(1), None, num_layers=30, num_chunks=3)
    rec = {"path": "x", "size": 1, "xxh3_128": "0"}
    assert b.settle(reports(({4: {"0": rec}}, False), ({}, True))) is None  # rank 1 still writing chunks 1, 2
    assert not b.due(5)  # a write in flight somewhere: skip, never queue
    assert b.settle(reports(({}, False), ({4: {"1": rec, "2": rec}}, False))) == {
        "layer": 4, "chunks": {"0": rec, "1": rec, "2": rec}}
    b.last = 4
    interval = auto_interval(1.0, 10.0, 2.0, DEFAULT_MTBF_S)
    assert [b.due(4 + k) for k in range(1, interval + 1)] == [False] * (interval - 1) + [True]
    assert b.prunable() == 0
    b.settle(reports(({9: {"0": rec, "1": rec, "2": rec}}, False), ({}, False)))
    assert b.durable == [4, 9] and b.prunable() == 4


def test_every_n_and_never(tmp_path):
    state, io = StateStore(str(tmp_path)), ThreadPoolExecutor(1)
    assert [n for n in range(1, 10) if Boundaries(state, io, 3, 10, 2).due(n)] == [3, 6, 9]
    assert not any(Boundaries(state, io, 0, 10, 2).due(n) for n in range(1, 10))
    assert not Boundaries(state, io, 1, 10, 2).due(10)  # no layer 10: nothing to write


def test_writes_one_in_flight_and_reports_it(tmp_path):
    """A write that finished while the next one waited is reported at the next commit, not dropped (at
    --boundary-every 1 no boundary ever became durable so)."""
    state, io, gate = StateStore(str(tmp_path)), ThreadPoolExecutor(1), threading.Event()
    b = Boundaries(state, io, 1, 10, 2)
    b.submit(1, 1, {0: torch.ones(2, 3), 1: torch.zeros(2, 3)})
    io.submit(gate.wait)  # the I/O thread busy: the next write stays in flight
    b.submit(2, 1, {0: torch.ones(2, 3), 1: torch.zeros(2, 3)})  # waits for the first
    assert b.settle([b.report({}, 0)])["layer"] == 1
    gate.set()
    io.submit(lambda: None).result()  # one I/O thread, in order: the second write has finished
    done = b.settle([b.report({}, 0)])
    assert done["layer"] == 2 and sorted(done["chunks"]) == ["0", "1"]
    assert torch.equal(state.read_tensors(done["chunks"]["1"])["hidden_states"], torch.zeros(2, 3))
    assert b.durable == [1, 2] and b.prunable() == 1


def test_auto_never_writes_closer_than_a_write_takes_nor_too_late_to_be_durable(tmp_path):
    b = Boundaries(StateStore(str(tmp_path)), ThreadPoolExecutor(1), None, 10, 1)
    b.settle([{"written": {}, "busy": False, "write_s": 5.0, "estimate_s": 1.0,
               "seconds": {"calibrate": 1.0, "propagate": 0.5}}])
    b.mtbf_s = 1.0  # Young and Daly alone would write every 2 layers
    # a write takes 5 s, a layer 1.5 s: at least 4 layers apart, and none once fewer than 4 layers remain
    assert [n for n in range(1, 10) if b.due(n)] == [4, 5, 6]


def test_auto_writes_no_boundary_only_to_measure_the_link(tmp_path):
    """Before any boundary write is measured, its cost is estimated from the rate at which this rank's commit
    files uploaded and the bytes of its inputs; nothing is due before a commit has reported either."""
    b = Boundaries(StateStore(str(tmp_path)), ThreadPoolExecutor(1), None, 40, 1)
    assert not any(b.due(n) for n in range(1, 40))  # no commit yet: the layers' times are not known
    seconds = {"calibrate": 1.0, "propagate": 0.5}
    b.settle([b.report(seconds, nbytes=10**6)])
    assert not any(b.due(n) for n in range(1, 40))  # nothing uploaded yet: the link's rate is not known
    b.uploaded(10**5, 0.5)
    b.uploaded(10**5, 0.5)  # 200 kB/s: a boundary of 1 MB takes 5 s, at least 4 layers of 1.5 s
    report = b.report(seconds, nbytes=10**6)
    assert report["estimate_s"] == 5.0 and report["write_s"] is None
    b.settle([report])
    assert [n for n in range(1, 40) if b.due(n)][:1] == [auto_interval(5.0, 1.5, 0.5, DEFAULT_MTBF_S)] == [11]
    b.settle([{**report, "write_s": 8.0}])  # a boundary write measured: its own time, not the estimate
    assert [n for n in range(1, 40) if b.due(n)][:1] == [auto_interval(8.0, 1.5, 0.5, DEFAULT_MTBF_S)] == [17]
    b.mtbf_s = 1.0  # Young and Daly alone would write every few layers
    b.settle([{**report, "write_s": 31.0}])  # 21 layers apart at least, but none durable in time from layer 20 on
    assert not any(b.due(n) for n in range(1, 40))


def test_a_write_in_flight_stops_when_the_job_is_done(tmp_path):
    state, io, gate = StateStore(str(tmp_path)), ThreadPoolExecutor(1), threading.Event()
    b = Boundaries(state, io, 1, 10, 2)
    io.submit(gate.wait)
    b.submit(1, 1, {0: torch.ones(2, 3), 1: torch.zeros(2, 3)})
    threading.Timer(0.2, gate.set).start()
    b.drain()  # before the write starts: it writes nothing
    assert b.settle([b.report({}, 0)]) is None and not (tmp_path / "boundaries").exists()


@pytest.fixture(scope="module")
def llama16(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama16"), "llama", num_hidden_layers=16)


def _commits(state) -> list[str]:
    return sorted(n for n in os.listdir(state / "commits") if re.fullmatch(r"\d{5}\.e\d{5}\.json", n))


def _durable(state) -> list[int]:
    """The boundaries the commits on disk name, oldest first."""
    named = []
    for name in _commits(state):
        with open(state / "commits" / name) as f:
            boundary = json.load(f)["body"]["boundary"]
        if boundary:
            named.append(boundary["layer"])
    return named


@pytest.mark.slow
@pytest.mark.parametrize("every", ["1", "2", "3", "auto"])
def test_killed_after_some_commits_replays_from_the_newest_durable_boundary(every, llama16, tmp_path):
    """Killed once 6 of 16 layers are committed: the restart replays from the newest boundary the commits
    made durable (a bounded replay, never from the embeddings), and only the newest durable ones are kept.
    `auto`, with a tiny --mtbf, writes one as often as writes do not queue: every layer where a write takes
    less than a layer, every few on a loaded machine (one CI run: none durable by the sixth commit), so it is
    killed once one is durable and its replay is not bounded by a fixed interval."""
    out, state = tmp_path / "out", tmp_path / "state"
    args = ["run", "--model", llama16, "--output", out, "--state", state, "--num-samples", 32, "--seq-len", 64,
            "--chunk-size", 4, "--group-size", 64, "--boundary-every", every, *(["--mtbf", 1e-6] * (every == "auto"))]
    proc = start_cli(*args, env=one_thread_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (state / "commits").is_dir() or len(_commits(state)) < 6 or (every == "auto" and not _durable(state)):
        assert proc.poll() is None, "finished before 6 commits" + " and a durable boundary" * (every == "auto")
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    committed, durable = len(_commits(state)), _durable(state)
    assert durable
    if every != "auto":
        assert durable[-1] >= committed - int(every) - 1  # one due, one in flight at most behind
    on_disk = sorted(int(d) for d in os.listdir(state / "boundaries"))
    kept = [b for b in on_disk if b <= durable[-1]]  # newer ones are written but not durable yet
    assert set(kept) <= set(durable[-3:]), (kept, durable)  # two kept, one more if killed before its pruning
    resumed = run_cli(*args, env=one_thread_env()).stderr
    start = durable[-1]
    replayed = re.findall(r"replayed layers \d+\.\.\d+", resumed)
    assert replayed == ([f"replayed layers {start}..{committed - 1}"] if start < committed else []), durable


JOB = ["--num-samples", 16, "--seq-len", 64, "--group-size", 64, "--chunk-size", 4, "--boundary-every", 1]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Hessians of 256 and 512 columns: LAPACK's Cholesky gives other bits at other thread counts there."""
    return make_model(str(tmp_path_factory.mktemp("models") / "wide"), "llama", hidden_size=256,
                      intermediate_size=512, num_hidden_layers=2)


@pytest.mark.slow
@pytest.mark.distributed
def test_same_bits_at_any_thread_count_and_world_size(wide, tmp_path):
    digests = {}
    for name, threads, world in (("W=1 x 2 threads", "2", 1), ("W=1 x 1 thread", "1", 1), ("W=2 x 1 thread", "1", 2)):
        out, env = tmp_path / name.replace(" ", ""), {**one_thread_env(), "OMP_NUM_THREADS": threads}
        args = ["run", "--model", wide, "--output", out, *JOB]
        if world == 1:
            run_cli(*args, env=env)
        else:
            proc = subprocess.run(torchrun_cmd(world, *args), capture_output=True, text=True, env=env)
            assert proc.returncode == 0, proc.stderr[-3000:]
        digests[name] = tree_digest(out)
    first = next(iter(digests.values()))
    assert all(d == first for d in digests.values()), {k: d["model.safetensors"][:12] for k, d in digests.items()}
