"""The state directory: atomic, checksummed files, written by every rank and read back verified.

Layout (docs/state-format.md is the specification):
    job.json                          what is being compressed, and its fingerprint
    tokens.safetensors                the calibration samples, [num_samples, seq_len] int64
    epochs/EEEEE.json                 fence of epoch E: the commits valid when its workers started, and its nonce
    commits/LLLLL.eEEEEE.json         layer L's manifest from epoch E: written last; it is the commit
    layers/LLLLL/TAG.rR.bBBBB.{safetensors,json}  solved groups of layer L (tensors, and the record naming them),
                                      written by rank R of the epoch tagged TAG (eEEEEE.NONCE) as soon as solved
    layers/LLLLL/fence.TAG.json       which older solved records that epoch reuses for layer L
    boundaries/LLLLL/TAG/chunk-CCCCC.safetensors  inputs of layer L for sample chunk C (boundaries.py)
    events.jsonl                      history for people and `status` (never trusted for progress)
    events/TTTTT.R.json               the same history on an object store, one event per object
    stages/PP-MODIFIER/               a recipe's pass PP before its last (SmoothQuant, AWQ, SparseGPT): a state of its
                                      own, commits to job.json, tokens.safetensors (`stage`)

The state lives in a storage (storage.py): a local directory, or an object store when --state is a URL, where
each file is an object written whole, and exclusive writes are conditional puts (If-None-Match: *).
On a local directory, every file is written to a temporary name, fsynced, renamed, and its directory fsynced. Files are
listed with size and xxh3-128 digest in the record that refers to them (a fast non-cryptographic hash:
it guards against torn and damaged files, not against an adversary, at memory speed), computed while
writing and verified when read back: a torn or altered file is reported, never used. JSON records also
carry a sha256 of their body. Only safetensors and JSON are ever read back.

Fencing: every (re)start of the workers begins a new epoch by creating the next fence file, which
cannot exist twice (link(2) fails on an existing name). A commit is created the same way, only while
its epoch is the newest, under a name holding its epoch, and the files it names live under paths
holding its epoch: a stale worker can neither overwrite nor delete what a newer epoch wrote. A commit
that slips in after a newer fence was taken is not in that fence, and so is not valid.

The fences and commits are the records (records.py): these files by default (records.FileRecords), or keys in
etcd (etcd_records.EtcdRecords), and then epochs/ and commits/ stay empty. StateStore knows nothing of them:
whoever needs the records opens them (records.open_records) and passes what they say. What makes a layer done
(solved groups, their fences, commits, verification, pruning) is the commit protocol's (protocol.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING

import xxhash

from elastic_oneshot import metrics
from elastic_oneshot.durability import layout
from elastic_oneshot.durability.storage import DEBRIS, RETRY_S, open_storage
from elastic_oneshot.errors import CorruptStateError, StorageError, UsageError
from elastic_oneshot.jsonforms import canonical_json, record_json

if TYPE_CHECKING:
    import torch

log = logging.getLogger("elastic_oneshot")
FORMAT = 3  # 2: boundaries behind the commits, xxh3-128 file digests; 3: epoch tags, the model's content in commits
DIGEST_SLICE = 256 << 10  # bytes hashed per xxhash call (digest)
_AHEAD: dict[str, dict[str, Future]] = {}  # root -> path -> its bytes being read ahead, for any StateStore of root


def digest(data: bytes | memoryview) -> str:
    """The digest of a file's bytes, as its record keeps it: hashed a slice at a time, since xxhash holds the GIL
    while it hashes, which would stall the thread that solves for as long as a whole file takes."""
    h, view = xxhash.xxh3_128(), memoryview(data)
    for start in range(0, len(view), DIGEST_SLICE):
        h.update(view[start:start + DIGEST_SLICE])
    return h.hexdigest()


def save_tensors(tensors: dict[str, torch.Tensor]) -> memoryview:
    """A safetensors file's bytes (tensor_bytes.py: without holding the GIL while copying). Torch is imported on
    first use: a restart reads ahead before it (read_ahead.py)."""
    from elastic_oneshot.durability import tensor_bytes

    return tensor_bytes.save(tensors, tensor_bytes.METADATA)


def load_tensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def default_root(output_dir: str) -> str:
    """Where a job's state lives unless told: beside its output."""
    return f"{output_dir.rstrip('/')}.state"


def read_events(root: str) -> list[dict]:
    """The history of the state at `root` (a directory or a URL), skipping an event torn by a kill."""
    return open_storage(root).events()


