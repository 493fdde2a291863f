"""Durable progress: kill -9 at random moments, corrupted files, and bad input that must lose nothing."""

import glob
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from elastic_oneshot import oneshot
from elastic_oneshot.durability.coordinator import open_records
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.state import StateStore, default_root, read_events
from elastic_oneshot.durability.storage import LocalStorage
from elastic_oneshot.errors import CorruptStateError
from elastic_oneshot.loop import read_ahead
from elastic_oneshot.loop.inputs import LayerInputs
from elastic_oneshot.loop.runner import COMMITS_BEHIND, Runner
from elastic_oneshot.testing.runs import run_cli, start_cli, tree_digest
from elastic_oneshot.testing.tiny import make_model, set_architecture

JOB = dict(num_calibration_samples=48, max_seq_length=64, group_size=64, chunk_size=8)  # 6 chunks
CLI_JOB = ["--num-samples", 48, "--seq-len", 64, "--chunk-size", 8, "--group-size", 64]


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama8"), "llama", num_hidden_layers=8)


@pytest.fixture(scope="module")
def uninterrupted(deep_llama, tmp_path_factory):
    """An uninterrupted run: its output and its state (beside it)."""
    out = str(tmp_path_factory.mktemp("ref") / "out")
    oneshot(model=deep_llama, output_dir=out, **JOB)
    return out


@pytest.fixture(scope="module")
def reference(uninterrupted):
    """The bytes every interrupted or repaired run must reproduce."""
    return tree_digest(uninterrupted)


def finished_state(every: int):
    """A module's finished run with boundaries every `every` layers (0: none); each test takes a copy of its state
    (`state(tmp_path)`) to damage or cut short."""
    @pytest.fixture(scope="module")
    def made(deep_llama, tmp_path_factory):
        root = tmp_path_factory.mktemp(f"every{every}")
        oneshot(model=deep_llama, output_dir=str(root / "out"), state_dir=str(root / "state"), boundary_every=every,
                **JOB)

        def copy(tmp_path) -> str:
            return shutil.copytree(root / "state", tmp_path / "state")
        return copy
    return made


every_3 = finished_state(3)
every_0 = finished_state(0)


def glob_one(state, pattern: str) -> str:
    """The one file of the state matching `pattern` (its tag holds its epoch's nonce), relative to the state."""
    found = glob.glob(pattern, root_dir=state)
    assert len(found) == 1, (pattern, found)
    return found[0]


def committed(state) -> int:
    d = os.path.join(state, "commits")
    return len(os.listdir(d)) if os.path.isdir(d) else 0


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume(deep_llama, reference, tmp_path):
    rng = random.Random(1234)
    out, state = tmp_path / "out", tmp_path / "state"
    cmd = ["run", "--model", deep_llama, "--output", out, "--state", state, *CLI_JOB, "--boundary-every", 3]
    kills, progress = 0, []
    while kills < 4:
        log = open(tmp_path / f"run{kills}.log", "w")
        proc = start_cli(*cmd, stderr=log, stdout=log)
        while committed(state) <= (progress[-1] if progress else 0) and proc.poll() is None:
            time.sleep(0.02)  # let it get past start-up and do some work
        time.sleep(rng.uniform(0, 0.2))  # about one layer's time at 48 x 64 tokens
        if proc.poll() is not None:
            break  # finished before we could kill it
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        progress.append(committed(state))
    assert kills >= 3, f"the job finished before it could be killed enough ({kills} kills)"
    assert progress == sorted(progress), "progress went backwards"
    events = read_events(str(state))
    for epoch in {e["epoch"] for e in events if e["event"] == "layer"}:
        started = {e["layer"] for e in events if e["event"] == "layer" and e["epoch"] == epoch}
        done = {e["layer"] for e in events if e["event"] == "commit" and e["epoch"] == epoch}
        assert len(started - done) <= 1 + COMMITS_BEHIND, f"epoch {epoch} lost {sorted(started - done)}"
    final = run_cli("run", "--model", deep_llama, "--output", out, "--state", state, *CLI_JOB, "--boundary-every", 3)
    assert "resuming" in final.stderr
    print(f"\ncommitted layers after each of {kills} kills: {progress}")
    assert tree_digest(out) == reference


