"""The compressed-tensors checkpoint: committed layers plus every other tensor copied from the source.

It is built whole in a local directory that its destination lends (destination.py: OUT.partial beside a local OUT,
or a temporary directory for an object-store prefix), and published only when complete and loadable (loadable.py).
Its marker goes in first (an interrupted export is known as the job's) and is rewritten last with every file.

The weights stream, so that host memory does not grow with depth (it held the whole compressed model before): tensors
go out in name order, in which each decoder layer's names are contiguous; each committed layer is read, against its
digests, when the walk reaches it, and each shard is written as soon as it is full, under a temporary name until
their count is known. At most one layer and one shard are held. At the end of a run this is the one read of the
compressed model, and the run's last check (`Export`): a layer damaged since its commit is redone, then exported.
A job without calibration data, whose cost is its I/O, is laid out a shard per layer instead, so that a layer's
commit can be its shard, linked rather than written again (`_by_layer`).
"""

import contextlib
import dataclasses
import errno
import heapq
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator

import torch
from compressed_tensors.compressors import ModelCompressor
from safetensors import SafetensorError
from safetensors.torch import save_file

from elastic_oneshot.durability import tensor_bytes
from elastic_oneshot.durability.destination import MARKER, Destination, write_marker
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError, StorageError, UsageError
from elastic_oneshot.loop import model_check
from elastic_oneshot.loop.job import Job
from elastic_oneshot.loop.passes import SCALES
from elastic_oneshot.models.content import Content
from elastic_oneshot.models.loadable import check_loadable
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.surface.preflight import check_separate

SHARD_BYTES = 5 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".safetensors.index.json")


def export(state: StateStore, records: Records, destination: Destination, source: SourceModel | None = None,
           schemes: dict | None = None):
    """`elastic-oneshot export`: the checkpoint of the finished job in `state`, whose commits `records` holds."""
    with Export(state, destination, source, schemes) as build:
        build.weights(CommitProtocol(state, records, records.committed()))
        build.finish()


