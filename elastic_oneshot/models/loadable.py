"""The guard against silent corruption: a written checkpoint has every Linear of the source quantized or listed in
`ignore`, and transformers loads it with nothing missing and nothing unexpected.

Checked from the shards' headers and the model that transformers' loader builds for the written config (on the
meta device, its quantization applied, its checkpoint conversions renaming the written names), without reading
a weight: an export that would load with uninitialized modules fails instead of exiting 0.
"""

import contextlib
import io
import json
import os
import types

import torch
import transformers
from compressed_tensors.quantization import QuantizationConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, rename_source_key
from transformers.quantizers.auto import get_hf_quantizer

from elastic_oneshot.errors import UsageError
from elastic_oneshot.models.family import family_for
from elastic_oneshot.models.source import SourceModel, _read_header


def check_loadable(directory: str, source: SourceModel, quantization: QuantizationConfig | None,
                   trust_remote_code: bool = False):
    """Refuse the checkpoint in `directory` (written from `source` with `quantization`; None: a recipe that
    quantizes nothing), naming what is wrong."""
    written = set()
    for fname in sorted(os.listdir(directory)):
        if fname.endswith(".safetensors"):
            written.update(json.loads(_read_header(os.path.join(directory, fname))))
    written.discard("__metadata__")
    ignored = set(quantization.ignore or ()) if quantization is not None else None
    unquantized = [name for name, m in source.skeleton.named_modules() if isinstance(m, torch.nn.Linear)
                   and ignored is not None and name not in ignored
                   and source.stored_name(f"{name}.weight_scale") not in written]
    if unquantized:
        _fail(directory, f"{len(unquantized)} Linear modules neither quantized nor in ignore", unquantized)
    model, quantizer = _loader_model(directory, trust_remote_code)
    missing, unexpected = _load_keys(model, quantizer, written)
    if missing:
        _fail(directory, f"transformers would find {len(missing)} tensors missing", missing)
    if unexpected:
        _fail(directory, f"transformers would find {len(unexpected)} tensors unexpected", unexpected)
    try:  # as the loader initializes what it did not load: a quantized module may lack what that expects
        model.initialize_weights()
    except AttributeError as e:
        _fail(directory, "transformers cannot initialize the model it describes", [str(e)])


def load_keys(directory: str, names: set[str], trust_remote_code: bool = False) -> tuple[list[str], list[str]]:
    """The keys transformers' `from_pretrained(directory)` would report missing and unexpected, were the
    checkpoint's tensors `names`: its names renamed by the model's conversions, against the state dict of the
    model built as the loader builds it (tied weights count as present when their source is)."""
    return _load_keys(*_loader_model(directory, trust_remote_code), names)


def _loader_model(directory: str, trust_remote_code: bool):
    """The model that transformers' loader builds for the checkpoint in `directory`, on the meta device, with its
    quantizer (which has applied the checkpoint's quantization to it)."""
    config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    quantizer, config, _ = get_hf_quantizer(config, None, None, True, {})
    with torch.device("meta"), contextlib.redirect_stderr(io.StringIO()):  # compressed-tensors' progress bars
        model = family_for(config).auto_class(config).from_config(config, trust_remote_code=trust_remote_code)
        if quantizer is not None:
            quantizer.preprocess_model(model=model, dtype=model.dtype, device_map=None, checkpoint_files=None,
                                       use_kernels=False)
    return model, quantizer


def _load_keys(model, quantizer, names: set[str]) -> tuple[list[str], list[str]]:
    expected = model.state_dict()
    transforms = get_model_conversion_mapping(model, None, quantizer)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    loaded = {rename_source_key(n, renamings, converters, model.base_model_prefix, expected)[0] for n in names}
    for key in loaded & expected.keys():  # marked as the loader marks what it loaded: initialization skips them
        model.get_parameter_or_buffer(key)._is_hf_initialized = True
    tied = model.all_tied_weights_keys or {}
    info = types.SimpleNamespace(
        missing_keys={k for k in expected if k not in loaded and tied.get(k) not in loaded},
        unexpected_keys=loaded - expected.keys())
    model._adjust_missing_and_unexpected_keys(info)  # the model's own exceptions, as the loader applies them
    return sorted(info.missing_keys), sorted(info.unexpected_keys)


def _fail(directory: str, what: str, names: list[str]):
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    raise UsageError(f"the checkpoint written to {directory} is not usable ({what}: {shown}), so it was not "
                     "moved into place: a bug of elastic-oneshot for this architecture, please report it")
