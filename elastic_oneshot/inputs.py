"""A layer's inputs on this rank: its sample chunks' hidden states, and the keyword arguments every
decoder layer takes (position embeddings, mask).

Layer 0's inputs are the embeddings; a later layer's are the committed boundary, the next chunk read
ahead by the I/O thread. A boundary file that is missing or fails its checksum is replayed: recomputed
from the newest earlier boundary through the committed quantized layers, and checked against the
committed file's digest.
"""

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from . import signals
from .errors import CorruptStateError, UsageError
from .model import Embedder, SourceModel
from .packing import unpack_into
from .state import StateStore

log = logging.getLogger("elastic_oneshot")


def to_device(obj, device):
    """Tensors in `obj` (nested tuples, lists, dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


class LayerInputs:
    """Inputs of any layer for this rank's chunks. `manifest(layer)` is the layer's commit; `quantized`
    lists each layer's quantized modules (names local to the layer); `chunks` are every chunk's sample
    bounds, `own` the ids of this rank's."""

    def __init__(self, state: StateStore, source: SourceModel, seq_len: int, scheme,
                 quantized: list[list[str]], chunks: list[tuple[int, int]], own: list[int], device,
                 io: Executor, manifest: Callable[[int], dict]):
        self.state, self.source, self.seq_len, self.scheme = state, source, seq_len, scheme
        self.quantized, self.chunks, self.own, self.device = quantized, chunks, own, device
        self.io, self.manifest = io, manifest
        self.embedder = Embedder(source)
        self._kwargs: dict = {}

    @functools.cached_property
    def tokens(self) -> torch.Tensor:
        """The job's calibration samples, read from the claimed state when layer 0 (or a replay) needs them."""
        return self.state.tokens()

    def kwargs(self, layer: int) -> dict:
        """What the layer takes besides hidden states, for one sample."""
        if layer not in self._kwargs:
            self._kwargs[layer] = to_device(self.embedder.layer_kwargs(layer, 1, self.seq_len), self.device)
        return self._kwargs[layer]

    def forward(self, module, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The layer on a chunk, one sample at a time, as the peer runs it: cache-friendly on CPU (a
        batch's attention scores outgrow the cache) and the same bits in every pass and replay."""
        outputs = [module(sample, **self.kwargs(layer)) for sample in x.split(1)]
        return torch.cat([y[0] if isinstance(y, tuple) else y for y in outputs])

    def each(self, layer: int):
        """This rank's chunks with their inputs to `layer`, the next one read ahead in the background."""
        ahead = None
        for i, chunk in enumerate(self.own):
            signals.check(f"in layer {layer}")
            x = self._inputs(layer, chunk, ahead.result() if ahead else None)
            ahead = self.io.submit(self._read_boundary, layer, self.own[i + 1]) \
                if layer > 0 and i + 1 < len(self.own) else None
            yield chunk, x

    def quantized_layer(self, layer: int) -> torch.nn.Module:
        """A committed layer with its quantized weights, on the device."""
        module = self.source.load_layer(layer).to(self.device)
        tensors = {}
        for record in self.manifest(layer)["weights"]:
            tensors.update(to_device(self.state.read_tensors(record), self.device))
        self.unpack(module, layer, tensors)
        return module

    def unpack(self, module: torch.nn.Module, layer: int, tensors: dict):
        """Put the layer's committed quantized weights (compressed `tensors`) into `module`."""
        unpack_into(module, f"{self.source.layer_prefix}{layer}.", self.quantized[layer], tensors, self.scheme)

    def _read_boundary(self, layer: int, chunk: int) -> torch.Tensor | CorruptStateError:
        """Chunk's committed inputs to `layer` > 0 as read from the state, or why they cannot be used
        (the read-ahead runs this in the I/O thread; any recomputing is left to the main thread)."""
        try:
            return self.state.read_tensors(self.manifest(layer - 1)["boundary"][str(chunk)])["hidden_states"]
        except CorruptStateError as e:
            return e

    def _inputs(self, layer: int, chunk: int, read=None) -> torch.Tensor:
        """Chunk's inputs to `layer`: the embeddings, or the committed boundary (`read`, if read ahead);
        replayed when the file is missing or fails its checksum."""
        if layer == 0:
            start, end = self.chunks[chunk]
            return self.embedder(self.tokens[start:end]).to(self.device)
        x = self._read_boundary(layer, chunk) if read is None else read
        if isinstance(x, CorruptStateError):
            log.warning("boundary %d chunk %d: %s; recomputing it from committed layers", layer, chunk, x)
            return self._replay(layer, chunk, self.manifest(layer - 1)["boundary"][str(chunk)])
        return x.to(self.device)

    def _replay(self, layer: int, chunk: int, record: dict) -> torch.Tensor:
        """Recompute the boundary file `record` (inputs of `layer`) from the newest readable earlier one."""
        start, x = layer - 1, None
        while start > 0 and x is None:
            try:
                record_in = self.manifest(start - 1)["boundary"][str(chunk)]
                x = self.state.read_tensors(record_in)["hidden_states"].to(self.device)
            except (CorruptStateError, KeyError, TypeError):
                start -= 1
        if x is None:
            x = self._inputs(0, chunk)
        for index in range(start, layer):
            x = self.forward(self.quantized_layer(index), index, x)
        rewritten = self.state.write_tensors(record["path"], {"hidden_states": x.cpu()})
        if rewritten["sha256"] != record["sha256"]:
            raise UsageError(f"recomputing {record['path']} from layers {start}..{layer - 1} did not reproduce the "
                             "committed file: the computation is not deterministic here; resume with the thread count "
                             "(OMP_NUM_THREADS) and hardware that wrote the state, or use --restart")
        return x
