"""What hostile testing found: a run may exit 0 only with the bits of an uninterrupted run of the model as it is,
else one line before any work. A model edited in place between a kill and the resume; a state whose path leads to
another job's mid-run, and another job's files in a state; a damaged boundary over a damaged layer; the export's
file modes; a skewed fleet plot; and the smaller ones (a dangling --state link, a frozen peer, the output's swap)."""

import contextlib
import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from elastic_oneshot import oneshot
from elastic_oneshot.durability import destination as destination_module
from elastic_oneshot.durability import storage as storage_module
from elastic_oneshot.durability.destination import open_destination
from elastic_oneshot.durability.state import read_events
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.surface import fleet
from elastic_oneshot.testing.runs import one_thread_env, run_cli, start_cli, torchrun_cmd, tree_digest, workers

JOB = dict(num_calibration_samples=16, max_seq_length=64, group_size=64, chunk_size=4)
CLI_JOB = ["--num-samples", 16, "--seq-len", 64, "--group-size", 64, "--chunk-size", 4]


def cli(model, out, state, *extra, check=False):
    return run_cli("run", "--model", model, "--output", out, "--state", state, *CLI_JOB, *extra, check=check,
                   env=one_thread_env())


def one_line(proc, code: int) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "elastic-oneshot: error:" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def scale_in_place(model: str, name: str, factor: float = 1.05):
    """Scale tensor `name` of the model's only shard, rewritten in place with the same header (names, dtypes,
    shapes, offsets): the job's fingerprint cannot see it."""
    path = os.path.join(model, "model.safetensors")
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    tensors[name] = tensors[name] * factor
    save_file(tensors, path, metadata=metadata)


def uncommit(state, *layers):
    """As after a kill once the layers before these were committed: their commits gone."""
    for layer in layers:
        for path in glob.glob(os.path.join(state, f"commits/{layer:05d}.e*.json")):
            os.remove(path)


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference") / "out")
    oneshot(model=tiny_llama, output_dir=out, **JOB)
    return tree_digest(out)


# -- 1: a model edited in place -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.input_layernorm.weight",
                                    "model.embed_tokens.weight"])
def test_a_model_edited_in_place_is_refused_or_redone_from_the_first_changed_layer(tiny_llama, tmp_path, tensor):
    """Layers 0..2 committed, then the model edited in place (its fingerprint unchanged). The resume is refused in
    one line before any work; with --model-changed redo it redoes from the first changed layer (the embeddings
    change every layer's inputs: layer 0) and gives the bits of an uninterrupted run of the edited model."""
    model, state, out = str(tmp_path / "model"), str(tmp_path / "state"), str(tmp_path / "out")
    shutil.copytree(tiny_llama, model)
    oneshot(model=model, output_dir=out, state_dir=state, **JOB)
    shutil.rmtree(out)
    uncommit(state, 3)
    digest = SourceModel(model).digest()
    scale_in_place(model, tensor)
    assert SourceModel(model).digest() == digest, "the edit must keep the header, or the fingerprint sees it"
    first = 0 if tensor.startswith("model.embed") else 1

    epochs = sorted(os.listdir(os.path.join(state, "epochs")))
    line = one_line(cli(model, out, state), 2)
    assert f"model {model} has changed since layer {first} was committed" in line
    assert "--model-changed redo" in line
    assert sorted(os.listdir(os.path.join(state, "epochs"))) == epochs, "no epoch may begin: no work"
    assert not os.path.exists(out)

    edited = str(tmp_path / "edited")  # the same edited model elsewhere, compressed uninterrupted
    shutil.copytree(model, edited)
    oneshot(model=edited, output_dir=str(tmp_path / "edited-out"), **JOB)
    proc = cli(model, out, state, "--model-changed", "redo", check=True)
    assert f"layers {first}..3 will be redone" in proc.stderr
    assert tree_digest(out) == tree_digest(str(tmp_path / "edited-out"))


