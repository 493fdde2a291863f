"""A model family added as one file. A made-up model type, `blocks_llama` (a Llama whose decoder keeps its layers
under `blocks`, registered with transformers here as a new architecture would come), is refused by the generic
adapter, which cannot guess where its layers are; with its adapter, tests/blocks_family.py, loaded and nothing
else changed, it passes the sweep's checks: compressed with GPTQ everywhere, loaded by transformers in a fresh
interpreter (that runs the architecture's own code, tests/blocks_model.py, and nothing of elastic_oneshot) with
nothing missing or unexpected, generating, closer to the original than round-to-nearest."""

import importlib.util
import logging
import os
import runpy

import pytest
import torch
import transformers

from elastic_oneshot import oneshot
from elastic_oneshot.errors import UsageError
from elastic_oneshot.models import family
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.surface.cli import main
from elastic_oneshot.testing.runs import SWEEP, assert_solved, check_compressed, packed_modules
from elastic_oneshot.testing.tiny import make_tiny

ADAPTER = os.path.join(os.path.dirname(__file__), "blocks_family.py")
MODEL = os.path.join(os.path.dirname(__file__), "blocks_model.py")  # registers blocks_llama with transformers
runpy.run_path(MODEL)


@pytest.fixture
def unregistered():
    """The made-up family is known only to this test."""
    yield
    family.FAMILIES.pop("blocks_llama", None)


def test_a_family_added_as_one_file_passes_the_sweep(tmp_path, caplog, unregistered):
    caplog.set_level(logging.INFO, "elastic_oneshot")
    model = make_tiny(str(tmp_path / "blocks_llama"), "blocks_llama")
    with pytest.raises(UsageError, match=r"its decoder BlocksModel has no stack of layers \(\.layers\)"):
        SourceModel(model)

    spec = importlib.util.spec_from_file_location("blocks_family", ADAPTER)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    source = SourceModel(model)
    assert type(source.family).__name__ == "BlocksLlama" and source.layer_prefix == "model.blocks."
    out = oneshot(model=model, output_dir=str(tmp_path / "out"), **SWEEP)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    linears = {n for n, m in source.skeleton.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert packed_modules(out) == linears and len(linears) == 2 * 7
    assert_solved(out, linears)
    err, err_rtn = check_compressed(model, out, prelude=MODEL)  # the architecture's code, then transformers alone
    assert 0 < err < err_rtn


class RaisingLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    def forward(self, hidden_states, **kwargs):
        raise RuntimeError("a made-up kernel that cannot run here")


class RaisingConfig(transformers.LlamaConfig):
    model_type = "raising_llama"


class RaisingForCausalLM(transformers.LlamaForCausalLM):
    """A Llama whose decoder layers raise when called (as a type whose layers the loop cannot drive would)."""

    config_class = RaisingConfig

    def __init__(self, config):
        super().__init__(config)
        self.model.layers = torch.nn.ModuleList(RaisingLayer(config, i) for i in range(config.num_hidden_layers))
        self.post_init()


transformers.AutoConfig.register("raising_llama", RaisingConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(RaisingConfig, RaisingForCausalLM, exist_ok=True)


def test_a_decoder_whose_layer_call_fails_is_refused_before_any_work(tmp_path, capsys):
    model = make_tiny(str(tmp_path / "raising_llama"), "raising_llama")
    out = tmp_path / "out"
    capsys.readouterr()  # what saving the model printed
    code = main(["run", "--model", model, "--output", str(out), "--num-samples", "8", "--seq-len", "32",
                 "--group-size", "32"])  # the signal mask it leaves is restored by conftest
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(errors) == 1, errors
    assert errors[0] == ("elastic-oneshot: error: architecture RaisingForCausalLM (model_type 'raising_llama') is not "
                         "supported: a trial of its first decoder layer fails in forward (test_families.py:"
                         f"{RaisingLayer.forward.__code__.co_firstlineno + 1}): RuntimeError: a made-up kernel that "
                         "cannot run here")
    assert not os.path.exists(tmp_path / "out.state" / "commits") and not os.path.exists(out)
    assert not os.path.exists(tmp_path / "out.partial")
