"""Failures a user meets end in one line and a documented exit code, never a traceback, and waste nothing: a full
or read-only disk, a --state that is a file, a damaged model file, a lost peer, interrupted writes, lost tokens,
two processes claiming one state; and docs/troubleshooting.md lists every message the code can give."""

import ast
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from elastic_oneshot.distributed.world import rank_lost
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import UsageError
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.testing.runs import one_thread_env, run_cli, torchrun_cmd, tree_digest, workers
from elastic_oneshot.testing.tiny import make_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
JOB = ["--num-samples", 16, "--seq-len", 64, "--group-size", 64, "--chunk-size", 4]


def one_error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The exit code is `code`, stderr has no traceback and one error line, on a line of its own (not after the
    progress bar's last drawing, which ends in a carriage return)."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.split("\n") if "elastic-oneshot: error:" in line]
    assert len(lines) == 1 and lines[0].startswith("elastic-oneshot: error: "), proc.stderr[-3000:]
    return lines[0]


def run(model, tmp, *extra, name="out", check=True):
    return run_cli("run", "--model", model, "--output", tmp / name, "--state", tmp / f"{name}.state", *JOB, *extra,
                   check=check, env=one_thread_env())


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    run(tiny_llama, tmp)
    return tree_digest(tmp / "out")


def _mount_tmpfs(where: pathlib.Path, size: str) -> bool:
    where.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_full_tmpfs_under_the_state_resumes_byte_identical(tiny_llama, reference, tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "300k"):
        pytest.skip("mounting a tmpfs is not allowed here (test_a_refused_write_... uses a write hook)")
    try:
        args = ["run", "--model", tiny_llama, "--output", tmp_path / "out", "--state", disk / "state", *JOB]
        line = one_error_line(run_cli(*args, check=False, env=one_thread_env()), 4)
        assert "No space left on device (ENOSPC)" in line and str(disk / "state") in line
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        run_cli(*args, env=one_thread_env())
        assert tree_digest(tmp_path / "out") == reference
    finally:
        subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.slow
@pytest.mark.parametrize("code, words", [("ENOSPC", "No space left on device (ENOSPC)"),
                                         ("EROFS", "Read-only file system (EROFS)")])
def test_a_refused_write_is_one_line_and_the_rerun_is_byte_identical(tiny_llama, reference, tmp_path, code, words):
    args = ["run", "--model", tiny_llama, "--output", tmp_path / "out", "--state", tmp_path / "state", *JOB]
    proc = subprocess.run([sys.executable, ROOT / "tests" / "failing_disk.py", code, "30", *map(str, args)],
                          capture_output=True, text=True, env=one_thread_env())
    line = one_error_line(proc, 4)
    assert words in line and f"cannot write {tmp_path / 'state'}" in line
    assert os.listdir(tmp_path / "state" / "commits"), "the hook should refuse a write after the first commit"
    run_cli(*args, env=one_thread_env())
    assert tree_digest(tmp_path / "out") == reference


@pytest.mark.slow
def test_state_that_is_a_file_is_one_line(tiny_llama, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    one_error_line(run_cli("run", "--model", tiny_llama, "--state", tmp_path / "file", "--output", tmp_path / "out",
                           *JOB, check=False), 2)
    line = one_error_line(run_cli("status", "--state", tmp_path / "file", check=False), 2)
    assert "is a file" in line


def test_a_model_file_damaged_after_the_start_is_named(tiny_llama, tmp_path):
    model = tmp_path / "model"
    make_model(str(model), "llama")
    source = SourceModel(str(model))
    names = [n for n in source.weight_map if n.startswith("model.layers.3.")]
    shard = source.weight_map[names[0]]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(UsageError, match=f"model file {re.escape(shard)} is truncated or damaged"):
        source.read(names)


@pytest.mark.slow
def test_interrupted_writes_leave_no_debris(tiny_llama, reference, tmp_path):
    state, gone = tmp_path / "out.state", subprocess.Popen(["true"])
    gone.wait()  # the pid of a writer that was killed
    state.mkdir()
    (state / f"job.json.tmp{gone.pid}").write_bytes(b"{")  # a first claim, killed while writing job.json
    run(tiny_llama, tmp_path)
    debris = [state / "commits" / f"00002.e00001.json.tmp{gone.pid}",
              state / "layers" / "00001" / f"e00001.r0.b0000.json.tmp{gone.pid}"]
    alive = state / "layers" / "00001" / f"e00001.r0.b0001.json.tmp{os.getpid()}"  # a frozen writer's, say
    alive.write_bytes(b"torn")
    for path in debris:
        path.write_bytes(b"torn")
    (state / "notes.tmp").write_text("not ours")
    run(tiny_llama, tmp_path)
    assert not any(p.exists() for p in debris) and (state / "notes.tmp").exists() and alive.exists()
    assert tree_digest(tmp_path / "out") == reference


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_lost_tokens_are_drawn_again_and_committed_layers_kept(tiny_llama, reference, tmp_path, damage):
    run(tiny_llama, tmp_path)
    tokens = tmp_path / "out.state" / "tokens.safetensors"
    original = tokens.read_bytes()
    if damage == "delete":
        tokens.unlink()
    else:
        tokens.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    run(tiny_llama, tmp_path)
    assert tokens.read_bytes() == original
    starts = [e for e in StateStore(str(tmp_path / "out.state")).events() if e["event"] == "start"]
    assert starts[-1]["committed"] == 4  # nothing redone
    assert tree_digest(tmp_path / "out") == reference


@pytest.mark.slow
def test_tokens_that_the_dataset_no_longer_yields_are_refused(tiny_llama, tmp_path):
    from elastic_oneshot.loop.data import builtin_texts

    dataset = tmp_path / "texts.txt"
    texts = [t.replace("\n", " ") for t, _ in zip(builtin_texts(), range(400))]
    dataset.write_text("\n".join(texts))
    run(tiny_llama, tmp_path, "--dataset", dataset)
    (tmp_path / "out.state" / "tokens.safetensors").unlink()
    dataset.write_text("\n".join(reversed(texts)))
    line = one_error_line(run(tiny_llama, tmp_path, "--dataset", dataset, check=False), 2)
    assert "the dataset now yields other samples" in line and "--restart" in line


def test_the_loser_of_a_simultaneous_claim_is_told_so(tmp_path):
    record = {"fingerprint": "f", "identity": {k: k for k in ("model", "dataset", "recipe", "samples")}}
    first, second = StateStore(str(tmp_path / "state")), StateStore(str(tmp_path / "state"))
    assert not second.holds(record)  # the loser looked before the winner wrote job.json
    first.claim(record, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(UsageError, match="another process is starting the same job in"):
        second.claim(record, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(UsageError, match="belongs to another job"):
        second.claim({**record, "fingerprint": "g"}, torch.zeros(2, 4, dtype=torch.int64))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_worker_whose_other_rank_died_or_froze_says_so_in_one_line(fault, tmp_path):
    """Rank 1 killed mid-collective: rank 0 says the rank was lost. Rank 1 frozen (SIGSTOP): rank 0 leaves after
    --collective-timeout with its heartbeat watchdog's line or, when gloo's timeout fires first, the lost rank's.
    One error line either way, not a log record nor a traceback."""
    model = make_model(str(tmp_path / "llama12"), "llama", num_hidden_layers=12)
    state, logs = tmp_path / "state", tmp_path / "logs"
    args = ["run", "--model", model, "--output", tmp_path / "out", "--state", state, *JOB, "--collective-timeout",
            60 if fault == "killed" else 4]
    cmd = torchrun_cmd(2, *args, extra=["--log-dir", logs, "--redirects", "3"])
    proc = subprocess.Popen(cmd, env=one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    victim = None
    try:
        deadline = time.monotonic() + 120
        while not ((state / "commits").is_dir() and os.listdir(state / "commits")):
            assert proc.poll() is None and time.monotonic() < deadline, "no layer was committed"
            time.sleep(0.05)
        ranks = workers(proc)
        victim = ranks[1]
        victim.send_signal(signal.SIGSTOP)  # rank 0 now waits for it in a collective
        if fault == "killed":
            time.sleep(1.5)
            victim.send_signal(signal.SIGKILL)
        else:  # once rank 0 has left, the stopped rank is killed: the agent's SIGTERM would wait 30 s on it
            ranks[0].wait(timeout=120)
            victim.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if victim is not None and victim.is_running():
            victim.kill()  # in a session of its own: the agent's group is not its
    survivor = next(logs.rglob("attempt_0/0/stderr.log")).read_text()
    line = one_error_line(subprocess.CompletedProcess(cmd, 1, "", survivor), 1)
    if fault == "frozen":
        assert line.startswith(("elastic-oneshot: error: liveness: rank 1 silent for ",
                                "elastic-oneshot: error: another rank was lost (Timed out waiting",
                                "elastic-oneshot: error: another rank was lost (Application timeout")), line
        return
    assert re.search(r"rank\s+: 0 .*\n.*exitcode\s+: 1 ", err), err[-3000:]
    # gloo words a killed peer either way, by timing; world.py knows both
    assert "another rank was lost (" in line and re.search(r"Connection (reset|closed) by peer", line), line
    run_cli(*args, env=one_thread_env())  # the job goes on from its commits


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs of this test's own, unmounted afterwards (needs root)."""
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", disk], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", disk], check=True)


@pytest.mark.slow
def test_a_full_disk_during_export_is_one_line_and_leaves_nothing_half_written(tiny_llama, tmp_path, small_disk):
    """The layers are computed and committed; the export's disk fills: exit 4 naming the path, no OUT.partial
    left, and the same command exports once there is room."""
    state = tmp_path / "state"
    args = ["run", "--model", tiny_llama, "--state", state, *JOB]
    line = one_error_line(run_cli(*args, "--output", small_disk / "out", check=False, env=one_thread_env()), 4)
    assert f"cannot write {small_disk / 'out.partial'}: No space left on device (ENOSPC)" in line, line
    assert os.listdir(small_disk) == []
    run_cli("export", "--state", state, "--output", tmp_path / "out", env=one_thread_env())
    assert (tmp_path / "out" / "model.safetensors").is_file()


# -- docs/troubleshooting.md -------------------------------------------------------------------------------------
RAISERS = {"UsageError", "CorruptStateError", "StaleEpochError", "StorageError", "_fail", "error", "report"}


def _literal_parts(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.split(r"%[-.\d]*[sdrf]", node.value)  # a log.error template
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    return []


def message_templates() -> set[str]:
    """The fixed words of every message the package shows users as an error: the first literal part of eight
    characters or more of each UsageError(...), StorageError's, cli._fail(...) and log.error(...)."""
    found = set()
    for path in (ROOT / "elastic_oneshot").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in RAISERS or (name == "__init__" and path.name == "errors.py"):
                parts = [" ".join(p.split()) for p in _literal_parts(node.args[0])]
                found.update([p for p in parts if len(p) >= 8][:1])
    return found


def test_troubleshooting_lists_every_message_and_exit_code():
    doc = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    templates = message_templates()
    assert len(templates) > 40
    missing = sorted(t for t in templates if t not in doc)
    assert not missing, "messages missing from docs/troubleshooting.md:\n" + "\n".join(missing)
    for code in (1, 2, 3, 4, 143):
        assert f"| {code} |" in doc


@pytest.mark.parametrize("words", ["Connection reset by peer", "Application timeout caused pair closure",
                                   "Timed out waiting 10000ms for recv operation to complete"])
def test_gloo_words_for_a_lost_or_frozen_rank(words):
    """Whichever of gloo's errors a collective ends in when a peer dies or freezes is read as a lost rank (and the
    worker leaves in one line), and nothing else is."""
    assert rank_lost(RuntimeError(f"[../third_party/gloo/gloo/transport/tcp/pair.cc:534] {words}")) == words
    assert rank_lost(RuntimeError("size mismatch")) is None and rank_lost(ValueError(words)) is None
