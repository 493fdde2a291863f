"""The state directory: atomic, checksummed files and the per-layer commit records.

Layout (docs/state-format.md is the specification):
    job.json                          what is being compressed, and its fingerprint
    tokens.safetensors                the calibration samples, [num_samples, seq_len] int64
    epochs/EEEEE.json                 fence of epoch E: the commits valid when its workers started
    commits/LLLLL.eEEEEE.json         layer L's manifest from epoch E: written last; it is the commit
    layers/LLLLL/eEEEEE.rR.bBBBB.{safetensors,json}  solved groups of layer L (tensors, and the record
                                      naming them), written by rank R of epoch E as soon as solved
    layers/LLLLL/fence.eEEEEE.json    which older solved records epoch E reuses for layer L
    boundaries/LLLLL/eEEEEE/chunk-CCCCC.safetensors  inputs of layer L for sample chunk C
    events.jsonl                      history for people and `status` (never trusted for progress)

Every file is written to a temporary name, fsynced, renamed, and its directory fsynced. Files are
listed with size and sha256 in the record that refers to them, and verified when read: a torn or
altered file is reported, never used. Only safetensors and JSON are ever read back.

Fencing: every (re)start of the workers begins a new epoch by creating the next fence file, which
cannot exist twice (link(2) fails on an existing name). A commit is created the same way, only while
its epoch is the newest, under a name holding its epoch, and the files it names live under paths
holding its epoch: a stale worker can neither overwrite nor delete what a newer epoch wrote. A commit
that slips in after a newer fence was taken is not in that fence, and so is not valid.
"""

import hashlib
import json
import os
import shutil

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import CorruptStateError, StaleEpochError, UsageError

FORMAT = 1


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def read_events(root: str) -> list[dict]:
    """events.jsonl of the state directory `root`, skipping a line torn by a kill."""
    try:
        with open(os.path.join(root, "events.jsonl")) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


