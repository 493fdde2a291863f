"""Each modifier, elastic and resumable layer by layer: a recipe's job killed (kill -9 of every worker) at W=2 inside
one of its passes, then resumed at another world size (torchrun, gloo), writes the uninterrupted W=1 run's bytes.
A resume inside the last pass replays its committed layers with the earlier passes' decisions applied."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from elastic_oneshot.loop.device_cache import in_memory
from elastic_oneshot.testing.recipes import recipe_yaml
from elastic_oneshot.testing.runs import assert_same_bits, one_thread_env, run_cli, torchrun_cmd, workers
from elastic_oneshot.testing.tiny import make_model

LAYERS = 8
JOB = ["--num-samples", 24, "--seq-len", 128, "--chunk-size", 4]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama8"), "llama", num_hidden_layers=LAYERS,
                      num_key_value_heads=4)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """The uninterrupted W=1 run of a recipe, each made once."""
    made = {}

    def make(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(f"reference-{name}")
            (root / "recipe.yaml").write_text(recipe_yaml(name))
            run_cli("run", "--model", model, "--recipe", root / "recipe.yaml", "--output", root / "out", *JOB,
                    env=one_thread_env())
            made[name] = root / "out"
        return made[name]
    return make


def run_at(size: int, *args) -> subprocess.CompletedProcess:
    """`elastic-oneshot run ARGS` at `size` ranks of one thread (one process without torchrun at 1)."""
    if size == 1:
        return run_cli("run", *args, env=one_thread_env())
    proc = subprocess.run(torchrun_cmd(size, "run", *args), capture_output=True, text=True, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name, folder, resumed, boundaries", [
    ("smoothquant_w8a8", "stages/00-SmoothQuantModifier", 3, "auto"),
    ("smoothquant_w8a8", "", 1, "0"),  # in GPTQ's pass, replayed from the embeddings through smoothed layers
    ("awq_w4a16_asym", "stages/00-AWQModifier", 3, "2"),
    ("awq_w4a16_asym", "", 3, "auto"),  # in QuantizationModifier's pass, which has no forward
    ("sparse_2of4_fp8", "stages/00-SparseGPTModifier", 1, "2"),
    ("nvfp4", "", 3, "2"),  # QuantizationModifier with static inputs: the only pass
])
def test_killed_in_a_pass_then_resumed_at_another_world_size(model, reference, tmp_path, name, folder, resumed,
                                                             boundaries):
    recipe, out, state = tmp_path / "recipe.yaml", tmp_path / "out", tmp_path / "state"
    recipe.write_text(recipe_yaml(name))
    args = ["--model", model, "--recipe", recipe, "--output", out, "--state", state, *JOB,
            "--boundary-every", boundaries]
    with open(tmp_path / "w2.log", "w") as log:
        launcher = subprocess.Popen(torchrun_cmd(2, "run", *args), stdout=log, stderr=subprocess.STDOUT,
                                    env=one_thread_env())
    commits = state / folder / "commits"
    while not (commits / "00001.e00001.json").exists():
        assert launcher.poll() is None, (tmp_path / "w2.log").read_text()[-3000:]
        time.sleep(0.005)
    for proc in workers(launcher).values():
        proc.send_signal(signal.SIGKILL)
    launcher.wait(timeout=60)
    done = sorted(os.listdir(commits))
    assert f"{LAYERS - 1:05d}.e00001.json" not in done, "the pass ended before the kill: make the job bigger"
    print(f"\n{name}: killed at W=2 with {len(done)} of {LAYERS} layers of {folder or 'the last pass'} committed")
    assert "belongs to this job: resuming" in run_at(resumed, *args).stderr
    assert_same_bits(out, reference(name))


# Rank 0 killed (kill -9) as soon as it has committed layer 3; its agent then stops the other rank.
KILLED_AFTER_LAYER_3 = """import os, signal
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.surface import cli
commit = CommitProtocol.commit
def killed(self, layer, *args):
    commit(self, layer, *args)
    if layer == 3:
        os.kill(os.getpid(), signal.SIGKILL)
CommitProtocol.commit = killed
cli.entry()
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_data_free_job_resumed_at_one_rank_links_what_it_commits_alone(model, reference, tmp_path):
    """FP8_DYNAMIC (no forward): killed at W=2 once 4 of its 8 layers are committed (each in a file a rank), then
    resumed at W=1, it writes the uninterrupted W=1 run's bytes; in both, a layer committed in one file (at W=1) is
    that file in the checkpoint, a hard link into the state (written once), and the others' shards are written."""
    recipe, out, state = tmp_path / "recipe.yaml", tmp_path / "out", tmp_path / "state"
    recipe.write_text(recipe_yaml("fp8_dynamic"))
    args = ["--model", model, "--recipe", recipe, "--output", out, "--state", state, *JOB]
    (tmp_path / "killed.py").write_text(KILLED_AFTER_LAYER_3)
    killed = subprocess.run(torchrun_cmd(2, "run", *args, program=[tmp_path / "killed.py"]), capture_output=True,
                            text=True, env=one_thread_env())
    assert killed.returncode != 0 and not out.exists(), killed.stderr[-3000:]
    assert sorted(os.listdir(state / "commits")) == [f"{layer:05d}.e00001.json" for layer in range(4)]
    assert "belongs to this job: resuming" in run_at(1, *args).stderr
    assert_same_bits(out, reference("fp8_dynamic"))

    def linked(checkpoint, state) -> list[int]:
        """The layers whose shard in `checkpoint` is a file of `state`, each alone in its shard."""
        files = {os.stat(p).st_ino for p in state.rglob("*.safetensors")}
        shards = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
        layers = {}
        for name, shard in shards.items():
            if name.startswith("model.layers.") and os.stat(checkpoint / shard).st_ino in files:
                layers.setdefault(shard, set()).add(int(name.split(".")[2]))
        assert all(len(v) == 1 for v in layers.values()), layers
        return sorted(layer for v in layers.values() for layer in v)

    assert linked(reference("fp8_dynamic"), reference("fp8_dynamic").parent / "out.state") == list(range(LAYERS))
    # layer 4's solved files, written at W=2 before the kill or not, are reused or solved again at W=1
    assert linked(out, state) in ([5, 6, 7], [4, 5, 6, 7])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_bfloat16_awq_writes_the_same_bits_at_two_ranks(tmp_path):
    """AWQ on a bfloat16 model (each sample's error rounded to bfloat16, as the peer's): its choices, summed in
    sample order from per-sample slots, do not depend on the world size."""
    model = make_model(str(tmp_path / "bf16"), "llama", num_hidden_layers=2, num_key_value_heads=4,
                       dtype=torch.bfloat16)
    (tmp_path / "recipe.yaml").write_text(recipe_yaml("awq_w4a16_asym"))
    for size in (1, 2):
        run_at(size, "--model", model, "--recipe", tmp_path / "recipe.yaml", "--output", tmp_path / f"w{size}", *JOB)
    assert_same_bits(tmp_path / "w2", tmp_path / "w1")


