"""The user's surface: the API and the CLI, llmcompressor recipes, the progress bar, and `status` of a real
interrupted job."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import matplotlib.image
import psutil
import pytest
import torch

from elastic_oneshot import oneshot
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import UsageError
from elastic_oneshot.events import History
from elastic_oneshot.quantization.recipe import Recipe
from elastic_oneshot.quantization.recipe_loader import read_recipe
from elastic_oneshot.surface.status import render, report
from elastic_oneshot.testing.runs import one_thread_env, run_cli, torchrun_cmd, tree_digest
from elastic_oneshot.testing.tiny import make_model

JOB = ["--num-samples", 16, "--seq-len", 64, "--chunk-size", 4]
API_JOB = dict(num_calibration_samples=16, max_seq_length=64, chunk_size=4)
GROUP_64 = {"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}}
# As llmcompressor's examples write W4A16 GPTQ recipes (e.g. tests/e2e/recipes/actorder/*.yaml there).
YAML_GROUP_64 = """\
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: true
            strategy: "group"
            group_size: 64
          targets: ["Linear"]
"""


def stage(modifiers: str) -> str:
    return "quant_stage:\n  quant_modifiers:\n" + "".join(f"    {line}\n" for line in modifiers.splitlines())


def same_threads_env() -> dict:
    """A CLI run bitwise equal to this process's runs: the same BLAS thread count."""
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}


@pytest.mark.slow
def test_api_cli_and_recipes_make_identical_checkpoints(tiny_llama, tmp_path):
    from llmcompressor.modifiers.gptq import GPTQModifier

    reference = tree_digest(oneshot(model=tiny_llama, group_size=64, output_dir=str(tmp_path / "api"), **API_JOB))
    cli = run_cli("run", "--model", tiny_llama, "--group-size", 64, "--output", tmp_path / "cli", *JOB,
                  env=same_threads_env())
    assert re.search(r"layers: 100%.*4/4", cli.stderr), cli.stderr[-2000:]  # the progress bar, on rank 0
    (tmp_path / "w4a16.yaml").write_text(YAML_GROUP_64)
    run_cli("run", "--model", tiny_llama, "--recipe", tmp_path / "w4a16.yaml", "--output", tmp_path / "yaml", *JOB,
            env=same_threads_env())
    modifier = GPTQModifier(targets="Linear", config_groups=GROUP_64, ignore=["lm_head"])
    oneshot(model=tiny_llama, recipe=modifier, output_dir=str(tmp_path / "object"), **API_JOB)
    for name in ("cli", "yaml", "object"):
        assert tree_digest(tmp_path / name) == reference, name


# The CLI's process, counting the cyclic collector's passes once torch and transformers are imported
COUNTED = """
import atexit, gc, sys
passes = []
gc.callbacks.append(lambda phase, _: phase == "start" and "transformers" in sys.modules and passes.append(1))
atexit.register(lambda: print(f"collector passes after the imports: {len(passes)}", file=sys.stderr))
from elastic_oneshot.surface.cli import entry
entry()
"""


@pytest.mark.slow
def test_the_cli_collects_again_after_its_imports(tiny_llama, tmp_path):
    """entry() pauses the cyclic collector while torch and transformers import (cli._heavy_imports); the run itself
    goes on with it collecting, as a worker running for hours must."""
    proc = run_cli("run", "--model", tiny_llama, "--output", tmp_path / "out", *JOB, program=["-c", COUNTED])
    passes = int(re.search(r"collector passes after the imports: (\d+)", proc.stderr).group(1))
    assert passes > 10, proc.stderr[-2000:]


def test_recipe_spellings_of_the_same_job():
    from llmcompressor.modifiers.gptq import GPTQModifier

    flags = Recipe(group_size=64)
    assert read_recipe(YAML_GROUP_64) == flags
    assert read_recipe([GPTQModifier(config_groups=GROUP_64, ignore=["lm_head"], actorder="weight")]) == flags
    preset = stage("GPTQModifier: {scheme: W4A16, targets: Linear, ignore: [lm_head]}")
    assert read_recipe(preset) == Recipe()  # what the flags' defaults make: the same job fingerprint
    channel = stage("GPTQModifier:\n  actorder: null\n  dampening_frac: 0.05\n  config_groups: {g: {targets: [Linear], "
                    "weights: {num_bits: 3, type: int, symmetric: false, strategy: channel}}}")
    assert read_recipe(channel) == Recipe(scheme="W3A16", group_size=-1, symmetric=False, actorder=None,
                                          dampening_frac=0.05, ignore=())
    assert read_recipe(channel).weights.num_bits == 3


