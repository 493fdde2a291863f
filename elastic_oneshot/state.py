"""The state directory: atomic, checksummed files and the per-layer commit records.

Layout (docs/state-format.md is the specification):
    job.json                          what is being compressed, and its fingerprint
    epoch.json                        the job's epoch: incremented at every (re)start of the workers
    tokens.safetensors                the calibration samples, [num_samples, seq_len] int64
    layers/LLLLL/weights.rR.safetensors   layer L's compressed tensors written by rank R
    boundaries/LLLLL/chunk-CCCCC.safetensors  the inputs of layer L for sample chunk C
    commits/LLLLL.json                layer L's manifest: written last, by atomic rename; it is the commit
    events.jsonl                      history for people and `status` (never trusted for progress)

Every file is written to a temporary name, fsynced, renamed, and its directory fsynced. Files are
listed with size and sha256 in the record that refers to them, and verified when read: a torn or
altered file is reported, never used. Only safetensors and JSON are ever read back.
"""

import hashlib
import json
import os
import shutil

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import CorruptStateError, UsageError

FORMAT = 1


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class StateStore:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    # -- files --------------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes) -> dict:
        """Durably write `data` at `rel`; return its record {path, size, sha256}."""
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

    def write_json(self, rel: str, body: dict):
        """A JSON record that carries its own checksum, so a truncated or edited one is detected."""
        self.write_bytes(rel, json.dumps({"body": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()},
                                         indent=1, sort_keys=True).encode())

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
    def claim(self, job: dict, restart: bool = False) -> bool:
        """Own this directory for `job` (a dict with a 'fingerprint'); True if it already held it.

        A directory holding another job is refused unless `restart`, which clears our files first.
        """
        try:
            current = self.read_json("job.json")
        except CorruptStateError as e:
            if not restart:
                raise UsageError(f"state directory {self.root}: {e}; use --restart to start over") from None
            current = None
        if current is not None and current.get("fingerprint") == job["fingerprint"] and not restart:
            return True
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
        self.write_json("job.json", job)
        return False

    def next_epoch(self) -> int:
        """Start a new epoch of workers: every (re)start of the job increments it, and commits carry it."""
        try:
            current = self.read_json("epoch.json") or {"epoch": 0}
        except CorruptStateError:
            current = {"epoch": max((self.manifest_epochs() or [0]))}
        epoch = current["epoch"] + 1
        self.write_json("epoch.json", {"epoch": epoch})
        return epoch

    def manifest_epochs(self) -> list[int]:
        out = []
        for name in sorted(os.listdir(self.path("commits"))) if os.path.isdir(self.path("commits")) else []:
            try:
                out.append(self.read_json(f"commits/{name}")["epoch"])
            except (CorruptStateError, TypeError, KeyError):
                pass
        return out

    def job(self) -> dict:
        job = self.read_json("job.json")
        if job is None:
            raise UsageError(f"{self.root} holds no elastic-oneshot state (no job.json)")
        return job

    def clear(self):
        for name in ("commits", "layers", "boundaries", "job.json", "epoch.json", "tokens.safetensors",
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
        try:
            with open(self.path("events.jsonl")) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line torn by a kill
        return out

    # -- layers ------------------------------------------------------------------------------
    @staticmethod
    def layer_dir(kind: str, layer: int) -> str:
        return f"{kind}/{layer:05d}"

    def manifest(self, layer: int) -> dict | None:
        return self.read_json(f"commits/{layer:05d}.json")

    def commit(self, layer: int, manifest: dict):
        self.write_json(f"commits/{layer:05d}.json", manifest)

    def verify_layer(self, layer: int) -> dict | None:
        """Layer's manifest if it is committed and its weight files check out; else None, with the reason
        raised as CorruptStateError when something is there but wrong."""
        manifest = self.manifest(layer)
        if manifest is None:
            return None
        for record in manifest["weights"]:
            self.read_bytes(record)
        return manifest

    def prune_boundaries(self, keep: set[int]):
        """Delete boundary directories not in `keep` (committed layers' records may still name them;
        a reader that misses one recomputes it)."""
        root = self.path("boundaries")
        if not os.path.isdir(root):
            return
        for name in os.listdir(root):
            if name.isdigit() and int(name) not in keep:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
