"""The commit protocol: when a layer counts as done, and what a restart builds on, in one place.

A layer is done once the records (records.py) hold its commit for an epoch that the newest fence accepts, and every
weight file the commit names reads back with its digest (state.py). Before the commit, every rank writes its solved
groups as soon as they are solved (sub-layer progress, `write_solved`); rank 0's commit names the intact records
that cover every group of the layer, and writes again, from memory, the groups of any record damaged since. A commit
also names the newest boundary that became durable since the last one (boundaries.py); a restart replays from the
newest durable boundary at or below the layer it needs. The runner, the export and `status` read progress here.
"""

import logging

import torch

from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError

log = logging.getLogger("elastic_oneshot")


class CommitProtocol:
    """The job's progress in `state` and `records`. `view` is the committed layers (layer -> epoch of its commit)
    as the current epoch sees them: given by whoever reads the records, set again when an epoch begins, and extended
    by each commit."""

    def __init__(self, state: StateStore, records: Records, view: dict[int, int] | None = None):
        self.state, self.records = state, records
        self.view: dict[int, int] = {} if view is None else view

    # -- reading ------------------------------------------------------------------------------------
    def verified(self) -> dict[int, int]:
        """The committed layers whose commits and weight files check out; the others are to be redone."""
        valid = {}
        for layer, epoch in sorted(self.records.committed().items()):
            try:
                self._verify(self.records.manifest(layer, epoch), layer, epoch)
                valid[layer] = epoch
            except CorruptStateError as e:
                log.warning("layer %d will be redone: %s", layer, e)
        return valid

    def manifest(self, layer: int) -> dict:
        """The commit of a layer in `view`."""
        return self.records.manifest(layer, self.view[layer])

    def weights(self, layer: int) -> list[dict]:
        """The weight files of a layer in `view`, verified (CorruptStateError otherwise)."""
        return self._verify(self.manifest(layer), layer, self.view[layer])["weights"]

    def _verify(self, manifest: dict | None, layer: int, epoch: int) -> dict:
        """`manifest`, the records' commit of `layer` in `epoch`, if it exists and its weight files check out
        (CorruptStateError otherwise)."""
        if manifest is None:
            raise CorruptStateError(f"the commit of layer {layer} in epoch {epoch} is missing")
        for record in manifest["weights"]:
            self.state.read_bytes(record)
        return manifest

    def durable(self, layer: int) -> list[tuple[int, dict]]:
        """The boundaries at or below `layer` that the commits in `view` record as durable, newest first, as
        (boundary layer, {chunk: file record}). A commit that no longer reads is skipped (its layer is redone)."""
        found = {}
        for committed in sorted(self.view):
            try:
                entry = (self.manifest(committed) or {}).get("boundary")
            except CorruptStateError:
                continue
            if entry and entry["layer"] <= layer:
                found[entry["layer"]] = entry["chunks"]
        return sorted(found.items(), reverse=True)

    # -- writing ------------------------------------------------------------------------------------
    def begin_epoch(self, committed: dict[int, int]) -> int:
        """Fence a new epoch that builds on `committed` (StaleEpochError if another process began it first)."""
        return self.records.begin_epoch(committed)

    def solved(self, layer: int, epoch: int) -> list[dict]:
        """Rank 0, when `epoch` starts work on `layer`: the intact solved-group records it may reuse.
        Records of older epochs count only if taken into this epoch's fence for the layer, which the first
        call writes, so that a stale worker's late writes are never picked up."""
        folder, fence = f"layers/{layer:05d}", f"layers/{layer:05d}/fence.e{epoch:05d}.json"
        try:
            listed = self.state.read_json(fence)
        except CorruptStateError:
            listed = None
        out, older = [], []
        for name in sorted(n for n in self.state.names(folder) if n.endswith(".json") and n.startswith("e")):
            own = name.startswith(f"e{epoch:05d}.")
            if not own and listed is not None and name not in listed["records"]:
                continue
            try:
                body = self.state.read_json(f"{folder}/{name}")
                self.state.read_bytes(body["file"])
            except (CorruptStateError, KeyError, TypeError):
                continue
            out.append(body)
            older += [] if own else [name]
        if listed is None:
            self.state.write_json(fence, {"records": older})
        return out

    def write_solved(self, layer: int, epoch: int, name: str, groups: list[str], tensors: dict) -> dict:
        """Persist solved groups (named `name` among this epoch's records of the layer) before the commit."""
        stem = f"layers/{layer:05d}/e{epoch:05d}.{name}"
        record = self.state.write_tensors(f"{stem}.safetensors", tensors)
        self.state.write_json(f"{stem}.json", {"groups": groups, "file": record})
        return record

    def commit(self, layer: int, epoch: int, manifest: dict, groups: dict[str, list[str]],
               tensors: dict[str, torch.Tensor], spare: str):
        """Rank 0: commit `layer` for `epoch` with `manifest` plus the weight files, which must cover all `groups`
        (group -> the prefixes of its tensors' names). A record damaged since it was written is skipped by
        `solved`; its groups are written again from `tensors` (every rank holds the whole layer by then) under
        the record name `spare`, so that a commit never names less than the whole layer."""
        records = self.solved(layer, epoch)
        missing = [g for g in groups if g not in {name for r in records for name in r["groups"]}]
        if missing:
            log.warning("layer %d: the solved records of %s were damaged before the commit; writing them again",
                        layer, ", ".join(missing))
            prefixes = tuple(p for g in missing for p in groups[g])
            records.append({"file": self.write_solved(layer, epoch, spare, missing, {
                k: v.cpu() for k, v in tensors.items() if k.startswith(prefixes)})})
        self.records.commit(layer, epoch, {**manifest, "weights": [r["file"] for r in records]})

    def prune(self, below: int, epoch: int):
        """Delete boundaries of layers below `below`, unless `epoch` is no longer the newest. Committed records may
        still name them: a reader that misses one recomputes it."""
        if self.records.current_epoch() != epoch:
            return
        for name in self.state.names("boundaries"):
            if name.isdigit() and int(name) < below:
                self.state.storage.remove(f"boundaries/{name}", best_effort=True)