@pytest.mark.slow
def test_the_export_refuses_a_model_changed_since_its_layers_were_committed(tiny_llama, tmp_path):
    model, state = str(tmp_path / "model"), str(tmp_path / "state")
    shutil.copytree(tiny_llama, model)
    oneshot(model=model, output_dir=str(tmp_path / "out"), state_dir=state, **JOB)
    scale_in_place(model, "model.layers.2.mlp.down_proj.weight")
    proc = run_cli("export", "--state", state, "--output", tmp_path / "again", check=False)
    line = one_line(proc, 2)
    assert f"model {model} has changed since layer 2 was committed" in line
    assert not os.path.exists(tmp_path / "again") and not os.path.exists(tmp_path / "again.partial")


@pytest.mark.slow
def test_untouched_files_are_not_read_again_and_a_touched_one_is_hashed_once(tiny_llama, reference, tmp_path,
                                                                            caplog):
    """What the check costs: nothing read while the shards' stats are those the commits recorded; a shard whose
    stat changed (here its times, the bytes the same) has its committed layers read and hashed, and passes."""
    model, state, out = str(tmp_path / "model"), str(tmp_path / "state"), str(tmp_path / "out")
    shutil.copytree(tiny_llama, model)
    oneshot(model=model, output_dir=out, state_dir=state, **JOB)
    for attempt in ("untouched", "touched"):
        shutil.rmtree(out)
        uncommit(state, 3)
        if attempt == "touched":
            os.utime(os.path.join(model, "model.safetensors"))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
            began = time.perf_counter()
            oneshot(model=model, output_dir=out, state_dir=state, **JOB)
        hashed = [r.message for r in caplog.records if "checked against the model's files" in r.message]
        assert hashed == ([] if attempt == "untouched" else
                          [m for m in hashed if "3 committed layers checked against the model's files (3 read" in m])
        assert len(hashed) == (attempt == "touched")
        print(f"\n{attempt}: resume in {time.perf_counter() - began:.1f} s; {hashed}")
        assert tree_digest(out) == reference


# -- 2: another job's state, reached through a path that changed mid-run -----------------------------------------
@pytest.mark.slow
def test_a_state_link_repointed_mid_run_changes_nothing_of_either_job(tiny_llama, reference, tmp_path):
    """Job X runs through `link` -> X's state; mid-run the link is re-pointed at job Y's finished state. X finishes
    where it began, with its uninterrupted bits; Y's state is untouched, and Y's export gives its own bits."""
    other = str(tmp_path / "other")  # job Y: another model (the same shapes)
    shutil.copytree(tiny_llama, other)
    scale_in_place(other, "model.layers.1.mlp.up_proj.weight", 1.5)
    y_state, y_out = str(tmp_path / "y.state"), str(tmp_path / "y.out")
    oneshot(model=other, output_dir=y_out, state_dir=y_state, **JOB)
    y_files, y_bits = tree_digest(y_state), tree_digest(y_out)

    link, x_state, x_out = tmp_path / "link", tmp_path / "x.state", tmp_path / "x.out"
    x_state.mkdir()
    link.symlink_to(x_state)
    log = open(tmp_path / "x.log", "w")
    proc = start_cli("run", "--model", tiny_llama, "--output", x_out, "--state", link, *CLI_JOB, stdout=log, stderr=log,
                     env=one_thread_env())
    try:
        while not glob.glob(str(x_state / "commits/00001.*")) and proc.poll() is None:
            time.sleep(0.05)
        link.unlink()
        link.symlink_to(y_state)
        assert proc.wait(timeout=300) == 0, (tmp_path / "x.log").read_text()[-3000:]
    finally:
        proc.kill()
    assert tree_digest(str(x_out)) == reference
    assert tree_digest(y_state) == y_files
    shutil.rmtree(y_out)
    run_cli("export", "--state", y_state, "--output", y_out)
    assert tree_digest(y_out) == y_bits


