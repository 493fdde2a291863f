"""A layer's inputs on this rank: its sample chunks' hidden states, and the keyword arguments every
decoder layer takes (position embeddings, mask).

The chunks' hidden states stay in host memory from one layer to the next (`keep`); storage is read only
when they are not there: after a restart, a repartition, or a redo. Then they come from the newest
durable boundary (boundaries.py) that reads back intact, else from the embeddings, replayed forward
through the committed quantized layers.
"""

import functools
import logging
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, Future

import torch

from elastic_oneshot.distributed import signals
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError, UsageError
from elastic_oneshot.loop.layer_step import LayerStep
from elastic_oneshot.models.source import Embedder

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
    """Inputs of any layer for this rank's chunks. `step` runs committed layers (replays); `chunks` are every chunk's
    sample bounds, `own` the ids of this rank's; `protocol` says which layers are committed, with which weights, and
    which boundaries are durable; `decisions(layer)` gives the earlier passes' committed decisions on a layer, which a
    replay applies too (DamagedLayer, naming the pass, where one does not read back)."""

    def __init__(self, state: StateStore, step: LayerStep, chunks: list[tuple[int, int]], own: list[int],
                 protocol: CommitProtocol, decisions: Callable[[int], list] = lambda layer: []):
        self.state, self.step, self.source, self.seq_len = state, step, step.source, step.seq_len
        self.chunks, self.own, self.device, self.protocol = chunks, own, step.device, protocol
        self.decisions = decisions
        self.budget: int | None = None  # bytes a layer may take (source.load_layer): the runner's, for each epoch
        self.embedder = Embedder(self.source)
        self._kwargs: dict = {}
        self._held_layer: int | None = None
        self._held: dict[int, torch.Tensor] = {}
        self._damaged: set[int] = set()  # boundaries found damaged
        self._fetching: tuple[int, dict[int, Future]] | None = None  # a boundary's chunks being read ahead

    @classmethod
    def tried(cls, state: StateStore, step: LayerStep, *args) -> "LayerInputs":
        """LayerInputs(state, step, *args) once layer 0 has run on one sample of zeros, called as the run calls it
        (which also caches its keyword arguments). Whatever fails there (a decoder the layer loop cannot drive) is
        the one-line refusal that names the model type and the failing call, before any work. A pass that runs no
        layer (round to nearest without static input activations) tries none: that costs more than its whole work."""
        if not step.forwards:
            return cls(state, step, *args)
        try:
            inputs = cls(state, step, *args)
            with torch.inference_mode():
                x = inputs.embedder(torch.zeros(1, inputs.seq_len, dtype=torch.int64))
                inputs.forward(step.source.load_layer(0, inputs.device, budget=0), 0, x.to(inputs.device))
        except (UsageError, signals.Preempted, torch.OutOfMemoryError, MemoryError):  # not the model's fault
            raise
        except Exception as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{frame.name} ({os.path.basename(frame.filename)}:{frame.lineno})"
            step.source.refuse(f"a trial of its first decoder layer fails in {where}: {type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0]}")
        return inputs

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
        """Layer `layer` (`module`) on a chunk's inputs `x`, as every pass runs it (LayerStep.forward)."""
        return self.step.forward(module, x, self.kwargs(layer))

    def each(self, layer: int):
        """This rank's chunks with their inputs to `layer`, on the device."""
        if self._held_layer != layer:
            self.restore(layer)
        for chunk in self.own:
            yield chunk, self._held[chunk].to(self.device, non_blocking=True)

    @property
    def held_layer(self) -> int | None:
        """The layer whose inputs are held in memory."""
        return self._held_layer

    def held_bytes(self) -> int:
        """The bytes of this rank's chunks' inputs held in memory: what a boundary of theirs writes."""
        return sum(x.nbytes for x in self._held.values())

    def keep(self, layer: int, inputs: dict[int, torch.Tensor]):
        """This rank's chunks' inputs to `layer` (host tensors, see `to_host`), for the next `each(layer)`."""
        self._held_layer, self._held = layer, inputs

    def prefetch(self, layer: int, io: Executor):
        """Start reading, on `io`, this rank's chunks of the boundary that inputs of `layer` will be restored
        from, so that the download overlaps the epoch's setup and the replay of the first chunks."""
        self._fetching = None
        if self._held_layer == layer:
            return
        for boundary, records in self.protocol.durable(layer):
            if boundary not in self._damaged:
                self._fetching = (boundary, {c: io.submit(self.state.read_tensors, records[str(c)]) for c in self.own})
                return

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        """`x` in host memory: pinned when it comes from a GPU, so that it goes back at full speed."""
        if x.device.type == "cpu":
            return x
        return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)

    def replayed(self, layer: int) -> torch.nn.Module:
        """A committed layer as this pass left it (quantized weights in place, scales folded, ...), on the device;
        DamagedLayer if its decisions, or an earlier pass's, do not read back."""
        try:
            tensors = self.protocol.tensors(layer)
        except CorruptStateError as e:
            raise DamagedLayer(layer, str(e)) from None
        return self.step.replayed(layer, to_device(tensors, self.device), self.decisions(layer), self.budget)

    def restore(self, layer: int):
        """Inputs to `layer` from storage: the newest durable boundary at or below it that reads back intact,
        else the embeddings, then forward through the committed layers in between. The boundary's chunks are
        taken as they arrive (`prefetch`): the first replayed layer runs on those already there. DamagedLayer if a
        committed layer in between does not read back."""
        began, held, waited = time.perf_counter(), None, [0.0]
        fetching, self._fetching = self._fetching, None
        for start, records in self.protocol.durable(layer):
            if start in self._damaged:
                continue
            if fetching is None or fetching[0] != start:  # nothing read ahead: each is read when it is used
                fetching = (start, {c: functools.partial(self.state.read_tensors, records[str(c)]) for c in self.own})
            else:
                fetching = (start, {c: f.result for c, f in fetching[1].items()})
            try:
                held = self._replay(start, layer, {c: _arrival(get, waited) for c, get in fetching[1].items()})
                break
            except _Damaged as e:
                self._damaged.add(start)  # said once; every later restore skips it
                log.warning("boundary %d: %s; replaying from an older one", start, e)
                fetching = None
        if held is None:
            start = 0
            held = self._replay(0, layer, {c: functools.partial(self.embedder, self.tokens[slice(*self.chunks[c])])
                                           for c in self.own})
        if start < layer:
            log.info("replayed layers %d..%d for %d chunks in %.1f s (%.1f s of it waiting for the inputs of "
                     "layer %d)", start, layer - 1, len(self.own), time.perf_counter() - began, waited[0], start)
        self.keep(layer, held)
        self.state.forget_read_ahead()  # what the process read ahead of its epoch and this restore did not use

    def _replay(self, start: int, layer: int, held: dict) -> dict[int, torch.Tensor]:
        """The inputs of `layer` from those of `start`, given as a callable per chunk (that may wait for them).
        Chunk by chunk through as many of the layers in between as half the budget holds at once (at least one),
        so that a chunk goes through them as soon as it arrives: the replay's compute hides behind the download."""
        window, nbytes = [], 0
        for index in range(start, layer):
            module = self.replayed(index)
            size = sum(t.nbytes for t in module.state_dict().values() if not t.is_meta)
            if window and nbytes + size > (self.budget or 0) // 2:
                held, window, nbytes = {c: self._through(window, x) for c, x in held.items()}, [], 0
            window.append((index, module))
            nbytes += size
        return {c: self._through(window, x) for c, x in held.items()}

    def _through(self, window: list[tuple[int, torch.nn.Module]], x) -> torch.Tensor:
        """A chunk's inputs (a tensor, or a callable that gives them) through the layers of `window`, in host
        memory."""
        x = x() if callable(x) else x
        if not window:
            return x
        x = x.to(self.device)
        for index, module in window:
            x = self.forward(module, index, x)
        return self.to_host(x)


class _Damaged(Exception):
    """A boundary chunk that does not read back."""


class DamagedLayer(Exception):
    """A committed layer that a replay needs does not read back (`layer`; the message says why): this pass's, or
    (`index`) an earlier pass's."""

    def __init__(self, layer: int, reason: str, index: int | None = None):
        super().__init__(reason)
        self.layer, self.index = layer, index


def _arrival(get, waited: list[float]):
    """A callable that gives a chunk's boundary tensor from `get` (a read, or a read ahead's result), adding the
    time it waited to `waited[0]`; _Damaged if it does not read back."""
    def wait() -> torch.Tensor:
        start = time.perf_counter()
        try:
            return get()["hidden_states"]
        except CorruptStateError as e:
            raise _Damaged(str(e)) from None
        finally:
            waited[0] += time.perf_counter() - start
    return wait
