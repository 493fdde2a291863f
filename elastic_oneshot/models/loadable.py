"""The guard against silent corruption: a written checkpoint has every Linear of the source quantized or listed in
`ignore`, and transformers loads it with nothing missing and nothing unexpected, as a new process loads it.

Checked from the shards' headers and the model that transformers' loader builds for the written config (on the
meta device, its quantization applied, its checkpoint conversions renaming the written names), without reading
a weight: an export that would load with uninitialized modules fails instead of exiting 0. The one change this
process made to transformers is the conversions `Family.teach_loader` registered, for types whose experts are stored
fused (GPT-OSS, the Granite MoEs, Gemma 4 MoE): compressed-tensors quantizes Linear modules, so their quantized
experts are written one by one, and transformers has no converter from those to its fused experts. A new process
loads such a checkpoint after `elastic_oneshot.teach_transformers(path)`, and only then: the guard says so in the
log and in the checkpoint's README.md (tests/test_architectures.py loads every type in a new process).
"""

import contextlib
import copy
import functools
import io
import json
import logging
import os
import types
from collections.abc import Callable

import torch
import transformers
from compressed_tensors.quantization import QuantizationConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter
from transformers.quantizers.auto import get_hf_quantizer

from elastic_oneshot.errors import UsageError
from elastic_oneshot.models import stored_names
from elastic_oneshot.models.family import family_for
from elastic_oneshot.models.source import SourceModel, _read_header

log = logging.getLogger("elastic_oneshot")


def check_loadable(directory: str, source: SourceModel, quantization: QuantizationConfig | None,
                   trust_remote_code: bool = False):
    """Refuse the checkpoint in `directory` (written from `source` with `quantization`; None: a recipe that
    quantizes nothing), naming what is wrong."""
    written = set()
    for fname in sorted(os.listdir(directory)):
        if fname.endswith(".safetensors"):
            written.update(json.loads(_read_header(os.path.join(directory, fname))))
    written.discard("__metadata__")
    check_names(directory, source, written, quantization, functools.partial(_fail, directory), trust_remote_code)
    if stored_names.taught(source.skeleton.config.model_type):
        _say_how_to_load(directory, source.skeleton.config.model_type, family_for(source.config).auto_class(
            source.config).__name__)


def check_names(directory: str, source: SourceModel, names: set[str], quantization: QuantizationConfig | None,
                fail: Callable[[str, list[str]], None], trust_remote_code: bool = False):
    """The guard's checks of a checkpoint of `source` whose config is in `directory` and whose tensors are `names`
    (as written, or as the export would write them: exportable.py): `fail(what, names)` on the first that fails."""
    ignored = set(quantization.ignore or ()) if quantization is not None else None  # None: nothing quantized
    unquantized = [name for name, m in source.skeleton.named_modules() if isinstance(m, torch.nn.Linear)
                   and ignored is not None and name not in ignored
                   and source.stored_name(f"{name}.weight_scale") not in names]
    if unquantized:
        fail(f"{len(unquantized)} Linear modules neither quantized nor in ignore", unquantized)
    model, quantizer = _loader_model(directory, trust_remote_code)
    missing, unexpected = _load_keys(model, quantizer, names)
    if missing:
        fail(f"transformers would find {len(missing)} tensors missing", missing)
    if unexpected:
        fail(f"transformers would find {len(unexpected)} tensors unexpected", unexpected)
    try:  # as the loader initializes what it did not load: a quantized module may lack what that expects
        model.initialize_weights()
    except AttributeError as e:
        fail("transformers cannot initialize the model it describes", [str(e)])


def load_keys(directory: str, names: set[str], trust_remote_code: bool = False) -> tuple[list[str], list[str]]:
    """The keys transformers' `from_pretrained(directory)` would report missing and unexpected, were the
    checkpoint's tensors `names`: its names renamed by the model's conversions, against the state dict of the
    model built as the loader builds it (tied weights count as present when their source is)."""
    return _load_keys(*_loader_model(directory, trust_remote_code), names)


def _loader_model(directory: str, trust_remote_code: bool):
    """The model that transformers' loader builds for the checkpoint in `directory`, on the meta device, with its
    quantizer (which has applied the checkpoint's quantization to it). A copy of the one built last where the
    checkpoint's config and code are the same bytes: the check before any work and the export's guard build the
    same model, which costs more than a data-free pass's layers on a small model."""
    key = (trust_remote_code, *((fname, _bytes(os.path.join(directory, fname))) for fname in
                                sorted(os.listdir(directory)) if fname == "config.json" or fname.endswith(".py")))
    if _BUILT.get("key") != key:
        _BUILT.clear()
        _BUILT.update(key=key, built=_build_loader_model(directory, trust_remote_code))
    return copy.deepcopy(_BUILT["built"])  # the checks mark the model's tensors and modules initialized


_BUILT: dict = {}  # the last loader model built: its key, (model, quantizer)


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _build_loader_model(directory: str, trust_remote_code: bool):
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
    loaded = {stored_names.loaded_name(n, renamings, converters, model.base_model_prefix, expected)[0] for n in names}
    for key in loaded & expected.keys():  # marked as the loader marks what it loaded: initialization skips them
        model.get_parameter_or_buffer(key)._is_hf_initialized = True
    tied = model.all_tied_weights_keys or {}
    info = types.SimpleNamespace(
        missing_keys={k for k in expected if k not in loaded and tied.get(k) not in loaded},
        unexpected_keys=loaded - expected.keys())
    model._adjust_missing_and_unexpected_keys(info)  # the model's own exceptions, as the loader applies them
    return sorted(info.missing_keys), sorted(info.unexpected_keys)


def _say_how_to_load(directory: str, model_type: str, auto_class: str):
    """A checkpoint that transformers loads only once taught: how, in its README.md (after the model card the
    source had, if any) and in the log."""
    how = ("import elastic_oneshot, transformers\n"
           "elastic_oneshot.teach_transformers(path)  # path: this directory\n"
           f"model = transformers.{auto_class}.from_pretrained(path)\n")
    readme = os.path.join(directory, "README.md")
    after = "\n" if os.path.exists(readme) else ""  # the source's model card, copied
    with open(readme, "a") as f:
        f.write(f"{after}## Loading this checkpoint in transformers\n\nThe experts of `{model_type}` are written one "
                f"by one (compressed-tensors quantizes Linear modules), and transformers {transformers.__version__} "
                "has no converter from those to its fused experts: loaded as it is, the experts would be missing "
                "(randomly initialized) and every expert tensor unexpected. In the process that loads it, teach "
                f"transformers first (with elastic-oneshot installed):\n\n```python\n{how}```\n")
    log.warning("transformers loads this %s checkpoint only once taught, in the process that loads it: "
                "elastic_oneshot.teach_transformers(path) before %s.from_pretrained(path) (its README.md says so)",
                model_type, auto_class)


def _fail(directory: str, what: str, names: list[str]):
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    raise UsageError(f"the checkpoint written to {directory} is not usable ({what}: {shown}), so it was not "
                     "moved into place: a bug of elastic-oneshot for this architecture, please report it")
