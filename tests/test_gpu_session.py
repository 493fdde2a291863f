"""launch/gpu_session.sh all: a GPU session in one device call, tried on the CPU with tiny shapes (about 90 s): its
steps in order, each ended by its deadline, the figures of each side kept as soon as they exist, and nothing written
outside $OUT and the work folder."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from elastic_oneshot.testing.gpu import peer_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "gpu_session.sh")
STEPS = ["setup", "qwen3-30b-a3b", "llama3-8b", "memory", "tests"]
BENCHES = {"qwen3-30b-a3b": "qwen3-30b-a3b", "llama3-8b": "llama3-8b", "memory": "llama3-8b-memory"}
OUT_FILES = {"session.log", "install.log", "result.json", "qwen3-30b-a3b.log", "llama3-8b.log", "memory.log",
             "tests.log"}  # the device tool brings back 8 files at most
BUDGET, KILL_GRACE = 90, 3


def test_script_parses_and_refuses_an_unknown_step():
    subprocess.run(["bash", "-n", SCRIPT], check=True)
    proc = subprocess.run(["bash", SCRIPT, "nonsense"], capture_output=True, text=True,
                          env={**os.environ, "WORK": "/nonexistent/never", "OUT": "/nonexistent/never"})
    assert proc.returncode == 2 and "unknown step nonsense" in proc.stderr


def files_under(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs}


def repo_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_all_on_cpu_keeps_order_deadlines_and_results_within_its_budget(tmp_path):
    work, out, home, tmp = (tmp_path / d for d in ("work", "out", "home", "tmp"))
    for d in (home, tmp):
        d.mkdir()
    before = repo_state()
    env = {**os.environ, "WORK": str(work), "OUT": str(out), "HOME": str(home), "TMPDIR": str(tmp),
           "PYTHON": sys.executable}
    start = time.monotonic()
    proc = subprocess.run(["bash", SCRIPT, "all", "--tiny", "--budget", str(BUDGET)], env=env, capture_output=True,
                          text=True, timeout=BUDGET * 3)
    wall = time.monotonic() - start
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert wall < BUDGET + KILL_GRACE + 5  # whatever happens

    log = (out / "session.log").read_text()
    assert [line[3:].split(":")[0] for line in log.splitlines() if ": from " in line] == STEPS
    result = json.loads((out / "result.json").read_text())
    steps = result["steps"]
    assert [s["step"] for s in steps] == STEPS
    for s in steps:  # each ended by its deadline, and started no earlier than the one before ended
        assert s["end_s"] <= s["deadline_s"] + KILL_GRACE, s
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(steps, steps[1:]))

    # the CUDA tests on a CPU cannot end in what is left of 90 s: something is cut off while it runs
    cut = [s for s in steps if s["cut_off"] and s["end_s"] > s["start_s"]]
    assert cut, steps
    first = STEPS.index(cut[0]["step"])
    assert first > STEPS.index("setup")
    sides = ["ours", "peer"] if peer_available() else ["ours"]
    for s in steps[1:first]:  # every step before the first cut: all of its figures
        entry = result[BENCHES[s["step"]]]
        assert s["exit"] == 0 and all(entry[side] and entry[side]["wall"] > 0 for side in sides), (s, entry)
    if cut[0]["step"] in BENCHES:  # the cut one: each side the bench said it measured (once kept), kept at once
        step = cut[0]["step"]
        said = (out / "session.log").read_text().split(f"== {step}: from ", 1)[1].split(f"== {step}: exit ", 1)[0]
        entry = result.get(BENCHES[cut[0]["step"]], {})
        for side, line in (("ours", r"^ours \(--boundary-every "), ("peer", r"^peer: [0-9.]+ s, ratio ")):
            if side in sides and re.search(line, said, re.MULTILINE):
                assert entry.get(side) and entry[side]["wall"] > 0, (side, entry)

    assert files_under(out) <= OUT_FILES and len(files_under(out)) <= 8
    assert not files_under(home) and not files_under(tmp)  # the work folder holds the rest
    assert repo_state() == before
