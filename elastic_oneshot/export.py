"""The compressed-tensors checkpoint: committed layers plus every other tensor copied from the source."""

import json
import os
import shutil

from compressed_tensors.compressors import ModelCompressor
from safetensors.torch import save_file

from .errors import CorruptStateError, UsageError
from .job import Job
from .model import SourceModel
from .state import StateStore

SHARD_BYTES = 5 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".safetensors.index.json")


def export(state: StateStore, output: str, source: SourceModel | None = None) -> str:
    """Write the checkpoint to `output` (replacing it); only a finished state can be exported."""
    record = state.job()
    job = Job.from_dict(record["job"])
    source = source or SourceModel(job.model, job.trust_remote_code, job.attention)
    if source.digest() != record["identity"]["model"]:
        raise UsageError(f"model {job.model} has changed since the state was created")

    quantized: dict = {}
    committed = state.records.committed()
    for layer in range(record["num_layers"]):
        if layer not in committed:
            raise UsageError(f"layer {layer} of {record['num_layers']} is not committed: "
                             "finish the job with `elastic-oneshot run` first")
        try:
            manifest = state.verify(layer, committed[layer])
        except CorruptStateError as e:
            raise UsageError(f"layer {layer} failed verification ({e}): rerun `elastic-oneshot run`") from None
        for w in manifest["weights"]:
            quantized.update(state.read_tensors(w))
    replaced = {k.rsplit(".", 1)[0] + ".weight" for k in quantized}

    tmp = f"{output.rstrip('/')}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    names = sorted([n for n in source.weight_map if n not in replaced] + list(quantized))
    shards, current, size = [], {}, 0
    for name in names:
        tensor = quantized[name] if name in quantized else source.read([name])[name]
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
        save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)

    for fname in sorted(os.listdir(source.path)):
        src = os.path.join(source.path, fname)
        if os.path.isfile(src) and fname != "config.json" and not fname.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(src, os.path.join(tmp, fname))
    shutil.copyfile(os.path.join(source.path, "config.json"), os.path.join(tmp, "config.json"))
    ModelCompressor(quantization_config=job.recipe.quantization_config(source.skeleton)).update_config(tmp)

    if os.path.exists(output):
        old = f"{output.rstrip('/')}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(output, old)
        os.replace(tmp, output)
        shutil.rmtree(old)
    else:
        os.replace(tmp, output)
    return output