class Export:
    """The checkpoint of the job in `state` for `destination` (replacing this job's previous one), built in two
    steps inside `with`, which removes what is half-built if anything fails: `weights` streams the committed layers
    (each read once, against its digests) and the source's other tensors into shards; `finish` adds the other files,
    checks that transformers would load the checkpoint, and puts it in place.

    At the end of a run, `weights` is the run's last step, on rank 0, so that a layer damaged since its commit is
    redone (then `weights` again); `finish` follows once the ranks have left the process group: its check builds the
    model through compressed-tensors, which runs collectives of its own on an initialized one. `source` and
    `schemes` (the recipe's module_schemes) when the run has them. With `repair` (the run's), a damaged layer raises
    CorruptStateError once every other layer is read too, each damaged one marked in the protocol for the next
    `verified` to leave out; without it, the first is a UsageError that says to rerun `run`."""

    def __init__(self, state: StateStore, destination: Destination, source: SourceModel | None = None,
                 schemes: dict | None = None, repair: bool = False):
        self.state, self.destination, self.repair = state, destination, repair
        self.source, self.schemes = source, schemes
        self.partial: str | None = None  # where it is built, once `weights` has begun
        self._building = contextlib.ExitStack()

    def __enter__(self) -> "Export":
        return self

    def __exit__(self, *exc) -> bool:
        return self._building.__exit__(*exc)

    def weights(self, protocol: CommitProtocol):
        """The weights, from the committed layers of `protocol.view` (only a finished job can be exported)."""
        if self.partial is None:
            self._check()
        for layer in range(self.num_layers):
            if layer not in protocol.view:
                raise UsageError(f"layer {layer} of {self.num_layers} is not committed: "
                                 "finish the job with `elastic-oneshot run` first")
        content = Content(self.source)
        stats = _same_content(content, protocol)
        if self.partial is None:
            self.partial = self._building.enter_context(self.destination.building(self.fingerprint))
        shutil.rmtree(self.partial, ignore_errors=True)  # an earlier attempt's, whose damaged layers are redone
        read: set[int] = set()

        def layer_files(layer: int) -> list[tuple[dict, bytes]]:
            read.add(layer)
            try:
                return protocol.files(layer)
            except CorruptStateError as e:
                if self.repair:
                    raise
                raise UsageError(f"layer {layer} failed verification ({e}): rerun `elastic-oneshot run`") from None

        def layer_tensors(layer: int) -> dict:
            return {name: t for _, data in layer_files(layer) for name, t in tensor_bytes.load(data).items()}

        local = protocol.state.local is not None
        try:
            with _writing(self.partial):
                os.makedirs(self.partial)
                write_marker(self.partial, self.fingerprint, [])  # an interrupted export is known as ours
            if self.job.recipe.calibrates:
                out = shards(_tensors(self.source, _starts(self.source, self.schemes, self.num_layers),
                                      layer_tensors), SHARD_BYTES)
            else:
                out = _by_layer(self.source, self.num_layers, layer_files,
                                lambda record: protocol.state.path(record["path"]) if local else None)
            _write_weights(self.partial, out)
            if content.stats() != stats:
                raise UsageError(f"the model's files changed during the export ({self.source.path}): export again "
                                 "once they are settled")
        except CorruptStateError:  # every damaged layer is found in this one read, to be redone at once
            shutil.rmtree(self.partial, ignore_errors=True)
            for layer in sorted(set(range(self.num_layers)) - read):
                with contextlib.suppress(CorruptStateError):
                    protocol.tensors(layer)
            raise

    def finish(self):
        """The other files beside the weights, the guard (loadable.py), the marker again with every file, and the
        checkpoint in place."""
        partial, source, job = self.partial, self.source, self.job
        with _writing(partial):
            for fname in sorted(os.listdir(source.path)):
                src = os.path.join(source.path, fname)
                if os.path.isfile(src) and fname not in ("config.json", MARKER) and \
                        not fname.endswith(WEIGHT_SUFFIXES):
                    shutil.copyfile(src, os.path.join(partial, fname))
            shutil.copyfile(os.path.join(source.path, "config.json"), os.path.join(partial, "config.json"))
            quantization = job.recipe.quantization_config(source.skeleton, self.schemes)
            if quantization is not None:  # a recipe without a quantizer writes a dense checkpoint, as the peer's
                ModelCompressor(quantization_config=quantization).update_config(partial)
            check_loadable(partial, source, quantization, job.trust_remote_code)
            write_marker(partial, self.fingerprint, sorted(set(os.listdir(partial)) - {MARKER}))
        self.destination.publish(partial, self.fingerprint)

    def _check(self):
        """Before anything is written: the state, the destination and the model."""
        record = self.state.job()
        self.job, self.fingerprint, self.num_layers = Job.from_dict(record["job"]), record["fingerprint"], \
            record["num_layers"]
        check_separate(model=self.job.model, state=self.state.local, output=self.destination.local)
        self.destination.preflight()
        self.destination.check(self.fingerprint, self.state.root)
        job = self.job
        self.source = self.source or SourceModel(job.model, job.trust_remote_code, job.attention)
        if self.source.digest() != record["identity"]["model"]:
            raise UsageError(f"model {job.model} has changed since the state was created")
        if self.schemes is None:
            self.schemes = job.recipe.module_schemes(self.source.skeleton, self.source.family)


def _same_content(content: Content, protocol: CommitProtocol) -> dict[str, str]:
    """The model's shard stats, once its files are checked to hold the content the committed layers were computed
    from (model_check); UsageError naming the first layer that differs."""
    stats, manifests = content.stats(), {}
    for layer in protocol.view:
        with contextlib.suppress(CorruptStateError):  # an unreadable commit is found, and redone, by its read
            if (manifest := protocol.manifest(layer)) is not None:
                manifests[layer] = manifest
    change = model_check.changed(content, model_check.vouchers(manifests), stats)
    if change is not None:
        raise UsageError(f"model {content.source.path} has changed since layer {change[0]} was committed (its "
                         f"tensors in {change[1]} differ): restore the model, or redo from that layer with "
                         "`elastic-oneshot run ... --model-changed redo`")
    return stats