@pytest.mark.parametrize("modifiers, message", [
    ("GPTQModifier: {scheme: FP8, input_observer: minmax}", "observer 'minmax' are not supported"),
    ("GPTQModifier: {scheme: NVFP4, weight_observer: mse}", "weight observer 'mse' is not supported"),
    ("GPTQModifier: {config_groups: {g: {targets: [Linear], weights: {num_bits: 8, type: float, symmetric: false}}}}",
     "asymmetric float weights are not supported"),
    ("GPTQModifier: {scheme: W4A16, actorder: group}", "actorder 'group' is not supported"),
    ("GPTQModifier: {config_groups: {g: {targets: [Linear], weights: {num_bits: 8}, "
     "output_activations: {num_bits: 8}}}}", "output_activations are not supported"),
    ("GPTQModifier: {scheme: W4A16, kv_cache_scheme: {num_bits: 8}}", "kv_cache_scheme is not supported"),
    ("GPTQModifier: {scheme: W4A16, sequential_update: true}", "'sequential_update' is not supported"),
    ("QuIPModifier: {}", "QuIPModifier is not supported: elastic-oneshot runs GPTQModifier, QuantizationModifier"),
])
def test_unsupported_settings_are_refused_in_one_line(modifiers, message):
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        read_recipe(stage(modifiers))
    assert "\n" not in str(e.value)


W8A8_YAML = stage("SmoothQuantModifier: {smoothing_strength: 0.8}\n"
                  "GPTQModifier: {scheme: W8A8, targets: Linear, ignore: [lm_head]}")


