"""Checks that run before any work: a job that would fail hours later is refused at start, in one line."""

import os

from elastic_oneshot.errors import UsageError


def check_separate(**paths: str):
    """The model, state and output directories (keyword: the option's name) must not hold one another: an
    export or a --restart replaces what is in its own directory."""
    real = {name: os.path.realpath(path) for name, path in paths.items() if path}
    for a, pa in real.items():
        for b, pb in real.items():
            if a < b and pa == pb:
                raise UsageError(f"--{a} and --{b} are the same directory {pa}: give each its own")
            if a != b and pb.startswith(pa.rstrip(os.sep) + os.sep):
                raise UsageError(f"--{b} {pb} is inside --{a} {pa}: give them separate directories")


def check_locations(model: str, state, destination):
    """Before the model is read: the model, a local state and a local output apart, and each writable where it
    is local (a state on an object store is checked by its first write, a prefix by its destination). `state`: a
    StateStore."""
    check_separate(model=model, state=state.local, output=destination.local)
    if state.local:
        state.writable("--state")
    destination.preflight()


def check_seq_len(seq_len: int, config, family, allow_long: bool):
    """Positions past the model's context were never trained: calibrating there is an explicit choice. An
    image-text model's context is its language model's."""
    limit = family.context(config)
    if limit and seq_len > limit and not allow_long:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's context of {limit} tokens "
                         "(max_position_embeddings): lower it, or pass --allow-long-seq to calibrate past it")


def check_layer_fits(layer_bytes: list[int], free: list[list[tuple[str, int]]], routed: list[int] | None = None):
    """A decoder layer is held in memory while it is compressed, but for experts stored one by one under routed
    calibration, which are read a batch at a time (`layer_bytes`: SourceModel.layer_bytes as the job streams):
    a layer whose weights held at once exceed what a rank can hold (`free`: each rank's World.memory_for_a_layer)
    would be killed for memory when it is reached, after the work on the layers before it, and again at every
    restart; refused here instead. `routed`: the bytes under routed calibration, for a job that calibrates every
    expert on every token (which solves all their gate and up projections as one group, held whole)."""
    layer = max(range(len(layer_bytes)), key=layer_bytes.__getitem__)
    for where, available in (place for rank in free for place in rank):
        if layer_bytes[layer] > available:
            hint = (" (or pass --moe-calibrate routed, under which it holds one batch of experts at a time)"
                    if routed and max(routed) <= available else "")
            raise UsageError(f"layer {layer}'s weights take {layer_bytes[layer] / 1e9:.1f} GB held at once, more "
                             f"than the {available / 1e9:.1f} GB free on {where}: a decoder layer is held whole "
                             "while it is compressed, but for experts stored one by one under routed calibration; "
                             f"run on machines with more memory{hint}")