def _user_mode(path: str):
    """`path` readable as the user's umask allows, as any file they write: safetensors creates its files 0600."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for every thread, while it asks)."""
    with contextlib.suppress(OSError, StopIteration, ValueError), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def _writing(partial: str):
    """A full or failing disk where the checkpoint is built: the one storage error, naming `partial`. (The committed
    layers are read outside: their errors name the state.)"""
    try:
        yield
    except (OSError, SafetensorError) as e:
        raise StorageError(partial, _os_error(e)) from None


def _os_error(e: Exception) -> OSError:
    """safetensors reports a failed write as text ("... (os error 28)"): the OSError it was."""
    if isinstance(e, OSError):
        return e
    code = re.search(r"os error (\d+)", str(e))
    return OSError(int(code.group(1)), os.strerror(int(code.group(1)))) if code else OSError(errno.EIO, str(e))


def _starts(source: SourceModel, schemes: dict, num_layers: int) -> dict[int, str]:
    """Per layer, a name at or below every name its committed tensors are written under (each is a module's name
    as stored, a dot, and a leaf: a quantized module's, or a tensor the recipe changed in place, such as a folded
    norm): the least of its modules' names with the dot."""
    starts = dict.fromkeys(range(num_layers), "")
    for layer in range(num_layers):
        prefix = f"{source.layer_prefix}{layer}."
        names = source.layers[layer].state_dict()
        stored = [source.stored_name(f"{prefix}{name}").rpartition(".")[0] for name in names]
        starts[layer] = min((f"{name}." for name in stored), default="")
    return starts