@pytest.mark.slow
def test_modifier_objects_and_the_clis_yaml_make_identical_checkpoints(tiny_llama, tmp_path):
    """The peer's W8A8 example as `oneshot(recipe=[modifier objects])` and as the CLI's --recipe YAML: one job, the
    same bits; both outputs hold the smoothed, quantized layers."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    objects = [SmoothQuantModifier(smoothing_strength=0.8),
               GPTQModifier(scheme="W8A8", targets="Linear", ignore=["lm_head"])]
    api = oneshot(model=tiny_llama, recipe=objects, output_dir=str(tmp_path / "api"), **API_JOB)
    (tmp_path / "w8a8.yaml").write_text(W8A8_YAML)
    run_cli("run", "--model", tiny_llama, "--recipe", tmp_path / "w8a8.yaml", "--output", tmp_path / "cli", *JOB,
            env=same_threads_env())
    assert tree_digest(tmp_path / "cli") == tree_digest(api)
    config = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized" and os.path.isdir(tmp_path / "cli.state" / "stages")


@pytest.mark.slow
def test_a_data_free_quantization_modifier_reads_no_data_and_runs_no_forward(tiny_llama, tmp_path):
    """QuantizationModifier FP8_DYNAMIC needs no calibration data: a dataset that does not exist is never opened, no
    layer runs forward (no commit reports a calibration, Hessian or propagation second), and the weights are those
    of the same recipe given the builtin dataset."""
    recipe = tmp_path / "fp8.yaml"
    recipe.write_text(stage("QuantizationModifier: {scheme: FP8_DYNAMIC, targets: Linear, ignore: [lm_head]}"))
    for name, dataset in (("builtin", "builtin"), ("nothing", str(tmp_path / "missing.jsonl"))):
        run_cli("run", "--model", tiny_llama, "--recipe", recipe, "--dataset", dataset, "--output", tmp_path / name,
                *JOB, env=same_threads_env())
        commits = History(StateStore(str(tmp_path / f"{name}.state")).events()).commits
        assert len(commits) == 4 and not {"calibrate", "hessian", "propagate"} & {k for c in commits
                                                                                for k in c["seconds"]}
    weights = [{k: v for k, v in tree_digest(tmp_path / name).items() if k.startswith("model")}
               for name in ("builtin", "nothing")]
    assert len(weights[0]) == 4 + 1 + 1 and weights[0] == weights[1]  # a shard a layer, one of the rest, an index


def test_a_data_free_quantization_modifier_calls_no_decoder_layer(tiny_llama, tmp_path, monkeypatch):
    """Not even the trial of layer 0 before any work (inputs.LayerInputs.tried): the data-free pass only reads the
    weights and writes its result, so a model whose layers cannot run is compressed all the same."""
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def refuse(*args, **kwargs):
        raise RuntimeError("a decoder layer ran")

    monkeypatch.setattr(LlamaDecoderLayer, "forward", refuse)
    out = oneshot(model=tiny_llama, recipe=QuantizationModifier(scheme="FP8_DYNAMIC", targets="Linear",
                                                                ignore=["lm_head"]),
                  output_dir=str(tmp_path / "out"), **API_JOB)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))


@pytest.mark.slow
def test_unsupported_modifiers_are_refused_by_name_before_any_work(tiny_llama, tmp_path):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import QuIPModifier

    recipe = tmp_path / "quip.yaml"
    recipe.write_text(stage("QuIPModifier: {}\nGPTQModifier: {scheme: W4A16}"))
    proc = run_cli("run", "--model", tiny_llama, "--recipe", recipe, "--output", tmp_path / "out", *JOB, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "elastic-oneshot: error: QuIPModifier is not supported: elastic-oneshot runs GPTQModifier, "
        "QuantizationModifier, SmoothQuantModifier, LogarithmicEqualizationModifier, AWQModifier, SparseGPTModifier")
    for objects, message in [([QuIPModifier(), GPTQModifier(scheme="W4A16")], "QuIPModifier is not supported"),
                             (QuantizationModifier(scheme="FP8", kv_cache_scheme={"num_bits": 8, "type": "float"}),
                              "QuantizationModifier kv_cache_scheme is not supported")]:
        with pytest.raises(UsageError, match=message):
            oneshot(model=tiny_llama, recipe=objects, output_dir=str(tmp_path / "out"), **API_JOB)
    assert not (tmp_path / "out.state").exists() and not (tmp_path / "out").exists()
    with pytest.raises(UsageError, match="not both"):
        oneshot(model=tiny_llama, recipe=YAML_GROUP_64, group_size=64, output_dir=str(tmp_path / "out"), **API_JOB)


# -- status of a real job: two ranks under torchrun, preempted (SIGTERM), finished by one process ----------------------
STATUS_JOB = ["--num-samples", 64, "--seq-len", 128, "--chunk-size", 4, "--group-size", 64]


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama8"), "llama", num_hidden_layers=8)


def text_agrees_with_json(text: str, r: dict):
    done, total = map(int, re.search(r"layers: (\d+)/(\d+) committed", text).groups())
    assert (done, total) == (r["layers_done"], r["layers_total"])
    assert ("(complete)" in text) == r["complete"]
    epochs, restarts = map(int, re.search(r"epochs: (\d+) \((\d+) restarts\)", text).groups())
    assert (epochs, restarts) == (len(r["epochs"]), r["restarts"])
    sizes = re.search(r"world sizes ([\d >-]+)", text).group(1)
    assert [int(s) for s in sizes.split("->")] == r["world_sizes"]
    assert [tuple(map(int, m)) for m in re.findall(r"epoch (\d+) .* world size (\d+) +started with (\d+) committed, "
                                                  r"committed (\d+)", text)] == \
        [(e["epoch"], e["world_size"], e["committed_at_start"], e["commits"]) for e in r["epochs"]]
    lost, spans = re.search(r"time lost to failures: ([\d.]+) s in (\d+) spans", text).groups()
    assert lost == f"{r['lost_s']:.1f}" and int(spans) == len(r["lost_spans"])  # 1.95 prints as 1.9
    if r["eta_s"]:
        h, m, s = re.search(r"ETA (?:(\d+)h )?(?:(\d+)m )?(\d+)s", text).groups()
        assert abs(int(h or 0) * 3600 + int(m or 0) * 60 + int(s) - r["eta_s"]) <= 0.5
    assert re.findall(r"fault: (\w+) .* on rank (\d+)", text) == [(f["event"], str(f["rank"])) for f in r["faults"]]


@pytest.mark.slow
@pytest.mark.distributed
def test_status_of_a_preempted_job_finished_at_another_world_size(llama8, tmp_path):
    state, out = tmp_path / "state", tmp_path / "out"
    args = ["run", "--model", llama8, "--state", state, "--output", out, *STATUS_JOB]
    with open(tmp_path / "torchrun.log", "w") as log:
        launcher = subprocess.Popen(torchrun_cmd(2, *args), stdout=log, stderr=subprocess.STDOUT,
                                    env=one_thread_env())
        while not ((state / "commits").is_dir() and os.listdir(state / "commits")):
            assert launcher.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.01)  # frozen at the first commit: SIGTERM then commits every computed layer (two or more)
        workers = psutil.Process(launcher.pid).children()
        for w in workers:  # frozen first, so that the job cannot finish before the notice reaches it
            w.suspend()
        launcher.send_signal(signal.SIGTERM)  # a spot notice: torchrun passes it to the workers
        time.sleep(1)
        for w in workers:
            w.resume()
        assert launcher.wait(timeout=60) != 0

    middle = report(str(state))
    assert 2 <= middle["layers_done"] < 8 and not middle["complete"] and middle["eta_s"] > 0
    assert middle["world_sizes"] == [2] and middle["restarts"] == 0
    assert sorted(f["rank"] for f in middle["faults"] if f["event"] == "sigterm") == [0, 1]
    text_agrees_with_json(render(middle), middle)

    watch = subprocess.Popen([sys.executable, "-m", "elastic_oneshot", "status", "--state", state, "--json",
                              "--watch"], stdout=subprocess.PIPE, text=True)
    try:
        run_cli(*args, env=one_thread_env())  # the rest, in one process
        watched = [json.loads(line) for line in watch.communicate(timeout=30)[0].splitlines()]
    finally:
        watch.kill()
    assert len(watched) >= 2 and not watched[0]["complete"] and watched[-1]["complete"]  # refreshed, then ended
    assert watch.returncode == 0

    text = run_cli("status", "--state", state).stdout
    final = json.loads(run_cli("status", "--state", state, "--json", "--plot", tmp_path / "t.png").stdout)
    text_agrees_with_json(text, final)
    assert final["layers_done"] == 8 and final["complete"] and final["eta_s"] == 0
    assert final["world_sizes"] == [2, 1] and final["restarts"] == 1 and final["redone_layers"] == 0
    assert [e["committed_at_start"] for e in final["epochs"]] == [0, middle["layers_done"]]

    events = [json.loads(line) for line in (state / "events.jsonl").read_text().splitlines()]
    restart = next(e for e in events if e["event"] == "start" and e["epoch"] == 2)
    last_commit = max(e["time"] for e in events if e["event"] == "commit" and e["epoch"] == 1)
    resumed = min(e["time"] for e in events if e["event"] == "layer" and e["epoch"] == 2)
    assert last_commit < restart["time"] < resumed
    assert final["lost_spans"] == [[round(last_commit, 3), round(resumed, 3)]]
    assert abs(final["lost_s"] - (resumed - last_commit)) < 0.01

    png = (tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(tmp_path / "t.png").shape[:2] == (450, 800)


@pytest.mark.slow
@pytest.mark.etcd
def test_status_reads_and_watches_the_etcd_coordinator(tiny_llama, tmp_path):
    from elastic_oneshot.testing.etcd_server import EtcdServer

    state = tmp_path / "state"
    with EtcdServer() as etcd:
        url = f"etcd://{etcd.endpoint}/jobs/status"
        run_cli("run", "--model", tiny_llama, "--state", state, "--output", tmp_path / "out", "--group-size", 64,
                *JOB, "--coordinator", url)
        assert not (state / "commits").exists()  # the commits live in etcd
        lines = run_cli("status", "--state", state, "--json", "--watch", timeout=60).stdout.splitlines()
    r = json.loads(lines[-1])
    assert r["coordinator"] == url and r["layers_done"] == r["layers_total"] == 4 and r["complete"]
