"""The export streams: its shards are the ones the whole-in-memory export wrote, byte for byte, while it holds one
layer and one shard; at the end of a run it is the one read of the committed layers, and finds every damaged one."""

import collections
import json
import logging
import os
import re
import shutil
import types
import weakref

import pytest
import transformers
from safetensors.torch import save_file

from elastic_oneshot import oneshot
from elastic_oneshot.durability.coordinator import open_records
from elastic_oneshot.durability.destination import open_destination
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.state import StateStore, read_events
from elastic_oneshot.errors import UsageError
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.surface import export as export_module
from elastic_oneshot.surface.export import export, shards
from elastic_oneshot.testing.runs import tree_digest
from elastic_oneshot.testing.tiny import make_model

JOB = dict(num_calibration_samples=8, max_seq_length=64, chunk_size=4, boundary_every=0)
SHARD = 200_000  # a tenth or so of the tiny checkpoint: several shards, and layers that straddle them


def run_job(root, layers: int, scheme: str, **options):
    """A finished job on a tiny Llama with shards of SHARD bytes, counting how often each state file is read."""
    model = make_model(str(root / "model"), "llama", num_hidden_layers=layers)
    reads, read_bytes = collections.Counter(), StateStore.read_bytes

    def counted(self, record):
        reads[record["path"]] += 1
        return read_bytes(self, record)

    out, state = str(root / "out"), str(root / "state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export_module, "SHARD_BYTES", SHARD)
        patch.setattr(StateStore, "read_bytes", counted)
        oneshot(model=model, output_dir=out, state_dir=state, scheme=scheme, **JOB, **options)
    return types.SimpleNamespace(model=model, out=out, state=state, reads=reads, options={"scheme": scheme, **options})


@pytest.fixture(scope="module")
def llama11(tmp_path_factory):
    """Eleven layers, so that names sort layer 1, 10, 2, ..."""
    return run_job(tmp_path_factory.mktemp("llama11"), 11, "W4A16", group_size=64)


@pytest.fixture(scope="module")
def llama3_fp8(tmp_path_factory):
    """FP8 keeps `weight` and adds `input_scale`, which sorts before it."""
    return run_job(tmp_path_factory.mktemp("fp8"), 3, "FP8")


def protocol_of(state: str) -> CommitProtocol:
    store = StateStore(state)
    records = open_records(store)
    return CommitProtocol(store, records, records.committed())


def whole_in_memory(job, directory: str):
    """The export's weights as they were written before it streamed: every quantized tensor, then every shard, in
    memory, then written."""
    protocol, source = protocol_of(job.state), SourceModel(job.model)
    quantized = {}
    for layer in range(source.num_layers):
        quantized.update({source.stored_name(k): v for k, v in protocol.tensors(layer).items()})
    replaced = {k.rsplit(".", 1)[0] + ".weight" for k in quantized}
    names = sorted([n for n in source.weight_map if n not in replaced] + list(quantized))
    split, current, size = [], {}, 0
    for name in names:
        tensor = quantized[name] if name in quantized else source.read_stored([name])[name]
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SHARD:
            split.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    split.append(current)
    os.makedirs(directory)
    weight_map = {}
    for i, shard in enumerate(split):
        fname = "model.safetensors" if len(split) == 1 else f"model-{i + 1:05d}-of-{len(split):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for s in split for t in s.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def weights(directory: str) -> dict[str, str]:
    digests = tree_digest(directory)
    return {name: digest for name, digest in digests.items() if name.startswith("model")}


def test_shards_fill_in_name_order_and_a_larger_tensor_goes_alone():
    sized = [("a", 40), ("b", 50), ("c", 10), ("d", 150), ("e", 1), ("f", 100)]
    assert [list(s) for s in shards(sized, 100, size=int)] == [["a", "b", "c"], ["d"], ["e"], ["f"]]
    assert list(shards([], 100, size=int)) == [{}]


@pytest.mark.parametrize("name", ["llama11", "llama3_fp8"])
def test_the_streamed_export_writes_the_shards_of_the_whole_in_memory_one(name, request, tmp_path):
    job = request.getfixturevalue(name)
    whole_in_memory(job, str(tmp_path / "whole"))
    written = weights(job.out)
    assert len(written) > 3 and "model.safetensors.index.json" in written
    assert written == weights(str(tmp_path / "whole"))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(job.out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_the_end_of_a_run_reads_each_committed_file_once(llama11):
    protocol = protocol_of(llama11.state)
    committed = {r["path"] for layer in protocol.view for r in protocol.manifest(layer)["weights"]}
    assert {path: n for path, n in llama11.reads.items() if path.startswith("layers/")} == dict.fromkeys(committed, 1)


def test_the_export_holds_one_layer_and_one_shard(llama11, tmp_path, monkeypatch):
    """Every tensor the export reads (a committed layer's, or the source's) is followed until it is let go: when a
    layer is read or a shard written, no more than a shard, a layer and one tensor besides are alive (before, every
    quantized tensor was)."""
    layers = [protocol_of(llama11.state).tensors(layer) for layer in range(11)]
    layer_bytes = max(sum(t.nbytes for t in layer.values()) for layer in layers)
    largest = max(t.nbytes for t in SourceModel(llama11.model).read_stored(["model.embed_tokens.weight"]).values())
    quantized_bytes = sum(t.nbytes for layer in layers for t in layer.values())
    del layers
    followed, peaks = [], []

    def alive() -> int:
        return sum(nbytes for ref, nbytes in followed if ref() is not None)

    def follow(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            followed.extend((weakref.ref(t), t.nbytes) for t in out.values())
            peaks.append(alive())
            return out
        return wrapped

    def saved(shard, *args, **kwargs):
        peaks.append(alive())
        save_file(shard, *args, **kwargs)

    monkeypatch.setattr(export_module, "SHARD_BYTES", SHARD)
    monkeypatch.setattr(CommitProtocol, "tensors", follow(CommitProtocol.tensors))
    monkeypatch.setattr(SourceModel, "read_stored", follow(SourceModel.read_stored))
    monkeypatch.setattr(export_module, "save_file", saved)
    store = StateStore(llama11.state)
    export(store, open_records(store), open_destination(str(tmp_path / "out")))
    assert weights(str(tmp_path / "out")) == weights(llama11.out)
    assert max(peaks) <= SHARD + layer_bytes + largest < quantized_bytes, (max(peaks), layer_bytes)


def test_every_layer_damaged_after_its_commit_is_found_by_the_one_read_and_redone_at_once(llama11, tmp_path,
                                                                                          caplog):
    """Flipped bytes keep a file's size, so a restart does not see them: the export at the end of the run does,
    reads the other layers on to find every damaged one, and they are redone in one new epoch. The standalone
    export refuses such a state in one line, leaving nothing behind."""
    state = str(tmp_path / "state")
    shutil.copytree(llama11.state, state)
    protocol = protocol_of(state)
    for layer in (1, 7):
        path = os.path.join(state, protocol.manifest(layer)["weights"][0]["path"])
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\xde\xad\xbe\xef")
    store = StateStore(state)
    with pytest.raises(UsageError, match=r"layer 1 failed verification \(.* does not match its checksum\): rerun"):
        export(store, open_records(store), open_destination(str(tmp_path / "refused")))
    assert not os.path.exists(tmp_path / "refused") and not os.path.exists(tmp_path / "refused.partial")

    with caplog.at_level(logging.INFO, logger="elastic_oneshot"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(export_module, "SHARD_BYTES", SHARD)
        oneshot(model=llama11.model, output_dir=str(tmp_path / "out"), state_dir=state, **JOB, **llama11.options)
    assert re.findall(r"layer (\d+) will be redone: layers/\d+/\S+ does not match its checksum", caplog.text) == \
        ["1", "7"]
    redone = [(e["layer"], e["epoch"]) for e in read_events(state) if e["event"] == "commit" and e["epoch"] > 1]
    assert redone == [(1, 3), (7, 3)]
    assert tree_digest(str(tmp_path / "out")) == tree_digest(llama11.out)