def _tensors(source: SourceModel, starts: dict[int, str],
             layer_tensors: Callable[[int], dict]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in name order, under the names the source stores them by: the source's, with each
    layer's committed ones (`layer_tensors`, by skeleton name) in place of those they replace: a tensor the source
    holds replaces itself (a folded norm, a pruned weight, an FP8 weight), any other (weight_packed, weight_scale)
    its module's weight; the passes' own (their scales) are not written. A layer is read
    once the walk reaches `starts[layer]`, so that its names are known before any name after them goes out; each
    tensor is let go as it goes out. Each layer's names being contiguous, one layer is held at a time."""
    order = sorted(starts, key=lambda layer: (starts[layer], layer))
    names = iter(sorted(source.weight_map))
    name = next(names, None)
    pending, heap, replaced, last = {}, [], set(), None
    while True:
        while order and (name is None or starts[order[0]] <= name):
            for key, tensor in layer_tensors(order.pop(0)).items():
                if key.endswith(f".{SCALES}"):
                    continue
                stored = source.stored_name(key)
                pending[stored] = tensor
                heapq.heappush(heap, stored)
                replaced.add(_replaced(source, stored))
        if heap and (name is None or heap[0] < name):
            out = heapq.heappop(heap)
            tensor = pending.pop(out)
        elif name is None:
            return
        else:
            out, name = name, next(names, None)
            if out in replaced:
                continue
            tensor = source.read_stored([out])[out]
        if last is not None and out <= last:  # a quantized tensor below its layer's start: not in name order
            raise RuntimeError(f"export: {out} would follow {last}")
        last = out
        yield out, tensor


def _replaced(source: SourceModel, stored: str) -> str:
    """The source's tensor that a committed one (by stored name) replaces: itself where the source holds it (a
    folded norm, a pruned weight, an FP8 weight), else its module's weight (weight_packed, weight_scale)."""
    return stored if stored in source.weight_map else stored.rsplit(".", 1)[0] + ".weight"


@dataclasses.dataclass
class _Made:
    """A shard whose bytes are made: `data`, holding `tensors`; `link`, a file that holds the same bytes (a layer's
    weight file in a state on this machine), put in place by a hard link where the filesystem allows."""

    data: bytes | memoryview
    tensors: dict[str, torch.Tensor]
    link: str | None


def _by_layer(source: SourceModel, num_layers: int, layer_files: Callable[[int], list[tuple[dict, bytes]]],
              local: Callable[[dict], str | None]) -> Iterator[dict | _Made]:
    """The shards of a data-free job's checkpoint, written once: each decoder layer's committed tensors (by
    `layer_files`, each file as (record, bytes)) in a shard of its own, then the source's other tensors in name order,
    in shards of SHARD_BYTES. A layer committed in one weight file whose bytes are its shard's (one rank computed it
    in one go, under the names the source stores) is that file, linked where `local` gives its path; any other's
    shard is made of its tensors, the same bytes. So the layout and the bytes depend on the job alone, not on the
    world size or the interruptions that committed the layers."""
    replaced = set()
    for layer in range(num_layers):
        files = layer_files(layer)
        tensors = {source.stored_name(name): t for _, data in files for name, t in tensor_bytes.load(data).items()}
        replaced.update(_replaced(source, name) for name in tensors)
        if len(files) == 1 and tensor_bytes.saved_as(files[0][1], tensors, tensor_bytes.METADATA):
            yield _Made(files[0][1], tensors, local(files[0][0]))
        else:
            yield _Made(tensor_bytes.save(tensors, tensor_bytes.METADATA), tensors, None)
        del files, tensors  # before the next layer is read
    yield from shards(((name, source.read_stored([name])[name]) for name in sorted(source.weight_map)
                       if name not in replaced), SHARD_BYTES)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def shards(tensors: Iterable[tuple[str, object]], limit: int, size: Callable = _nbytes) -> Iterator[dict]:
    """Consecutive (name, tensor) in shards of at most `limit` bytes by `size` (a larger tensor alone in one; at
    least one shard, if empty), each as soon as the next tensor does not fit it: a caller streaming `tensors` and
    letting each shard go holds one. The split depends only on the names' order and their sizes."""
    current, total = {}, 0
    for name, tensor in tensors:
        nbytes = size(tensor)
        if current and total + nbytes > limit:
            yield current
            current, total = {}, 0
        current[name] = tensor
        total += nbytes
    yield current


def _write_weights(directory: str, written_shards: Iterable[dict | _Made]):
    """The checkpoint's shards (each a dict of tensors, or made: `_Made`), each written as soon as it comes, under a
    temporary name until the count is known; an index if more than one."""
    written, weight_map, total = [], {}, 0
    for shard in written_shards:
        written.append(os.path.join(directory, f"model-{len(written) + 1:05d}.safetensors.partial"))
        with _writing(directory):
            if isinstance(shard, _Made):
                _place(shard, written[-1])
            else:
                save_file(shard, written[-1], metadata=tensor_bytes.METADATA)
                _user_mode(written[-1])
        tensors = shard.tensors if isinstance(shard, _Made) else shard
        weight_map.update(dict.fromkeys(tensors, len(written)))
        total += sum(_nbytes(t) for t in tensors.values())
        del shard, tensors  # before the next one is gathered
    count = len(written)
    names = ["model.safetensors"] if count == 1 else \
        [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    with _writing(directory):
        for path, fname in zip(written, names):
            os.replace(path, os.path.join(directory, fname))
        if count > 1:
            with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": {n: names[i - 1] for n, i in
                                                                             weight_map.items()}},
                          f, indent=2, sort_keys=True)


def _place(shard: _Made, path: str):
    """`shard` at `path`: a hard link to its file where there is one and the filesystem and its owner allow (the
    bytes are then on the disk once, for the state and the checkpoint), else its bytes written."""
    if shard.link is not None:
        try:
            os.link(shard.link, path)
            _user_mode(path)
            return
        except OSError:  # another filesystem, or a file this user may not link or change
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    with open(path, "wb") as f:
        f.write(shard.data)
    _user_mode(path)