@pytest.mark.slow
def test_another_jobs_solved_groups_in_a_state_are_never_taken(tiny_llama, reference, tmp_path, caplog):
    """Another job's solved-group files of layer 2 (the same model, other calibration samples: the same content, so
    only their tags tell them apart) put into this job's state, as they are and renamed under this job's own epoch
    tag; this job's own records of layer 2 gone. The rerun of layer 2 solves its groups itself: its bits."""
    y_state = str(tmp_path / "y.state")
    oneshot(model=tiny_llama, output_dir=str(tmp_path / "y.out"), state_dir=y_state, seed=1, **JOB)
    state, out = str(tmp_path / "state"), str(tmp_path / "out")
    oneshot(model=tiny_llama, output_dir=out, state_dir=state, **JOB)
    folder = os.path.join(state, "layers/00002")
    mine, foreign = sorted(os.listdir(folder)), sorted(os.listdir(os.path.join(y_state, "layers/00002")))
    assert not set(mine) & set(foreign), "two jobs' epochs must name their files apart"
    tag = next(n for n in mine if n.startswith("e00001."))[:19]
    for name in mine:
        os.remove(os.path.join(folder, name))
    for name in foreign:
        shutil.copy(os.path.join(y_state, "layers/00002", name), os.path.join(folder, name))
        if not name.startswith("fence."):
            shutil.copy(os.path.join(y_state, "layers/00002", name), os.path.join(folder, f"{tag}.{name[20:]}"))
    uncommit(state, 2, 3)
    shutil.rmtree(out)
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        oneshot(model=tiny_llama, output_dir=out, state_dir=state, **JOB)
    assert "layer 2: " not in caplog.text  # as "layer 2: 4 of 4 groups were solved before this restart"
    assert tree_digest(out) == reference


def test_a_commit_is_refused_once_the_states_path_leads_to_another_fence(tmp_path):
    """The fence an epoch began is checked at each commit: a state whose path now leads to another copy (here the
    fence replaced, as a re-pointed mount would show it) cannot take the commit."""
    from elastic_oneshot.durability.records import FileRecords
    from elastic_oneshot.durability.state import StateStore
    from elastic_oneshot.errors import StaleEpochError

    state = StateStore(str(tmp_path / "s"))
    records = FileRecords(state)
    epoch = records.begin_epoch({})
    records.commit(0, epoch, {"layer": 0})
    fence = os.path.join(state.root, "epochs/00001.json")
    body = json.loads(open(fence).read())["body"]
    os.remove(fence)
    StateStore(state.root).write_json("epochs/00001.json", {**body, "nonce": "f" * 32})
    with pytest.raises(StaleEpochError, match="is not the one this process began"):
        records.commit(1, epoch, {"layer": 1})


# -- 3: double faults ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_damaged_boundary_over_a_damaged_layer_is_redone_not_stuck(tmp_path_factory, tmp_path):
    """The newest durable boundary (6) and a committed layer below it (4) both damaged, their sizes kept: the
    replay falls back to boundary 3, finds layer 4 damaged, and layer 4 is redone from boundary 3; exit 0 with the
    uninterrupted bits."""
    from elastic_oneshot.testing.tiny import make_model

    model = make_model(str(tmp_path_factory.mktemp("models") / "llama8"), "llama", num_hidden_layers=8)
    ref = str(tmp_path / "ref")
    oneshot(model=model, output_dir=ref, **JOB)
    state, out = str(tmp_path / "state"), str(tmp_path / "out")
    oneshot(model=model, output_dir=out, state_dir=state, boundary_every=3, **JOB)
    shutil.rmtree(out)
    uncommit(state, 7)
    for path in glob.glob(os.path.join(state, "boundaries/00006/*/chunk-*.safetensors")) + \
            glob.glob(os.path.join(state, "layers/00004/*.safetensors")):
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\xde\xad\xbe\xef")
    proc = cli(model, out, state, "--boundary-every", 3, check=True)
    assert "layer 4 will be redone" in proc.stderr
    assert tree_digest(out) == tree_digest(ref)
    redone = [e["layer"] for e in read_events(state) if e["event"] == "commit" and e["epoch"] > 2]
    assert redone == [4, 7]


# -- 4: the export's file modes -------------------------------------------------------------------------------------
def test_every_exported_file_has_the_mode_the_umask_gives(tiny_llama, tmp_path):
    out = tmp_path / "out"
    oneshot(model=tiny_llama, output_dir=str(out), **JOB)
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


