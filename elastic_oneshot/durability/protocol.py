"""The commit protocol: when a layer counts as done, and what a restart builds on, in one place.

A layer is done once the records (records.py) hold its commit for an epoch that the newest fence accepts, and every
weight file the commit names reads back with its digest (state.py). Before the commit, every rank writes its solved
groups as soon as they are solved (sub-layer progress, `write_solved`); rank 0's commit names the records that
cover every group of the layer, as their writers returned them, once they are durable: the runner commits a layer
while the next one computes, in layer order. Restarts check the files' sizes, and read back against their digests
the layers they replay (`verified`); the end of a run reads everything back once, through the export, which checks
each layer's digests as it streams it out (`tensors`: one layer held at a time, where keeping every file's bytes
would hold the whole compressed model), and a layer that fails there is excluded by the next `verified`, to be
redone. A commit also names the newest boundary that became durable since the last one (boundaries.py); a restart
replays from the newest durable boundary at or below the layer it needs. The runner, the export and `status` read
progress here.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from elastic_oneshot.durability import layout
from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore, load_tensors
from elastic_oneshot.errors import CorruptStateError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("elastic_oneshot")


class CommitProtocol:
    """The job's progress in `state` and `records`. `view` is the committed layers (layer -> epoch of its commit)
    as the current epoch sees them: given by whoever reads the records, set again when an epoch begins, and extended
    by each commit."""

    def __init__(self, state: StateStore, records: Records, view: dict[int, int] | None = None):
        self.state, self.records = state, records
        self.view: dict[int, int] = {} if view is None else view
        self._read: dict[str, bytes] = {}  # files read back by `verified` or `solved`, until `read_tensors` uses them
        self._damaged: dict[tuple[int, int], str] = {}  # (layer, epoch) -> why `tensors` found its commit unreadable
        self._commits: dict[tuple[int, int], dict] = {}  # (layer, epoch) -> its commit, as read (`manifest_of`)

    # -- reading ------------------------------------------------------------------------------------
    def verified(self) -> dict[int, int]:
        """The committed layers whose commits read and whose weight files have the sizes their commits record,
        less those `tensors` found damaged; the others are to be redone. Reading every file back at each restart
        would cost the compressed model so far, so only the layers a restart replays are read against their digests
        too, and kept for `tensors` (the replay's); none if every layer is committed (the export reads them all, one
        at a time)."""
        self._read, listed = {}, {}

        def checked(item: tuple[int, int]) -> tuple[int, int, dict | None]:
            layer, epoch = item
            try:
                if (layer, epoch) in self._damaged:
                    raise CorruptStateError(self._damaged[layer, epoch])
                return layer, epoch, self._verify(self.manifest_of(layer, epoch), layer, epoch, listed)
            except CorruptStateError as e:
                log.warning("layer %d will be redone: %s", layer, e)
                return layer, epoch, None

        with ThreadPoolExecutor(16) as pool:  # a request or two a layer: on an object store, latency adds up
            found = list(pool.map(checked, sorted(self.records.committed().items())))
        manifests = {layer: manifest for layer, _, manifest in found if manifest is not None}
        valid = {layer: epoch for layer, epoch, manifest in found if manifest is not None}
        checked = set(valid) if len(valid) == self.state.job()["num_layers"] else set()  # then none is replayed
        while todo := [layer for layer in _replayed(valid, manifests) if layer not in checked]:
            for layer in todo:
                checked.add(layer)
                try:
                    self._verify(manifests[layer], layer, valid[layer], listed, deep=True)
                except CorruptStateError as e:
                    log.warning("layer %d will be redone: %s", layer, e)
                    del valid[layer]
        return valid

    def manifest(self, layer: int) -> dict:
        """The commit of a layer in `view`."""
        return self.manifest_of(layer, self.view[layer])

    def manifest_of(self, layer: int, epoch: int) -> dict | None:
        """The records' commit of `layer` in `epoch`, None if absent; read once, since a commit never changes once
        created (a restart on an object store would otherwise read every commit several times over)."""
        if (layer, epoch) not in self._commits:
            manifest = self.records.manifest(layer, epoch)
            if manifest is None:
                return None
            self._commits[layer, epoch] = manifest
        return self._commits[layer, epoch]

    def tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """The compressed tensors of a layer in `view` (`files`)."""
        return {name: t for _, data in self.files(layer) for name, t in load_tensors(data).items()}

    def files(self, layer: int) -> list[tuple[dict, bytes]]:
        """The weight files of a layer in `view`, each as (its record, its bytes): from the bytes `verified` read
        back (once), else read now and checked against their digests. CorruptStateError if they do not match, or
        the commit is missing: the layer is then damaged, and the next `verified` leaves it out."""
        epoch = self.view[layer]
        try:
            manifest = self.manifest_of(layer, epoch)
            if manifest is None:
                raise CorruptStateError(f"the commit of layer {layer} in epoch {epoch} is missing")
            return [(record, self._bytes(record)) for record in manifest["weights"]]
        except CorruptStateError as e:
            self._damaged[layer, epoch] = str(e)
            raise

    def damaged(self, layer: int, reason: str):
        """Layer `layer` of `view` was found damaged elsewhere (a replay on any rank): the next `verified` leaves it
        out."""
        self._damaged[layer, self.view[layer]] = reason

    def read_tensors(self, record: dict) -> dict[str, torch.Tensor]:
        """The tensors of a weight file (`_bytes`)."""
        return load_tensors(self._bytes(record))

    def _bytes(self, record: dict) -> bytes:
        """A weight file's bytes: those `verified` or `solved` read back (used once), else read now against its
        digest (CorruptStateError)."""
        data = self._read.pop(record["path"], None)
        return self.state.read_bytes(record) if data is None else data

    def _verify(self, manifest: dict | None, layer: int, epoch: int, listed: dict, deep: bool = False) -> dict:
        """`manifest`, the records' commit of `layer` in `epoch`, if it exists and its weight files check out:
        read back against their digests if `deep` (and the bytes kept for `tensors`), else their sizes against
        `listed` (folder -> {name: size}, filled here with one listing per folder). CorruptStateError otherwise."""
        if manifest is None:
            raise CorruptStateError(f"the commit of layer {layer} in epoch {epoch} is missing")
        for record in manifest["weights"]:
            if deep:
                self._read[record["path"]] = self.state.read_bytes(record)
                continue
            folder, name = record["path"].rsplit("/", 1)
            if folder not in listed:
                listed[folder] = self.state.sizes(folder)
            size = listed[folder].get(name)
            if size is None:
                raise CorruptStateError(f"{record['path']} is missing")
            if size != record["size"]:
                raise CorruptStateError(f"{record['path']} has {size} bytes, expected {record['size']}")
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

    def first_reads(self, own: list[int]) -> list[dict]:
        """The files a restart on `view` reads first, in order: the weight files of the layers it replays, then
        chunks `own` of the boundary it replays from; none once every layer is done. A guess made before
        verification, for reading ahead (state.read_ahead): whatever it names is checked when it is used."""
        manifests = {}
        for layer, epoch in self.view.items():
            try:
                manifests[layer] = self.manifest_of(layer, epoch)
            except CorruptStateError:
                manifests[layer] = None
        valid = {layer: epoch for layer, epoch in self.view.items() if manifests[layer]}
        num_layers = self.state.job()["num_layers"]
        todo = next(layer for layer in range(num_layers + 1) if layer not in valid)
        if todo == num_layers:
            return []
        files = [record for layer in _replayed(valid, manifests) for record in manifests[layer]["weights"]]
        for _, chunks in self.durable(todo)[:1]:
            files += [chunks[str(c)] for c in own if str(c) in chunks]
        return files

    # -- writing ------------------------------------------------------------------------------------
    def begin_epoch(self, committed: dict[int, int]) -> int:
        """Fence a new epoch that builds on `committed` (StaleEpochError if another process began it first)."""
        return self.records.begin_epoch(committed)

    def solved(self, layer: int, tag: str, lineage: str) -> list[dict]:
        """Rank 0, when the epoch tagged `tag` starts work on `layer`: the intact solved-group records it may reuse,
        their files read back against their digests and kept for `read_tensors` (read once). A record counts only if
        it was written by an epoch of this state, as its name and its body say (never another job's or another
        copy's), from the same model content up to the layer (`lineage`, model_check.lineage), and, for an older
        epoch's, if taken into this epoch's fence for the layer, which the first call writes, so that a stale
        worker's late writes are never picked up."""
        folder, fence = layout.solved_folder(layer), layout.solved_fence(layer, tag)
        try:
            listed = self.state.read_json(fence)
        except CorruptStateError:
            listed = None
        out, older = [], []
        for name in sorted(n for n in self.state.names(folder) if n.endswith(".json")):
            epoch = layout.epoch_of(name)
            written = self.records.tag(epoch) if epoch is not None else None
            own = written == tag
            if written is None or not name.startswith(f"{written}."):
                continue
            if not own and listed is not None and name not in listed["records"]:
                continue
            try:
                body = self.state.read_json(f"{folder}/{name}")
                if body.get("tag") != written or body.get("lineage") != lineage:
                    continue
                self._read[body["file"]["path"]] = self.state.read_bytes(body["file"])
            except (CorruptStateError, KeyError, TypeError, AttributeError):
                continue
            out.append(body)
            older += [] if own else [name]
        if listed is None:
            self.state.write_json(fence, {"records": older})
        return out

    def write_solved(self, layer: int, tag: str, name: str, groups: list[str], tensors: dict, lineage: str) -> dict:
        """Persist solved groups (named `name` among the records of the epoch tagged `tag`) before the commit; their
        record, {"groups", "file", "tag", "lineage"}, for the commit. `lineage`: the model content up to the layer
        that they were solved from (model_check.lineage)."""
        stem = layout.solved(layer, tag, name)
        record = {"groups": groups, "file": self.state.write_tensors(f"{stem}.safetensors", tensors), "tag": tag,
                  "lineage": lineage}
        self.state.write_json(f"{stem}.json", record)
        return record

    def commit(self, layer: int, epoch: int, manifest: dict, groups: list[str], records: list[dict]):
        """Rank 0: commit `layer` for `epoch` with `manifest` plus the weight files of `records` (the solved records
        reused and written for it, as their writers returned them: nothing is read back), which must cover all
        `groups`, so that a commit never names less than the whole layer."""
        missing = sorted(set(groups) - {name for r in records for name in r["groups"]})
        if missing:
            raise RuntimeError(f"layer {layer}: no solved record covers {', '.join(missing)}")
        committed = {**manifest, "weights": [r["file"] for r in records]}
        self.records.commit(layer, epoch, committed)
        self._commits[layer, epoch] = committed  # as the records now hold it: the export reads it from here

    def prune(self, below: int, epoch: int):
        """Delete boundaries of layers below `below`, unless `epoch` is no longer the newest. Committed records may
        still name them: a reader that misses one recomputes it."""
        if self.records.current_epoch() != epoch:
            return
        for name in self.state.names(layout.BOUNDARIES):
            if name.isdigit() and int(name) < below:
                self.state.remove(layout.boundary_folder(int(name)))


def _replayed(valid: dict[int, int], manifests: dict[int, dict]) -> list[int]:
    """The committed layers a restart on `valid` replays: from the newest boundary its commits record at or below
    the first layer to do, up to that layer (from the embeddings if none)."""
    todo = 0
    while todo in valid:
        todo += 1
    boundaries = [m["boundary"]["layer"] for layer, m in manifests.items()
                  if layer in valid and m.get("boundary") and m["boundary"]["layer"] <= todo]
    return list(range(max(boundaries, default=0), todo))
