"""Refused at start, in one line, with the user's files untouched: export never deletes what it did not write, and
everything checkable (paths, shards, tensors, --seq-len, the dataset) is checked before layer 0."""

import json
import math
import os
import resource
import shutil
import struct
import subprocess
import time

import psutil
import pytest
from safetensors.torch import load_file, save_file

from elastic_oneshot.errors import UsageError
from elastic_oneshot.surface.preflight import check_layer_fits
from elastic_oneshot.testing.runs import run_cli, start_cli, tree_digest

JOB = ["--num-samples", 8, "--seq-len", 16, "--chunk-size", 4, "--group-size", 64]


def refused(proc, fragment: str):
    """Exit 2, one line on stderr that says `fragment`, and no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-oneshot: error: "), proc.stderr[-3000:]
    assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def finished(tiny_llama, tmp_path_factory):
    """A finished job: its output and state."""
    root = tmp_path_factory.mktemp("finished")
    run_cli("run", "--model", tiny_llama, "--output", root / "out", "--state", root / "state", *JOB)
    return root / "out", root / "state"


@pytest.fixture
def model_copy(tiny_llama, tmp_path):
    return shutil.copytree(tiny_llama, tmp_path / "model")


def user_files(path):
    os.makedirs(path)
    (path / "notes.txt").write_text("mine")
    return tree_digest(path)


# -- export never deletes ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_run_refuses_an_output_holding_the_users_files(tiny_llama, tmp_path):
    before = user_files(tmp_path / "out")
    refused(run_cli("run", "--model", tiny_llama, "--output", tmp_path / "out", *JOB, check=False),
            "exists and is not this job's checkpoint")
    assert tree_digest(tmp_path / "out") == before
    assert not (tmp_path / "out.state").exists()


@pytest.mark.slow
def test_export_refuses_an_output_holding_the_users_files(finished, tmp_path):
    _, state = finished
    before = user_files(tmp_path / "out")
    refused(run_cli("export", "--state", state, "--output", tmp_path / "out", check=False),
            "exists and is not this job's checkpoint")
    assert tree_digest(tmp_path / "out") == before


@pytest.mark.slow
def test_output_that_is_a_file_is_refused(finished, tmp_path):
    _, state = finished
    (tmp_path / "out").write_text("mine")
    refused(run_cli("export", "--state", state, "--output", tmp_path / "out", check=False), "is a file")
    assert (tmp_path / "out").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["output=model", "state inside output", "output inside state"])
def test_model_state_and_output_must_be_separate(model_copy, tmp_path, layout):
    output, state = {"output=model": (model_copy, tmp_path / "s"),
                     "state inside output": (tmp_path / "out", tmp_path / "out" / "state"),
                     "output inside state": (tmp_path / "st" / "out", tmp_path / "st")}[layout]
    before = tree_digest(model_copy)
    proc = run_cli("run", "--model", model_copy, "--output", output, "--state", state, *JOB, check=False)
    refused(proc, "the same directory" if layout == "output=model" else "is inside")
    assert tree_digest(model_copy) == before
    assert not os.path.exists(state)


@pytest.mark.slow
def test_export_into_the_state_is_refused(finished):
    _, state = finished
    before = tree_digest(state)
    refused(run_cli("export", "--state", state, "--output", state / "out", check=False), "is inside --state")
    assert tree_digest(state) == before


@pytest.mark.slow
def test_this_jobs_checkpoint_is_replaced_and_nothing_else(finished, tmp_path):
    out, state = finished
    reference = tree_digest(out)
    run_cli("export", "--state", state, "--output", out)  # its own checkpoint: replaced by an equal one
    assert tree_digest(out) == reference
    assert sorted(os.listdir(out.parent)) == ["out", "state"]  # no OUT.partial or OUT.old left
    (out / "notes.txt").write_text("mine")
    refused(run_cli("export", "--state", state, "--output", out, check=False), "this tool did not write (notes.txt)")
    assert (out / "notes.txt").read_text() == "mine"
    os.remove(out / "notes.txt")


# -- checked before layer 0 --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_unwritable_output_and_state_are_refused(tiny_llama, tmp_path):
    refused(run_cli("run", "--model", tiny_llama, "--output", "/proc/eo-test/out", "--state", tmp_path / "s", *JOB,
                    check=False), "--output /proc/eo-test/out: cannot create a file in /proc")
    refused(run_cli("run", "--model", tiny_llama, "--output", tmp_path / "o", "--state", "/proc/eo-test/s", *JOB,
                    check=False), "--state /proc/eo-test/s: cannot create a file in /proc")
    (tmp_path / "file").write_text("mine")
    refused(run_cli("run", "--model", tiny_llama, "--output", tmp_path / "o", "--state", tmp_path / "file", *JOB,
                    check=False), "is a file, not a directory")
    refused(run_cli("run", "--model", tiny_llama, "--output", tmp_path / "file" / "sub", *JOB, check=False),
            f": {tmp_path / 'file'} is a file, not a directory")
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "file.state").exists()


@pytest.mark.slow
@pytest.mark.parametrize("size", [5, "half"])
def test_truncated_shard_is_named(model_copy, tmp_path, size):
    shard = model_copy / "model.safetensors"
    os.truncate(shard, 5 if size == 5 else os.path.getsize(shard) // 2)
    refused(run_cli("run", "--model", model_copy, "--output", tmp_path / "o", *JOB, check=False),
            f"model file {shard} is truncated or damaged")


@pytest.mark.slow
@pytest.mark.parametrize("change", ["missing", "shape"])
def test_a_late_layers_tensor_is_checked_before_layer_0(model_copy, tmp_path, change):
    shard = model_copy / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.3.mlp.down_proj.weight"
    if change == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:, :64].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    proc = run_cli("run", "--model", model_copy, "--output", tmp_path / "o", *JOB, check=False)
    refused(proc, f"lacks tensor {name}" if change == "missing" else f"tensor {name} in {shard} has shape [128, 64]")
    assert not (tmp_path / "o.state").exists()


@pytest.mark.slow
def test_seq_len_bounds(tiny_llama, tmp_path):
    out = ["--model", tiny_llama, "--output", tmp_path / "o", "--num-samples", 8]
    refused(run_cli("run", *out, "--seq-len", 1, check=False), "--seq-len must be at least 2 tokens")
    refused(run_cli("run", *out, "--seq-len", 600, check=False), "exceeds the model's context of 512 tokens")
    (tmp_path / "small.txt").write_text("a few words\n")  # past the check, the dataset is what stops it
    refused(run_cli("run", *out, "--seq-len", 600, "--allow-long-seq", "--dataset", tmp_path / "small.txt",
                    check=False), "yields only 0 usable samples")


@pytest.mark.slow
@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", '{"text": "fine"}\nnot json\n', "line 2 is not valid JSON"),
    ("empty.jsonl", "", "is empty"),
    ("empty.txt", "", "is empty"),
    ("blank.txt", "\n  \n\n", "has no text (only blank lines)"),
    ("control.jsonl", '{"text": "fine"}\n{"text": "tab\there"}\n',
     "line 2 is not valid JSON (Invalid control character at: line 1 column 14 (char 13))"),
    ("numbers.jsonl", '{"text": 3}\n', "column 'text' holds int, not text"),
])
def test_unreadable_datasets_are_one_line(tiny_llama, tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    refused(run_cli("run", "--model", tiny_llama, "--output", tmp_path / "o", "--dataset", tmp_path / name, *JOB,
                    check=False), message)


@pytest.mark.slow
def test_a_config_with_fewer_layers_than_the_weights_is_refused_before_work(model_copy, tmp_path):
    """16 layers of weights under a config of 12 would compress 12 and fail at export: refused at start."""
    with open(model_copy / "config.json") as f:
        config = json.load(f)
    config["num_hidden_layers"] -= 2
    with open(model_copy / "config.json", "w") as f:
        json.dump(config, f)
    refused(run_cli("run", "--model", model_copy, "--output", tmp_path / "o", *JOB, check=False),
            "its weights hold layers up to 3, but config.json says num_hidden_layers 2")
    assert not (tmp_path / "o.state").exists()


def test_a_file_given_as_the_model_is_named_as_a_file(model_copy, tmp_path):
    shard = sorted(model_copy.glob("*.safetensors"))[0]
    refused(run_cli("run", "--model", shard, "--output", tmp_path / "o", *JOB, check=False),
            f"model {shard} is a file, not a model directory")
    assert not (tmp_path / "o.state").exists()


@pytest.mark.slow
def test_a_second_job_on_the_same_output_is_refused_before_work(tiny_llama, tmp_path):
    """Job A claims --output when it starts; job B (other settings, its own state) started while A runs is
    refused at its start, not after computing every layer."""
    out, first, second = tmp_path / "out", tmp_path / "a.state", tmp_path / "b.state"
    a = start_cli("run", "--model", tiny_llama, "--output", out, "--state", first, *JOB, stdout=subprocess.DEVNULL,
                  stderr=subprocess.DEVNULL)
    while not (first / "commits").is_dir():
        assert a.poll() is None, "job A ended before its first commit"
        time.sleep(0.01)
    a.kill()
    a.wait()
    refused(run_cli("run", "--model", tiny_llama, "--output", out, "--state", second, *JOB, "--seed", 1, check=False),
            f"{out}.partial is in the way of the export and is not this job's")
    assert not (second / "commits").exists()
    run_cli("run", "--model", tiny_llama, "--output", out, "--state", first, *JOB)  # A resumes and finishes
    assert sorted(p for p in os.listdir(tmp_path) if p != "b.state") == ["a.state", "out"]  # no OUT.partial left


def _resized(model_dir, shapes: dict):
    """Replace the fp32 model's safetensors by one file of the same tensors, those in `shapes` with those shapes
    and never written: a sparse file, of which they read as zeros."""
    tensors = {}
    for shard in model_dir.glob("*.safetensors"):
        tensors.update(load_file(shard))
        shard.unlink()
    header, end = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        shape = shapes.get(name, list(t.shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end + 4 * math.prod(shape)]}
        end += 4 * math.prod(shape)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(model_dir / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        base = f.tell()
        for name, t in tensors.items():
            if name not in shapes:
                f.seek(base + header[name]["data_offsets"][0])
                f.write(t.numpy().tobytes())
        f.truncate(base + end)


def test_a_layer_larger_than_memory_is_refused_before_work(model_copy, tmp_path):
    """A layer whose weights alone exceed the host's available memory would be killed for memory when reached, and
    again at every restart: refused at start. Here the MLP makes each layer twice what is available now; its
    weights are never written (a sparse file), and the run may map at most 16 GiB, so that without the check it
    fails here, not the machine."""
    with open(model_copy / "config.json") as f:
        config = json.load(f)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    inner = 64 * math.ceil(2 * psutil.virtual_memory().available / (3 * 4 * hidden * 64))
    config["intermediate_size"] = inner
    with open(model_copy / "config.json", "w") as f:
        json.dump(config, f)
    _resized(model_copy, {f"model.layers.{i}.mlp.{p}.weight": [hidden, inner] if p == "down_proj" else [inner, hidden]
                          for i in range(layers) for p in ("gate_proj", "up_proj", "down_proj")})
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # noqa: E731
    refused(run_cli("run", "--model", model_copy, "--output", tmp_path / "o", *JOB, check=False, preexec_fn=cap),
            "layer 0's weights take")
    assert not (tmp_path / "o.state" / "job.json").exists()


def test_a_layer_that_fits_only_under_routed_calibration_says_so():
    """All-experts calibration solves every expert's gate and up as one group, held whole; routed calibration
    reads experts a batch at a time: where only that fits, the refusal says so."""
    free = [[("rank 0's host", 20 * 10**9)]]
    check_layer_fits([5 * 10**9, 19 * 10**9], free)
    with pytest.raises(UsageError, match=r"^layer 1's weights take 30\.0 GB held at once, more than the 20\.0 GB .*"
                                         r"\(or pass --moe-calibrate routed, under which .*\)$"):
        check_layer_fits([5 * 10**9, 30 * 10**9], free, routed=[5 * 10**9, 8 * 10**9])
    with pytest.raises(UsageError, match=r"machines with more memory$"):
        check_layer_fits([5 * 10**9, 30 * 10**9], free, routed=[5 * 10**9, 21 * 10**9])