class StateStore:
    def __init__(self, root: str, records=None):
        self.root = os.path.abspath(root)
        self.records = records or self._recorded_records()  # where the truth of progress lives

    def _recorded_records(self):
        """FileRecords, or the etcd records of job.json's coordinator (`etcd_records`, imported only then): every
        reader of a state whose commits live in etcd (export, status, a resume) finds them there."""
        try:
            coordinator = ((self.read_json("job.json") or {}).get("job") or {}).get("coordinator")
        except CorruptStateError:
            coordinator = None
        if not coordinator:
            return FileRecords(self)
        from .etcd_records import EtcdRecords

        return EtcdRecords.from_url(coordinator)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    # -- files --------------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes, exclusive: bool = False) -> dict:
        """Durably write `data` at `rel`; return its record {path, size, sha256}. With `exclusive`, fail
        with FileExistsError if `rel` exists (atomically: the file appears by link(2), not rename)."""
        path = self.path(rel)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
            _fsync_dir(os.path.dirname(parent))
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            finally:
                os.remove(tmp)
        else:
            os.replace(tmp, path)
        _fsync_dir(parent)
        return {"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def read_bytes(self, record: dict) -> bytes:
        path = self.path(record["path"])
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CorruptStateError(f"{record['path']} is missing") from None
        if len(data) != record["size"]:
            raise CorruptStateError(f"{record['path']} has {len(data)} bytes, expected {record['size']}")
        if hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise CorruptStateError(f"{record['path']} does not match its checksum")
        return data

    def write_tensors(self, rel: str, tensors: dict[str, torch.Tensor]) -> dict:
        return self.write_bytes(rel, st_save({k: v.contiguous() for k, v in tensors.items()}))

    def read_tensors(self, record: dict) -> dict[str, torch.Tensor]:
        return st_load(self.read_bytes(record))

    def write_json(self, rel: str, body: dict, exclusive: bool = False):
        """A JSON record that carries its own checksum, so a truncated or edited one is detected."""
        self.write_bytes(rel, json.dumps({"body": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()},
                                         indent=1, sort_keys=True).encode(), exclusive)

    def read_json(self, rel: str) -> dict | None:
        """The record's body; None if absent; CorruptStateError if unreadable or altered."""
        try:
            with open(self.path(rel), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
            body = doc["body"]
            ok = hashlib.sha256(_canonical(body)).hexdigest() == doc["sha256"]
        except (ValueError, KeyError, TypeError):
            raise CorruptStateError(f"{rel} is not a readable record (truncated?)") from None
        if not ok:
            raise CorruptStateError(f"{rel} does not match its checksum")
        return body

    # -- the job --------------------------------------------------------------------------------
    def holds(self, job: dict) -> bool:
        """Whether this directory already belongs to `job` (a dict with a 'fingerprint')."""
        try:
            current = self.read_json("job.json")
        except CorruptStateError:
            return False
        return current is not None and current.get("fingerprint") == job["fingerprint"]

    def claim(self, job: dict, tokens: torch.Tensor, restart: bool = False):
        """Start `job` here with its calibration samples. A directory holding another job (or anything
        else) is refused unless `restart`, which clears our files first."""
        try:
            current = self.read_json("job.json")
        except CorruptStateError as e:
            if not restart:
                raise UsageError(f"state directory {self.root}: {e}; use --restart to start over") from None
            current = None
        if current is not None and not restart:
            diff = [k for k in ("model", "dataset", "recipe", "samples")
                    if _canonical(current.get("identity", {}).get(k)) != _canonical(job["identity"][k])]
            raise UsageError(f"state directory {self.root} belongs to another job (different "
                             f"{', '.join(diff) or 'format or code'}): use another --state, or --restart to discard it")
        if current is None and os.path.isdir(self.root) and os.listdir(self.root) and not restart:
            if not os.path.exists(self.path("job.json")):
                raise UsageError(f"state directory {self.root} is not empty and holds no elastic-oneshot "
                                 "job: choose an empty or new directory")
        self.clear()
        record = self.write_tensors("tokens.safetensors", {"input_ids": tokens})
        self.write_json("job.json", {**job, "tokens": record})

    def tokens(self) -> torch.Tensor:
        """The job's calibration samples, as fixed when it started."""
        return self.read_tensors(self.job()["tokens"])["input_ids"]

    def job(self) -> dict:
        job = self.read_json("job.json")
        if job is None:
            raise UsageError(f"{self.root} holds no elastic-oneshot state (no job.json)")
        return job

    def clear(self):
        for name in ("commits", "layers", "boundaries", "epochs", "job.json", "tokens.safetensors",
                     "events.jsonl"):
            p = self.path(name)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
        os.makedirs(self.root, exist_ok=True)

    def append_event(self, event: dict):
        """One line of events.jsonl: a human and tool readable history, not part of any commit."""
        with open(self.path("events.jsonl"), "a") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")

    def events(self) -> list[dict]:
        return read_events(self.root)

    # -- layers -------------------------------------------------------------------------------------
    def verify(self, layer: int, epoch: int) -> dict:
        """The layer's manifest, if it and its weight files check out (CorruptStateError otherwise)."""
        manifest = self.records.manifest(layer, epoch)
        if manifest is None:
            raise CorruptStateError(f"the commit of layer {layer} in epoch {epoch} is missing")
        for record in manifest["weights"]:
            self.read_bytes(record)
        return manifest

    def write_solved(self, layer: int, epoch: int, name: str, groups: list[str], tensors: dict) -> dict:
        """Persist solved groups of a layer before the layer commits (sub-layer progress)."""
        stem = f"layers/{layer:05d}/e{epoch:05d}.{name}"
        record = self.write_tensors(f"{stem}.safetensors", tensors)
        self.write_json(f"{stem}.json", {"groups": groups, "file": record})
        return record

    def solved(self, layer: int, epoch: int) -> list[dict]:
        """Rank 0, when `epoch` starts work on `layer`: the intact solved-group records it may reuse.
        Records of older epochs count only if taken into this epoch's fence for the layer, written on
        first call, so that a stale worker's late writes are never picked up."""
        folder, fence = f"layers/{layer:05d}", f"layers/{layer:05d}/fence.e{epoch:05d}.json"
        try:
            listed = self.read_json(fence)
        except CorruptStateError:
            listed = None
        names = sorted(n for n in os.listdir(self.path(folder)) if n.endswith(".json") and n.startswith("e")) \
            if os.path.isdir(self.path(folder)) else []
        out, older = [], []
        for name in names:
            own = name.startswith(f"e{epoch:05d}.")
            if not own and listed is not None and name not in listed["records"]:
                continue
            try:
                body = self.read_json(f"{folder}/{name}")
                self.read_bytes(body["file"])
            except (CorruptStateError, KeyError, TypeError):
                continue
            out.append(body)
            older += [] if own else [name]
        if listed is None:
            self.write_json(fence, {"records": older})
        return out

    def prune_boundaries(self, below: int, epoch: int):
        """Delete boundaries of layers below `below`, unless `epoch` is stale. Committed records may still
        name them: a reader that misses one recomputes it."""
        root = self.path("boundaries")
        if not os.path.isdir(root) or self.records.current_epoch() != epoch:
            return
        for name in os.listdir(root):
            if name.isdigit() and int(name) < below:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


class FileRecords:
    """Epoch fences and commits as files in the state directory (the default; see the module docstring).

    The same interface over etcd is `elastic_oneshot.etcd_records.EtcdRecords`: epochs(), current_epoch(),
    committed(), begin_epoch(committed), manifest(layer, epoch), commit(layer, epoch, manifest).
    """

    def __init__(self, files: StateStore):
        self.files = files

    def epochs(self) -> list[int]:
        d = self.files.path("epochs")
        return sorted(int(n[:-5]) for n in os.listdir(d) if n.endswith(".json") and n[:-5].isdigit()) \
            if os.path.isdir(d) else []

    def current_epoch(self) -> int:
        return (self.epochs() or [0])[-1]

    def committed(self) -> dict[int, int]:
        """Layer -> epoch of its valid commit: the newest fence's list, plus that epoch's own commits.
        If the newest fence is unreadable, an older one is used and the commits in between are not
        trusted (their layers are redone)."""
        epochs = self.epochs()
        epoch = (epochs or [0])[-1]
        view = {}
        for e in reversed(epochs):
            try:
                view = {int(k): v for k, v in self.files.read_json(f"epochs/{e:05d}.json")["committed"].items()}
                break
            except (CorruptStateError, KeyError, TypeError):
                continue
        d = self.files.path("commits")
        for name in os.listdir(d) if os.path.isdir(d) else []:
            layer, _, rest = name.partition(".e")
            if rest == f"{epoch:05d}.json" and layer.isdigit():
                view[int(layer)] = epoch
        return view

    def begin_epoch(self, committed: dict[int, int]) -> int:
        """Fence a new epoch: commits not in `committed` (layer -> epoch) are invalid from now on."""
        epoch = self.current_epoch() + 1
        try:
            self.files.write_json(f"epochs/{epoch:05d}.json", {"epoch": epoch, "committed": {
                str(k): v for k, v in sorted(committed.items())}}, exclusive=True)
        except FileExistsError:
            raise StaleEpochError(f"epoch {epoch} was begun by another process") from None
        return epoch

    @staticmethod
    def commit_path(layer: int, epoch: int) -> str:
        return f"commits/{layer:05d}.e{epoch:05d}.json"

    def manifest(self, layer: int, epoch: int) -> dict | None:
        return self.files.read_json(self.commit_path(layer, epoch))

    def commit(self, layer: int, epoch: int, manifest: dict):
        """Commit layer `layer` for `epoch`: refused (StaleEpochError) once a newer epoch has begun, or
        if this epoch already committed it."""
        current = self.current_epoch()
        if current != epoch:
            raise StaleEpochError(f"epoch {epoch} is stale (epoch {current} has begun): layer {layer} not committed")
        try:
            self.files.write_json(self.commit_path(layer, epoch), manifest, exclusive=True)
        except FileExistsError:
            raise StaleEpochError(f"layer {layer} was already committed in epoch {epoch}") from None