# -- 5: a skewed fleet plot -----------------------------------------------------------------------------------------
def test_a_plot_of_a_skewed_wall_is_drawn(tmp_path):
    """An expected wall above p90 (a long tail) is drawn, not an error bar with a negative length."""
    pytest.importorskip("matplotlib")
    row = {"nodes": 1, "finishes": True, "expected_s": 9000.0, "p10_s": 3000.0, "p50_s": 3500.0, "p90_s": 6000.0,
           "cost": 10.0, "from_scratch": {"finishes": False}}
    r = {"rows": [row, {**row, "nodes": 2, "expected_s": 2000.0, "p10_s": 2500.0}], "on_demand": {"wall_s": 3600.0,
         "cost": 12.0}, "model": "qwen3_moe", "fleet": {"accelerator": "H100"}}
    fleet.draw(r, str(tmp_path / "x.png"))
    assert (tmp_path / "x.png").stat().st_size > 1000


# -- 6: the smaller ones --------------------------------------------------------------------------------------------
def test_a_dangling_state_link_is_named_as_one(tiny_llama, tmp_path):
    link = tmp_path / "state"
    link.symlink_to(tmp_path / "gone" / "state")
    line = one_line(cli(tiny_llama, tmp_path / "out", link), 2)
    assert f"--state {link} is a symbolic link to {tmp_path / 'gone' / 'state'}, which does not exist" in line
    assert not (tmp_path / "gone").exists()