class StateStore:
    def __init__(self, root: str, retry_s: float = RETRY_S):
        """The state at `root`, a directory or a URL; an object store's requests are retried for `retry_s` s."""
        self.storage = open_storage(root, retry_s)
        self.root, self.retry_s = self.storage.root, retry_s
        self.parent: StateStore | None = None  # the job's state, for a pass's (`stage`)

    def stage(self, folder: str) -> StateStore:
        """The state of a recipe's pass before its last (layout.stage): its commits, solved groups, boundaries,
        epochs and events under `folder`; the job (job.json) and its tokens are this state's."""
        child = StateStore(self.storage.where(folder), self.retry_s)
        child.parent = self
        return child

    @property
    def local(self) -> str | None:
        """The directory, for a state on local disk."""
        return self.storage.local

    def writable(self, option: str):
        """UsageError, before any work, if the state cannot be written (storage.Storage.writable)."""
        self.storage.writable(option)

    def path(self, rel: str) -> str:
        return self.storage.where(rel)

    def names(self, folder: str) -> list[str]:
        """Names in `folder` of the state (files and folders); [] if none."""
        return self.storage.names(folder)

    def sizes(self, folder: str) -> dict[str, int]:
        """The files in `folder` of the state with their sizes, from one listing; {} if none."""
        return self.storage.sizes(folder)

    def remove(self, rel: str):
        """Delete the file or folder `rel` if it can (what is left is removed with the next)."""
        self.storage.remove(rel, best_effort=True)

    # -- files --------------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes, exclusive: bool = False) -> dict:
        """Durably write `data` at `rel`; return its record {path, size, xxh3_128}. With `exclusive`, fail
        with FileExistsError if `rel` exists (atomically: link(2), or a conditional put). A storage that
        refuses (full, read-only, unreachable) raises StorageError, and nothing is left at `rel`."""
        self.storage.put(rel, data, exclusive)
        metrics.bytes_written(self.root, len(data))
        return {"path": rel, "size": len(data), "xxh3_128": digest(data)}

    def read_ahead(self, records: list[dict]):
        """Start reading these files, in this order, on a thread of their own: any StateStore of this root that
        reads one later takes its bytes from there, checked as any read (and read again if they do not check), until
        `forget_read_ahead`. A restart's first reads begin this way while the process is still starting."""
        futures = _AHEAD[self.root] = {r["path"]: Future() for r in records}

        def read():  # a daemon thread: a process that ends early does not wait for reads it no longer needs
            began = time.perf_counter()
            for r in records:
                if futures[r["path"]].set_running_or_notify_cancel():
                    try:
                        futures[r["path"]].set_result(self.storage.get(r["path"], r["size"]))
                    except Exception as e:
                        futures[r["path"]].set_exception(e)
            log.info("read ahead %d files (%.1f MB) in %.1f s", len(records), sum(r["size"] for r in records) / 1e6,
                     time.perf_counter() - began)

        threading.Thread(target=read, name="read-ahead", daemon=True).start()

    def forget_read_ahead(self):
        """Drop the files read ahead and not read since (a guess that verification proved wrong)."""
        for future in _AHEAD.pop(self.root, {}).values():
            future.cancel()

    def read_bytes(self, record: dict) -> bytes:
        """The bytes of the file `record` names, checked against its size and digest (CorruptStateError)."""
        ahead = _AHEAD.get(self.root, {}).pop(record["path"], None)
        if ahead is not None:
            try:
                return self._checked(record, ahead.result())
            except (CorruptStateError, StorageError, OSError, CancelledError):  # stale, failed or dropped: read now
                pass
        return self._checked(record, self.storage.get(record["path"], record["size"]))

    def _checked(self, record: dict, data: bytes | None) -> bytes:
        if data is None:
            raise CorruptStateError(f"{record['path']} is missing")
        metrics.bytes_read(self.root, len(data))
        if len(data) != record["size"]:
            raise CorruptStateError(f"{record['path']} has {len(data)} bytes, expected {record['size']}")
        if digest(data) != record["xxh3_128"]:
            raise CorruptStateError(f"{record['path']} does not match its checksum")
        return data

    def write_tensors(self, rel: str, tensors: dict[str, torch.Tensor]) -> dict:
        return self.write_bytes(rel, save_tensors(tensors))

    def read_tensors(self, record: dict) -> dict[str, torch.Tensor]:
        return load_tensors(self.read_bytes(record))

    def write_json(self, rel: str, body: dict, exclusive: bool = False):
        """A JSON record that carries its own checksum, so a truncated or edited one is detected."""
        self.write_bytes(rel, record_json({"body": body, "sha256": hashlib.sha256(canonical_json(body)).hexdigest()}),
                         exclusive)

    def read_json(self, rel: str) -> dict | None:
        """The record's body; None if absent; CorruptStateError if unreadable or altered."""
        raw = self.storage.get(rel)
        if raw is None:
            return None
        metrics.bytes_read(self.root, len(raw))
        try:
            doc = json.loads(raw)
            body = doc["body"]
            ok = hashlib.sha256(canonical_json(body)).hexdigest() == doc["sha256"]
        except (ValueError, KeyError, TypeError):
            raise CorruptStateError(f"{rel} is not a readable record (truncated?)") from None
        if not ok:
            raise CorruptStateError(f"{rel} does not match its checksum")
        return body

    # -- the job --------------------------------------------------------------------------------
    def holds(self, job: dict) -> bool:
        """Whether this directory already belongs to `job` (a dict with a 'fingerprint')."""
        try:
            current = self.read_json(layout.JOB)
        except CorruptStateError:
            return False
        return current is not None and current.get("fingerprint") == job["fingerprint"]

    def claim(self, job: dict, tokens: torch.Tensor, restart: bool = False):
        """Start `job` here with its calibration samples. A directory holding another job (or anything
        else) is refused unless `restart`, which clears our files first."""
        try:
            current = self.read_json(layout.JOB)
        except CorruptStateError as e:
            if not restart:
                raise UsageError(f"state directory {self.root}: {e}; use --restart to start over") from None
            current = None
        if current is not None and not restart:
            raise self._taken(current, job)
        if current is None and not restart and self._foreign():
            raise UsageError(f"state directory {self.root} is not empty and holds no elastic-oneshot "
                             "job: choose an empty or new directory")
        self.clear()
        record = self.write_tensors(layout.TOKENS, {"input_ids": tokens})
        try:
            self.write_json(layout.JOB, {**job, "tokens": record}, exclusive=True)
        except FileExistsError:  # another process claimed the directory since it was read above
            raise self._taken(self.read_json(layout.JOB) or {}, job) from None

    def _taken(self, current: dict, job: dict) -> UsageError:
        """Why `job` cannot start in this directory, which holds `current` (job.json's body)."""
        if current.get("fingerprint") == job["fingerprint"]:  # it was not there when this process looked
            return UsageError(f"another process is starting the same job in {self.root}: let it run, "
                              "and run again to resume once it has stopped")
        diff = [k for k in ("model", "dataset", "recipe", "samples")
                if canonical_json(current.get("identity", {}).get(k)) != canonical_json(job["identity"][k])]
        return UsageError(f"state directory {self.root} belongs to another job (different "
                          f"{', '.join(diff) or 'format or code'}): use another --state, or --restart to discard it")

    def _foreign(self) -> list[str]:
        """Entries of a directory without job.json that a first claim, interrupted, did not leave."""
        names = self.names("")
        return [n for n in names if n != layout.TOKENS and not DEBRIS.fullmatch(n)]

    def tokens(self) -> torch.Tensor:
        """The job's calibration samples, as fixed when it started."""
        if self.parent is not None:
            return self.parent.tokens()
        return self.read_tensors(self.job()["tokens"])["input_ids"]

    def restore_tokens(self, tokens: torch.Tensor):
        """Write the calibration samples again, if they are byte for byte those that job.json records."""
        data = save_tensors({"input_ids": tokens})
        record = self.job()["tokens"]
        if len(data) != record["size"] or digest(data) != record["xxh3_128"]:
            raise UsageError(f"{record['path']} in {self.root} is lost or damaged, and the dataset now yields other "
                             "samples: restore the dataset, or use --restart to start over")
        self.write_bytes(record["path"], data)

    def job(self) -> dict:
        if self.parent is not None:
            return self.parent.job()
        job = self.read_json(layout.JOB)
        if job is None:
            raise UsageError(f"{self.root} holds no elastic-oneshot state (no job.json)")
        return job

    def clear(self):
        for name in layout.EVERYTHING:
            self.storage.remove(name)
        self.storage.make_root()
        self.remove_debris()

    def remove_debris(self):
        """Delete what interrupted writes left (storage.LocalStorage.remove_debris). Rank 0 calls this at start,
        before work."""
        self.storage.remove_debris()

    def append_event(self, event: dict):
        """One event of the history (events.jsonl, or its own object): for people and tools, not part of any
        commit."""
        self.storage.append_event(event)

    def events(self) -> list[dict]:
        return self.storage.events()
