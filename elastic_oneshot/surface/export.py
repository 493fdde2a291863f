"""The compressed-tensors checkpoint: committed layers plus every other tensor copied from the source.

It is written to OUT.partial next to OUT and moved into place only when complete and loadable (loadable.py). It
never deletes what it did not write: an existing OUT is replaced only if its marker file names this job and it
holds nothing else than the files the marker lists; the previous checkpoint is moved to OUT.old, the new one
moved in, then OUT.old removed.
"""

import errno
import json
import os
import re
import shutil
import uuid

from compressed_tensors.compressors import ModelCompressor
from safetensors import SafetensorError
from safetensors.torch import save_file

from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError, StorageError, UsageError
from elastic_oneshot.loop.job import Job
from elastic_oneshot.models.loadable import check_loadable
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.surface.preflight import check_separate, check_writable

SHARD_BYTES = 5 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".safetensors.index.json")
MARKER = "elastic-oneshot.json"  # in every checkpoint: the job's fingerprint and the files written


def export(state: StateStore, records: Records, output: str, source: SourceModel | None = None,
           schemes: dict | None = None) -> str:
    """Write the checkpoint of the job in `state`, whose commits `records` holds, to `output` (replacing this
    job's previous one); only a finished state can be exported. `source` and `schemes` (the recipe's
    module_schemes), when the run that finished has them."""
    record = state.job()
    job = Job.from_dict(record["job"])
    out, fingerprint = output.rstrip("/") or output, record["fingerprint"]
    check_separate(model=job.model, state=state.root, output=out)
    check_writable(out, "--output", beside=True)
    check_output(out, fingerprint)
    source = source or SourceModel(job.model, job.trust_remote_code, job.attention)
    if source.digest() != record["identity"]["model"]:
        raise UsageError(f"model {job.model} has changed since the state was created")
    quantized = _committed_weights(state, records, record)

    partial = f"{out}.partial"
    if os.path.lexists(partial):
        shutil.rmtree(partial)  # an interrupted export of this job: check_output read its marker
    try:
        _build(partial, fingerprint, source, quantized, job, schemes)
    except (OSError, SafetensorError) as e:  # a full or failing disk: nothing half-written stays behind
        shutil.rmtree(partial, ignore_errors=True)
        raise StorageError(partial, _os_error(e)) from None
    _move_into_place(partial, out, fingerprint)
    return output


def _build(partial: str, fingerprint: str, source: SourceModel, quantized: dict, job: Job, schemes: dict | None):
    """The whole checkpoint in `partial`, its marker first (an interrupted export is known as ours) and last."""
    os.makedirs(partial)
    _write_marker(partial, fingerprint, [])
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
    _write_marker(partial, fingerprint, sorted(set(os.listdir(partial)) - {MARKER}))


def _os_error(e: Exception) -> OSError:
    """safetensors reports a failed write as text ("... (os error 28)"): the OSError it was."""
    if isinstance(e, OSError):
        return e
    code = re.search(r"os error (\d+)", str(e))
    return OSError(int(code.group(1)), os.strerror(int(code.group(1)))) if code else OSError(errno.EIO, str(e))


def check_output(out: str, fingerprint: str):
    """Refuse, before any work, an --output this export may not replace, and leftovers of an interrupted
    export (OUT.partial, OUT.old) that are not this job's."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"--output {out} is a file, not a directory: give a directory path")
    if os.path.isdir(out) and os.listdir(out):
        files = _our_files(out, fingerprint)
        if files is None:
            raise UsageError(f"--output {out} exists and is not this job's checkpoint: give a new --output, "
                             "or move it away")
        extra = sorted(set(os.listdir(out)) - set(files) - {MARKER})
        if extra:
            raise UsageError(f"--output {out} holds files this tool did not write ({', '.join(extra[:3])}): "
                             "move them away")
    for leftover in (f"{out}.partial", f"{out}.old"):
        if os.path.lexists(leftover) and _our_files(leftover, fingerprint) is None:
            raise UsageError(f"{leftover} is in the way of the export and is not this job's: move it away")


def claim_output(out: str, fingerprint: str):
    """Before any work: OUT.partial holding this job's marker, so that a second job started on the same --output
    is refused at its start (by check_output) rather than at its export. Made aside and renamed into place:
    renaming a directory is atomic, so of two jobs claiming at once one wins and the other sees its marker."""
    aside = f"{out}.partial.{uuid.uuid4().hex[:8]}"
    os.makedirs(aside)
    try:
        _write_marker(aside, fingerprint, [])
        if not os.path.lexists(out) and not os.path.lexists(f"{out}.partial"):
            os.rename(aside, f"{out}.partial")
    except OSError:
        pass  # another job claimed it meanwhile: check_output says whose it is
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    check_output(out, fingerprint)


def _our_files(directory: str, fingerprint: str) -> list[str] | None:
    """The files `directory` holds by this job's marker; None if it is not this job's."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("fingerprint") != fingerprint:
        return None
    return list(marker.get("files") or [])


def _write_marker(directory: str, fingerprint: str, files: list[str]):
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump({"files": files, "fingerprint": fingerprint, "written_by": "elastic-oneshot"}, f,
                  indent=1, sort_keys=True)


def _move_into_place(partial: str, out: str, fingerprint: str):
    """OUT.partial becomes OUT; a previous checkpoint of this job goes to OUT.old first, and is removed last."""
    check_output(out, fingerprint)  # again: the export took a while, and OUT is the user's to change meanwhile
    old = f"{out}.old"
    if os.path.lexists(old):
        shutil.rmtree(old)  # this job's, by its marker
    if os.path.isdir(out) and os.listdir(out):
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old)
    else:
        os.replace(partial, out)  # rename(2) also replaces an empty directory


def _committed_weights(state: StateStore, records: Records, record: dict) -> dict:
    quantized: dict = {}
    protocol = CommitProtocol(state, records)
    protocol.view = records.committed()
    for layer in range(record["num_layers"]):
        if layer not in protocol.view:
            raise UsageError(f"layer {layer} of {record['num_layers']} is not committed: "
                             "finish the job with `elastic-oneshot run` first")
        try:
            weights = protocol.weights(layer)
        except CorruptStateError as e:
            raise UsageError(f"layer {layer} failed verification ({e}): rerun `elastic-oneshot run`") from None
        for w in weights:
            quantized.update(state.read_tensors(w))
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