def test_a_kill_while_the_output_is_swapped_leaves_the_output_in_place(tiny_llama, tmp_path, monkeypatch):
    """A previous checkpoint of the job is swapped with the new one in one step: killed at any moment of the swap,
    OUT is there (here, killed at the first rename after the swap began)."""
    out = tmp_path / "out"
    oneshot(model=tiny_llama, output_dir=str(out), **JOB)
    before = tree_digest(str(out))
    built = tmp_path / "out.partial"
    shutil.copytree(out, built)
    (built / "extra.txt").write_text("new")
    marker = json.loads((built / "elastic-oneshot.json").read_text())
    (built / "elastic-oneshot.json").write_text(json.dumps({**marker, "files": marker["files"] + ["extra.txt"]}))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(os, "replace", killed)
    monkeypatch.setattr(destination_module.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        open_destination(str(out)).publish(str(built), marker["fingerprint"])
    monkeypatch.undo()
    assert (out / "extra.txt").read_text() == "new"
    assert tree_digest(str(built)) == before  # the previous one, removed by the next export


def _traced(script: str, log: str, *args: str) -> list[str]:
    """`script` in a process of its own under strace: its fsyncs, renames, links and unlinks that succeeded, in
    order, with the paths of their file descriptors."""
    subprocess.run(["strace", "-f", "-y", "-qq", "-o", log, "-e",
                    "trace=fsync,rename,renameat,renameat2,link,linkat,unlinkat", sys.executable, "-c", script, *args],
                   check=True, env=one_thread_env())
    with open(log) as f:
        return [line.split(None, 1)[1] for line in f if line.rstrip().endswith("= 0")]  # (each after its pid)


def _synced(call: str) -> str | None:
    """The path an fsync call names, if it is one."""
    return call.split("<", 1)[1].split(">", 1)[0] if call.startswith("fsync(") else None


def test_the_output_is_on_the_disk_before_it_is_in_place_and_in_place_before_the_previous_one_goes(tiny_llama,
                                                                                                   tmp_path):
    """A crash after the swap must not find empty or short files under OUT (the page cache not written back), nor
    OUT gone with the previous checkpoint removed: every file built is fsynced, then the swap, then OUT's folder
    fsynced, then the previous one removed. Read from the system calls, the first export and then one replacing it."""
    root = os.path.realpath(tmp_path)
    out, built = os.path.join(root, "out"), os.path.join(root, "out.partial")
    oneshot(model=tiny_llama, output_dir=out, **JOB)
    fingerprint = json.loads(open(os.path.join(out, "elastic-oneshot.json")).read())["fingerprint"]
    for replacing in (False, True):
        if replacing:
            shutil.copytree(out, built)
        else:
            os.rename(out, built)
        files = [os.path.join(folder, name) for folder, _, names in os.walk(built) for name in names]
        calls = _traced("import sys\nfrom elastic_oneshot.durability.destination import open_destination\n"
                        "open_destination(sys.argv[1]).publish(sys.argv[2], sys.argv[3])",
                        str(tmp_path / f"strace-{replacing}.log"), out, built, fingerprint)
        swap = next(i for i, c in enumerate(calls) if c.startswith(("rename", "renameat")) and f'"{built}"' in c)
        synced = {_synced(c) for c in calls[:swap]}
        assert set(files) | {built} <= synced, sorted(set(files) | {built} - synced)
        parent = next((i for i, c in enumerate(calls) if _synced(c) == root), None)
        removed = next((i for i, c in enumerate(calls) if "unlinkat(" in c), len(calls))
        assert parent is not None and swap < parent < removed, calls[swap:]
        assert ("RENAME_EXCHANGE" in calls[swap]) == replacing  # the second is swapped with the first,
        assert (removed < len(calls)) == replacing  # which is removed, last
        assert os.path.exists(os.path.join(out, "elastic-oneshot.json")) and not os.path.exists(built)


def test_a_directory_that_cannot_be_fsynced_is_let_be_and_a_file_is_not():
    """procfs answers fsync with EINVAL, as some network and FUSE filesystems answer it for a directory: the
    export must not fail there after the whole run for want of what the filesystem does not offer; a file whose
    data cannot be made durable still fails."""
    storage_module._fsync("/proc")
    with pytest.raises(OSError, match="Invalid argument"):
        storage_module._fsync("/proc/self/status")


def test_a_file_url_puts_each_object_on_the_disk_with_its_name(tmp_path):
    """obstore's local store (--state or --output file:///PATH) renames or links an object into place and fsyncs
    nothing: each put and upload here fsyncs the object, then its name in every folder up to the root, before it
    returns (a crash could otherwise leave a commit or a shard named but short)."""
    root = os.path.join(os.path.realpath(tmp_path), "store")
    source = tmp_path / "shard.bin"
    source.write_bytes(os.urandom(3 << 20))
    calls = _traced("import sys\nfrom elastic_oneshot.durability.storage import ObjectStorage\n"
                    "store = ObjectStorage(sys.argv[1])\nstore.put('a/b/commit.json', b'{}', exclusive=True)\n"
                    "store.put('a/event.json', b'{}')\nstore.upload('c/shard.bin', sys.argv[2])",
                    str(tmp_path / "strace.log"), f"file://{root}", str(source))
    for rel in ("a/b/commit.json", "a/event.json", "c/shard.bin"):
        path = os.path.join(root, rel)
        placed = next(i for i, c in enumerate(calls) if not c.startswith("fsync(") and f'"{path}"' in c)
        names, folder = [path], path
        while folder != root:
            folder = os.path.dirname(folder)
            names.append(folder)
        assert set(names) <= {_synced(c) for c in calls[placed:]}, (rel, calls[placed:])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_frozen_peer_is_named_by_the_liveness_line_and_recorded(tiny_llama, tmp_path):
    """SIGSTOP on rank 1: rank 0 leaves with the liveness line docs/troubleshooting.md promises, and the event."""
    state = tmp_path / "state"
    cmd = torchrun_cmd(2, "run", "--model", tiny_llama, "--output", tmp_path / "out", "--state", state, *CLI_JOB,
                       "--collective-timeout", 6)
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=one_thread_env(), start_new_session=True)
    stopped = None
    try:
        while not glob.glob(str(state / "commits/00000.*")) and proc.poll() is None:
            time.sleep(0.05)
        ranks = workers(proc)
        stopped = ranks[1]
        stopped.send_signal(signal.SIGSTOP)
        ranks[0].wait(timeout=120)  # rank 0 left; the agent's SIGTERM would wait 30 s on the stopped rank
        stopped.kill()
        proc.wait(timeout=120)
    finally:
        with contextlib.suppress(psutil.Error):
            if stopped is not None:
                stopped.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "run.log").read_text()
    assert "elastic-oneshot: error: liveness: rank 1 silent for" in text, text[-3000:]
    assert [e for e in read_events(str(state)) if e["event"] == "liveness" and e["rank"] == 0]


def test_the_frozen_peer_line_needs_a_timeout_and_a_silent_rank():
    """A killed peer (connection reset) is 'lost'; a timed-out collective with no silent rank is 'lost' too."""
    from elastic_oneshot.distributed import world

    reset = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv "
                           "operation to complete")
    assert world.lost_line(reset).startswith("another rank was lost")
    assert world.lost_line(timeout).startswith("another rank was lost")
    assert world.lost_line(ValueError("x")) is None
