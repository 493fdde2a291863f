"""Before any work: what the export's guard (loadable.py) checks that does not depend on the compressed weights.

The export writes, under the names the source stores them by, every tensor of the source but the weights of the
quantized modules, and for each of those the tensors its scheme is written as (weight_packed, weight_scale, ...). Those
names are known at the start, and so is what transformers would make of them: every Linear is quantized or ignored,
and the model transformers' loader builds for the checkpoint's config (its quantization applied) finds every tensor
it needs, under the names its conversions give the written ones (stored names resolved both ways), none it does not
know, and can initialize what it did not load (loadable.check_names, the guard's own checks). A model that fails here
would fail the guard after every layer was compressed: it is refused now.
"""

import functools
import os
import shutil
import tempfile
from collections.abc import Callable

from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

from elastic_oneshot.models.loadable import check_names
from elastic_oneshot.models.source import SourceModel


def written_names(source: SourceModel, schemes: dict[str, QuantizationScheme],
                  leaves: Callable[[QuantizationScheme], tuple[str, ...]]) -> set[str]:
    """The names of the tensors the export writes for `source` with `schemes` (each quantized module's, by its
    full name), each module of a scheme written as the local names `leaves(scheme)` (packing.written_names)."""
    names = set(source.weight_map)
    for module, scheme in schemes.items():
        names.discard(source.stored_name(f"{module}.weight"))
        names.update(source.stored_name(f"{module}.{leaf}") for leaf in leaves(scheme))
    return names


def check_exportable(source: SourceModel, schemes: dict[str, QuantizationScheme],
                     quantization: QuantizationConfig | None,
                     leaves: Callable[[QuantizationScheme], tuple[str, ...]], trust_remote_code: bool = False):
    """Refuse, before any work, a model whose compressed checkpoint the export's guard would refuse by its names."""
    with tempfile.TemporaryDirectory() as config_dir:  # the checkpoint's config (and the model's code, if any)
        for fname in os.listdir(source.path):
            if fname == "config.json" or fname.endswith(".py"):
                shutil.copyfile(os.path.join(source.path, fname), os.path.join(config_dir, fname))
        if quantization is not None:  # None: a recipe that quantizes nothing writes no quantization_config
            ModelCompressor(quantization_config=quantization).update_config(config_dir)
        check_names(config_dir, source, written_names(source, schemes, leaves), quantization,
                    functools.partial(_refuse, source), trust_remote_code)


def _refuse(source: SourceModel, what: str, names: list[str]):
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    source.refuse(f"its compressed checkpoint could not be loaded ({what}: {shown}), so it is refused before any "
                  "work: a bug of elastic-oneshot for this architecture, please report it")