@pytest.mark.slow
def test_awq_past_its_memory_records_to_a_file_and_writes_the_same_bits(model, reference, tmp_path):
    """AWQ's recorded calls past --max-memory (on the CPU, the host's memory is the device's) go to a file in
    $TMPDIR, unlinked, and come back exact: the bytes of the run that held them all."""
    (tmp_path / "recipe.yaml").write_text(recipe_yaml("awq_w4a16_asym"))
    spill = tmp_path / "tmp"
    spill.mkdir()
    if in_memory(str(spill)):
        pytest.skip(f"{tmp_path} is in memory (tmpfs): the file tier needs a temporary directory on a disk")
    proc = run_cli("run", "--model", model, "--recipe", tmp_path / "recipe.yaml", "--output", tmp_path / "out", *JOB,
                   "--max-memory", "1MB", env=one_thread_env() | {"TMPDIR": str(spill)})
    assert f"GB in a file in {spill}, past the memory it may use" in proc.stderr
    assert not [p for p in spill.rglob("*") if not p.is_dir()]  # torch may make a cache directory there
    assert_same_bits(tmp_path / "out", reference("awq_w4a16_asym"))


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_awq_refuses_a_record_that_would_not_fit_before_it_is_spent(model, tmp_path):
    """With --max-memory of 1 MB and TMPDIR in memory (a tmpfs, with room for the whole record were it a disk),
    layer 0's record (24 samples of about 0.3 MB) cannot fit: the run ends with the one line that says so and what
    to do (exit 2) after its first sample, and commits nothing of AWQ's pass."""
    (tmp_path / "recipe.yaml").write_text(recipe_yaml("awq_w4a16_asym"))
    memory = tmp_path / "memory"
    memory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", memory], check=True)
    try:
        proc = run_cli("run", "--model", model, "--recipe", tmp_path / "recipe.yaml", "--output", tmp_path / "out",
                       "--state", tmp_path / "state", *JOB, "--max-memory", "1MB", check=False,
                       env=one_thread_env() | {"TMPDIR": str(memory)})
    finally:
        subprocess.run(["umount", memory], check=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("elastic-oneshot: error: layer 0: AWQ's record of its calls on rank 0 would take ") and \
        f"GB of memory it may use ({memory}, the temporary directory, is in memory too): run on more ranks" in line \
        and line.endswith("or with TMPDIR on a disk"), line
    assert not list((tmp_path / "state").rglob("commits/*.json"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
@pytest.mark.parametrize("when", ["before any work", "after the first sample"])
def test_a_usage_error_under_torchrun_is_not_restarted(when, model, tmp_path):
    """torchrun restarts a failed group up to --max-restarts times, whatever its exit code: a recipe refused before
    any work, or AWQ's record refused after a layer's first sample on both ranks (the second one's refusal finding
    the first rank gone, or in a collective), would be refused again after every restart. The worker ends its
    agent instead: each rank's line at most once (a rank that the agent stops before it refuses prints none), and
    torchrun ends."""
    recipe = tmp_path / "recipe.yaml"
    if when == "before any work":
        recipe.write_text("recipe_stage:\n  recipe_modifiers:\n    QuIPModifier: {}\n")
        line, extra, memory = "QuIPModifier is not supported", [], None
    else:
        recipe.write_text(recipe_yaml("awq_w4a16_asym"))
        line, extra, memory = "AWQ's record of its calls on rank", ["--max-memory", "1MB"], tmp_path / "memory"
        memory.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", memory], check=True)
    try:
        start = time.monotonic()
        proc = subprocess.run(torchrun_cmd(2, "run", "--model", model, "--recipe", recipe, "--output",
                                           tmp_path / "out", *JOB, *extra, max_restarts=3),
                              capture_output=True, text=True, timeout=600,
                              env=one_thread_env() | ({"TMPDIR": str(memory)} if memory else {}))
    finally:
        if memory:
            subprocess.run(["umount", memory], check=True)
    print(f"\n{when}: torchrun ended after {time.monotonic() - start:.1f} s")
    lines = [text for text in proc.stderr.splitlines() if text.startswith("elastic-oneshot: error: ")]
    assert proc.returncode != 0 and 1 <= len(lines) <= 2 and all(line in text for text in lines), proc.stderr[-3000:]
    assert proc.stderr.count("a usage error is not retried: ending torchrun's agent") == 1
    assert not list((tmp_path / "out.state").rglob("commits/*.json"))