def damage(path: str, truncate: bool = False):
    with open(path, "r+b") as f:
        if truncate:
            f.truncate(100)
        else:  # flip bytes inside
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\xde\xad\xbe\xef")


@pytest.mark.slow
def test_damaged_files_are_redone_or_replayed_around(deep_llama, reference, every_3, tmp_path, caplog):
    out, state = str(tmp_path / "out"), every_3(tmp_path)
    assert sorted(os.listdir(os.path.join(state, "boundaries"))) == ["00003", "00006"]

    # A damaged boundary: the newest durable one below the layer to redo is replayed around.
    chunk = glob_one(state, "boundaries/00006/e00001.*/chunk-00002.safetensors")
    damage(os.path.join(state, chunk), truncate=True)
    os.remove(os.path.join(state, "commits/00007.e00001.json"))
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        oneshot(model=deep_llama, output_dir=out, state_dir=state, boundary_every=3, **JOB)
    text = caplog.text
    assert f"boundary 6: {chunk} has 100 bytes" in text
    assert text.count("boundary 6: ") == 1
    assert "replayed layers 3..6 for 6 chunks" in text
    assert re.findall(r"layer (\d+/\d+) committed", text) == ["8/8"]
    assert tree_digest(out) == reference

    # Damaged weights and a torn manifest: their layers are redone; no boundary is needed below layer 3. The torn
    # manifest is found at the restart; the flipped bytes, which keep the file's size, when the run reads
    # everything back at its end.
    weights = glob_one(state, "layers/00002/e00001.*.r0.b0001.safetensors")
    damage(os.path.join(state, weights))
    manifest = os.path.join(state, "commits/00005.e00001.json")
    with open(manifest, "r+b") as f:
        f.truncate(os.path.getsize(manifest) // 3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        oneshot(model=deep_llama, output_dir=out, state_dir=state, boundary_every=3, **JOB)
    text = caplog.text
    assert f"layer 2 will be redone: {weights} does not match its checksum" in text
    assert "layer 5 will be redone: commits/00005.e00001.json is not a readable record" in text
    assert re.findall(r"layer (\d+/\d+) committed", text) == ["6/8", "3/8"]
    assert "layer 2: 3 of 4 groups were solved before this restart; solving the other 1" in text
    assert "replayed layers 0..1 for 6 chunks" in text
    assert tree_digest(out) == reference


@pytest.mark.slow
@pytest.mark.parametrize("part", ["json", "safetensors"])
def test_a_record_damaged_before_its_commit_is_redone(part, deep_llama, reference, tmp_path, monkeypatch, caplog):
    """A solved-group record damaged between its write and the layer's commit (the chaos run once found commits
    naming only the intact records, and every restart then failed to replay the layer). The commit names every
    record as its writer returned it; a damaged file is found when the run reads everything back at its end, and
    its layer is redone; a damaged JSON record is never read again."""
    write_solved, state = CommitProtocol.write_solved, tmp_path / "state"

    def damaged_once(self, layer, tag, name, *args):
        record = write_solved(self, layer, tag, name, *args)
        if layer == 3 and tag.startswith("e00001.") and name == "r0.b0001":
            damage(os.path.join(state, f"layers/00003/{tag}.{name}.{part}"))
        return record

    monkeypatch.setattr(CommitProtocol, "write_solved", damaged_once)
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        oneshot(model=deep_llama, output_dir=str(tmp_path / "out"), state_dir=str(state), **JOB)
    redone = r"layer 3 will be redone: layers/00003/e00001\.\w+\.r0\.b0001\.safetensors does not match its checksum"
    assert bool(re.search(redone, caplog.text)) == (part == "safetensors")
    assert re.findall(r"layer (\d+/\d+) committed", caplog.text)[8:] == (["4/8"] if part == "safetensors" else [])
    assert tree_digest(str(tmp_path / "out")) == reference
    monkeypatch.undo()  # a resume replays every committed layer from its manifest alone
    shutil.rmtree(tmp_path / "out")
    os.remove(os.path.join(state, "commits/00007.e00001.json"))
    oneshot(model=deep_llama, output_dir=str(tmp_path / "out"), state_dir=str(state), **JOB)
    assert tree_digest(str(tmp_path / "out")) == reference


def test_commits_land_in_layer_order_while_the_next_layer_computes(deep_llama, reference, tmp_path, monkeypatch):
    """Commits are written behind: layer 3 computes while layer 2's files upload, and when layer 2's upload is
    the slowest of the run (it ends a second after layer 2's commit has begun, however long layer 3 took), layer
    3's commit still waits for layer 2's."""
    write_solved, commit, state = CommitProtocol.write_solved, Runner.commit, str(tmp_path / "state")
    committing = {layer: threading.Event() for layer in range(8)}

    def slow_layer_2(self, layer, *args):
        if layer == 2:
            assert committing[2].wait(120)
            time.sleep(1.0)
        return write_solved(self, layer, *args)

    def begun(self, c):
        committing[c.layer].set()
        return commit(self, c)

    monkeypatch.setattr(CommitProtocol, "write_solved", slow_layer_2)
    monkeypatch.setattr(Runner, "commit", begun)
    oneshot(model=deep_llama, output_dir=str(tmp_path / "out"), state_dir=state, **JOB)
    events = [e for e in read_events(state) if e["event"] in ("layer", "commit")]
    commits = [e["layer"] for e in events if e["event"] == "commit"]
    assert commits == list(range(8))
    order = [(e["event"], e["layer"]) for e in events]
    assert order.index(("layer", 3)) < order.index(("commit", 2)) < order.index(("commit", 3))
    waits = [e["seconds"]["commit"] for e in events if e["event"] == "commit"]  # a second per solved group of 2
    assert waits[2] > 1.0 and max(range(8), key=waits.__getitem__) == 2  # others wait for a disk, not for layer 2
    assert tree_digest(str(tmp_path / "out")) == reference


def test_layers_redone_apart_replay_through_the_one_committed_first(deep_llama, reference, every_0, tmp_path,
                                                                   caplog):
    """Layers 2 and 5 to redo in one epoch, no boundary: layer 5's inputs are replayed from the embeddings through
    layer 2, which must be committed first (found by the chaos run: it was still computed-but-not-committed)."""
    out, state = str(tmp_path / "out"), every_0(tmp_path)
    for layer in (2, 5):
        os.remove(os.path.join(state, f"commits/0000{layer}.e00001.json"))
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        oneshot(model=deep_llama, output_dir=out, state_dir=state, boundary_every=0, **JOB)
    assert re.findall(r"layer (\d+/\d+) committed", caplog.text) == ["3/8", "6/8"]
    assert "replayed layers 0..4 for 6 chunks" in caplog.text
    assert tree_digest(out) == reference


@pytest.mark.parametrize("max_memory, chunk_major", [(None, True), (1, False)])
def test_a_replay_takes_each_chunk_through_the_layers_as_it_arrives(deep_llama, reference, every_0, tmp_path,
                                                                    monkeypatch, max_memory, chunk_major):
    """A replay runs each chunk through every replayed layer that half the memory budget holds at once, as soon as
    the chunk is there (its compute hides behind a boundary's download); with no room for two, layer by layer. The
    same bits either way."""
    out, state = str(tmp_path / "out"), every_0(tmp_path)
    os.remove(os.path.join(state, "commits/00005.e00001.json"))
    calls, forward = [], LayerInputs.forward

    def recorded(self, module, layer, x):
        calls.append(layer)
        return forward(self, module, layer, x)

    monkeypatch.setattr(LayerInputs, "forward", recorded)
    oneshot(model=deep_llama, output_dir=out, state_dir=state, boundary_every=0, max_memory=max_memory, **JOB)
    replayed = [layer for layer in calls if layer < 5][1:]  # the first is the trial of layer 0
    assert replayed == (list(range(5)) * 6 if chunk_major else [layer for layer in range(5) for _ in range(6)])
    assert tree_digest(out) == reference


def test_a_restart_reads_its_boundary_ahead_while_the_epoch_is_set_up(deep_llama, reference, every_3, tmp_path,
                                                                      monkeypatch):
    """The boundary a restart replays from is read on the I/O thread from the epoch's start, before the first
    layer to redo begins, and the replay runs on what arrives: the same bits. That layer's solved work is read
    first (behind a boundary on a slow link, small reads wait seconds), and once."""
    out, state = str(tmp_path / "out"), every_3(tmp_path)
    os.remove(os.path.join(state, "commits/00007.e00001.json"))  # layer 7's solved records remain
    reads, read_bytes = [], StateStore.read_bytes

    def recorded(self, record):
        reads.append((record["path"], threading.current_thread() is threading.main_thread(), time.time()))
        return read_bytes(self, record)

    monkeypatch.setattr(StateStore, "read_bytes", recorded)
    oneshot(model=deep_llama, output_dir=out, state_dir=state, boundary_every=3, **JOB)
    chunks = [(main, at) for path, main, at in reads if path.startswith("boundaries/00006/")]
    began = [e["time"] for e in read_events(state) if e["event"] == "layer" and e["epoch"] == 2]
    assert len(chunks) == 6 and not any(main for main, _ in chunks)
    assert min(at for _, at in chunks) < began[0]
    committed = [e["time"] for e in read_events(state) if e["event"] == "commit" and e["epoch"] == 2]
    solved = [(path, at) for path, _, at in reads if path.startswith("layers/00007/e00001.") and at < committed[0]]
    assert solved and len(solved) == len({path for path, _ in solved})
    assert max(at for _, at in solved) < min(at for _, at in chunks)
    assert tree_digest(out) == reference


def test_a_restarted_process_reads_ahead_what_it_replays(deep_llama, reference, every_3, tmp_path, monkeypatch,
                                                         caplog):
    """From the records alone, before the job is set up, a restarting process guesses what it replays first (the
    weights of the layers after the boundary, then its own chunks of the boundary) and reads it ahead, while it
    imports: the run takes those bytes, each file read once, and gives the same bits. The run itself reads each
    commit once (on an object store, a restart read every commit several times over, one request at a time)."""
    out, state = str(tmp_path / "out"), every_3(tmp_path)
    os.remove(os.path.join(state, "commits/00007.e00001.json"))
    store = StateStore(state)
    records = open_records(store)
    protocol = CommitProtocol(store, records, records.committed())
    manifest, [(boundary, chunks), *_] = records.manifest(6, 1), protocol.durable(7)
    assert boundary == 6
    assert protocol.first_reads([3, 4, 5]) == manifest["weights"] + [chunks[str(c)] for c in (3, 4, 5)]  # rank 1 of 2
    reads, get = [], LocalStorage.get

    def recorded(self, rel, size=None):
        reads.append((rel, threading.current_thread().name))
        return get(self, rel, size)

    monkeypatch.setattr(LocalStorage, "get", recorded)
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        read_ahead.start(state).join()
        oneshot(model=deep_llama, output_dir=out, state_dir=state, boundary_every=3, **JOB)
    assert f"reading ahead {len(manifest['weights']) + 6} files" in caplog.text
    ahead = [r["path"] for r in manifest["weights"]] + [chunks[str(c)]["path"] for c in range(6)]
    assert sorted(rel for rel, thread in reads if thread == "read-ahead") == sorted(ahead)
    assert not [rel for rel, thread in reads if rel.startswith("boundaries/00006/") and thread != "read-ahead"]
    commits = [rel for rel, thread in reads if rel.startswith("commits/") and thread != "restart-reads"]
    assert len(commits) == len(set(commits)) == 7  # each commit read once, however often the run needs it; the one
    # this run writes (layer 7) not at all: the protocol keeps it as written
    assert tree_digest(out) == reference


def test_a_restart_reads_ahead_before_it_imports_torch():
    """The command line begins a restart's reads before it imports torch, which takes about a second of the link's
    time: the read-ahead's modules import none of torch, transformers or compressed-tensors."""
    code = ("import sys; from elastic_oneshot.loop import read_ahead; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'compressed_tensors'}))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_bytes_read_ahead_that_no_longer_match_are_read_again(tmp_path):
    """A file read ahead and changed since (a guess from an earlier run in the same process) is read again, not
    reported damaged; what was never used is dropped."""
    store = StateStore(str(tmp_path / "state"))
    store.storage.make_root()
    old, unused = store.write_bytes("a.bin", b"old bytes"), store.write_bytes("b.bin", b"unused")
    store.read_ahead([old, unused])
    time.sleep(0.2)
    new = store.write_bytes("a.bin", b"new bytes!")
    store.write_bytes("b.bin", b"changed")
    assert StateStore(store.root).read_bytes(new) == b"new bytes!"
    store.forget_read_ahead()
    with pytest.raises(CorruptStateError, match="b.bin"):  # read now, not taken from what was read ahead
        store.read_bytes(unused)


@pytest.mark.slow
def test_sigterm_commits_every_computed_layer_then_stops(deep_llama, reference, tmp_path):
    """A spot notice while a layer is computed but not committed: every rank learns it at the next commit, every
    layer computed is committed, and the job stops (exit 143) having lost no computed work; a rerun finishes."""
    out, state = tmp_path / "out", tmp_path / "state"
    cmd = ["run", "--model", deep_llama, "--output", out, "--state", state, *CLI_JOB]
    with open(tmp_path / "run.log", "w") as log:
        proc = start_cli(*cmd, stderr=log, stdout=log)
        while committed(state) < 2:
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.01)
        psutil.Process(proc.pid).suspend()  # so that the job cannot finish before the notice reaches it
        proc.send_signal(signal.SIGTERM)
        psutil.Process(proc.pid).resume()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM once layer" in (tmp_path / "run.log").read_text()
    events = read_events(str(state))
    started = {e["layer"] for e in events if e["event"] == "layer"}
    done = {e["layer"] for e in events if e["event"] == "commit"}
    assert started == done and len(done) < 8
    run_cli(*cmd)
    assert tree_digest(str(out)) == reference


@pytest.fixture(scope="module")
def committed_state(uninterrupted):
    """A state with committed layers, which no bad input may touch: the uninterrupted run's."""
    return default_root(uninterrupted)


def bad_inputs(tmp, deep_llama):
    gpt2 = str(tmp / "gpt2")
    shutil.copytree(deep_llama, gpt2)
    with open(os.path.join(gpt2, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "gpt2"
    with open(os.path.join(gpt2, "config.json"), "w") as f:
        json.dump(config, f)
    set_architecture(gpt2, "GPT2LMHeadModel")
    small = tmp / "small.txt"
    small.write_text("Just a few words of text.\n" * 20)
    return {
        "missing model": (["--model", tmp / "nope"], "does not exist"),
        "unsupported architecture": (["--model", gpt2], "is not supported"),
        "dataset too small": (["--model", deep_llama, "--dataset", small], "usable samples"),
        "group size": (["--model", deep_llama, "--group-size", 48],
                       "group size 48 does not divide the input dimension of 56 modules"),
        "foreign state": (["--model", deep_llama, "--seed", 7], "belongs to another job"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing model", "unsupported architecture", "dataset too small",
                                  "group size", "foreign state"])
def test_bad_input_one_line_error_and_nothing_lost(case, deep_llama, committed_state, tmp_path):
    args, message = bad_inputs(tmp_path, deep_llama)[case]
    before = tree_digest(committed_state)
    flags = CLI_JOB[:-2] if "--group-size" in args else CLI_JOB
    proc = run_cli("run", *args, "--state", committed_state, "--output", tmp_path / "out", *flags, check=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    print(f"\n{case}: {last}")
    assert last.startswith("elastic-oneshot: error: ") and message in last
    assert "Traceback" not in proc.stderr
    if case == "group size":
        assert "--ignore" in last and "--group-size" in last
    assert tree_digest(committed_state) == before
