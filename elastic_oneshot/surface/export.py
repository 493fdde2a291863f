"""The compressed-tensors checkpoint: committed layers plus every other tensor copied from the source.

It is built whole in a local directory that its destination lends (destination.py: OUT.partial beside a local OUT,
or a temporary directory for an object-store prefix), and published only when complete and loadable (loadable.py).
Its marker goes in first (an interrupted export is known as the job's) and is rewritten last with every file.
"""

import errno
import json
import os
import re
import shutil

from compressed_tensors.compressors import ModelCompressor
from safetensors import SafetensorError
from safetensors.torch import save_file

from elastic_oneshot.durability.destination import MARKER, Destination, write_marker
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError, StorageError, UsageError
from elastic_oneshot.loop.job import Job
from elastic_oneshot.models.loadable import check_loadable
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.surface.preflight import check_separate

SHARD_BYTES = 5 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".safetensors.index.json")


def export(state: StateStore, records: Records, destination: Destination, source: SourceModel | None = None,
           schemes: dict | None = None, protocol: CommitProtocol | None = None):
    """Write the checkpoint of the job in `state`, whose commits `records` holds, to `output` (replacing this
    job's previous one); only a finished state can be exported. `source`, `schemes` (the recipe's
    module_schemes) and `protocol` (holding the files its last check read back), when the run that finished has
    them."""
    record = state.job()
    job = Job.from_dict(record["job"])
    fingerprint = record["fingerprint"]
    check_separate(model=job.model, state=state.root, output=destination.local)
    destination.preflight()
    destination.check(fingerprint, state.root)
    source = source or SourceModel(job.model, job.trust_remote_code, job.attention)
    if source.digest() != record["identity"]["model"]:
        raise UsageError(f"model {job.model} has changed since the state was created")
    quantized = _committed_weights(protocol or CommitProtocol(state, records, records.committed()), record)
    with destination.building(fingerprint) as built:  # removed if anything fails: nothing half-written stays
        try:
            _build(built, fingerprint, source, quantized, job, schemes)
        except (OSError, SafetensorError) as e:  # a full or failing disk
            raise StorageError(built, _os_error(e)) from None
        destination.publish(built, fingerprint)


def _build(partial: str, fingerprint: str, source: SourceModel, quantized: dict, job: Job, schemes: dict | None):
    """The whole checkpoint in `partial`, its marker first (an interrupted export is known as ours) and last."""
    os.makedirs(partial)
    write_marker(partial, fingerprint, [])
    _write_weights(partial, source, quantized)
    for fname in sorted(os.listdir(source.path)):
        src = os.path.join(source.path, fname)
        if os.path.isfile(src) and fname not in ("config.json", MARKER) and not fname.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(src, os.path.join(partial, fname))
    shutil.copyfile(os.path.join(source.path, "config.json"), os.path.join(partial, "config.json"))
    if schemes is None:
        schemes = job.recipe.module_schemes(source.skeleton, source.family)
    quantization = job.recipe.quantization_config(source.skeleton, schemes)
    ModelCompressor(quantization_config=quantization).update_config(partial)
    check_loadable(partial, source, quantization, job.trust_remote_code)
    write_marker(partial, fingerprint, sorted(set(os.listdir(partial)) - {MARKER}))


def _os_error(e: Exception) -> OSError:
    """safetensors reports a failed write as text ("... (os error 28)"): the OSError it was."""
    if isinstance(e, OSError):
        return e
    code = re.search(r"os error (\d+)", str(e))
    return OSError(int(code.group(1)), os.strerror(int(code.group(1)))) if code else OSError(errno.EIO, str(e))


def _committed_weights(protocol: CommitProtocol, record: dict) -> dict:
    quantized: dict = {}
    for layer in range(record["num_layers"]):
        if layer not in protocol.view:
            raise UsageError(f"layer {layer} of {record['num_layers']} is not committed: "
                             "finish the job with `elastic-oneshot run` first")
        try:
            quantized.update(protocol.tensors(layer))
        except CorruptStateError as e:
            raise UsageError(f"layer {layer} failed verification ({e}): rerun `elastic-oneshot run`") from None
    return quantized


def _write_weights(directory: str, source: SourceModel, quantized: dict):
    """The source's tensors with the quantized ones in place of the weights they replace, in shards, under the
    names the source stores them by."""
    quantized = {source.stored_name(k): v for k, v in quantized.items()}
    replaced = {k.rsplit(".", 1)[0] + ".weight" for k in quantized}
    names = sorted([n for n in source.weight_map if n not in replaced] + list(quantized))
    shards, current, size = [], {}, 0
    for name in names:
        tensor = quantized[name] if name in quantized else source.read_stored([name])[name]
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
