"""Where the checkpoint goes: a local directory, or an object-store prefix (`s3://`, `gs://`, `az://`, `file://`
URLs); `open_destination` is the one place that tells them apart. Either way the export (export.py) builds the
whole checkpoint in a local directory the destination lends it (`building`), and the destination publishes it. Both
know what is this job's by one rule (`owned`): a marker (elastic-oneshot.json) names the job's fingerprint and the
files it wrote; a destination holding anything no marker of this job lists is refused, and nothing is deleted or
replaced that a marker of this job does not list.

A directory: the checkpoint is built in OUT.partial, claimed for the job before any work (so that a second job on
the same --output is refused at its start), and renamed into place; a previous checkpoint of this job is swapped
with it atomically where the filesystem can (else it goes to OUT.old first), and removed last. Its files are on the
disk before it is in place, and it is in place before the previous one is removed.

A prefix: built in a temporary directory ($TMPDIR), then uploaded. An object store has no rename, so the marker
goes up last: a reader sees the checkpoint complete only with it. Before anything else, a pending marker
(elastic-oneshot.pending.json) goes up, naming this job and every file of the prefix it may leave behind, so that an
interrupted upload is known as this job's and finished by the next export.
"""

import abc
import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from elastic_oneshot.durability.layout import MARKER, PENDING
from elastic_oneshot.durability.storage import LocalStorage, Storage, open_storage
from elastic_oneshot.errors import StorageError, UsageError
from elastic_oneshot.jsonforms import record_json


def open_destination(output: str) -> "Destination":
    """The destination `output` names: a local directory, or an object-store prefix (by its storage)."""
    storage = open_storage(output, option="--output")
    return Directory(storage) if storage.local else Prefix(storage)


def marker(fingerprint: str, files: list[str]) -> bytes:
    return record_json({"files": files, "fingerprint": fingerprint, "written_by": "elastic-oneshot"})


def listed(data: bytes | None, fingerprint: str) -> list[str] | None:
    """The files a marker (its bytes) lists, if it is this job's; None if absent, unreadable or another job's."""
    try:
        record = json.loads(data or b"")
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != fingerprint:
        return None
    return list(record.get("files") or [])


def owned(storage: Storage, fingerprint: str) -> set[str]:
    """The files of `storage` that this job's markers list (with the markers); UsageError if there is anything
    else."""
    where, names = storage.given, set(storage.names(""))
    mine, foreign = set(), False
    for name in (MARKER, PENDING):
        if name in names:
            files = listed(storage.get(name), fingerprint)
            foreign |= files is None
            mine |= {name, *(files or [])}
    if names and (foreign or not mine):
        raise UsageError(f"--output {where} exists and is not this job's checkpoint: give a new --output, "
                         "or move it away")
    extra = sorted(names - mine)
    if extra:
        raise UsageError(f"--output {where} holds files this tool did not write ({', '.join(extra[:3])}): "
                         "move them away")
    return mine


class Destination(abc.ABC):
    """The checkpoint's place, through its storage, in DCP's order: `check` (before any work, and again before
    publishing), `claim`, `building` (written whole in a local directory), `publish` (the marker last)."""

    def __init__(self, storage: Storage):
        self.storage, self.out, self.local = storage, storage.given.rstrip("/") or storage.given, storage.local

    def preflight(self):
        """What can be checked before the model is read."""
        self.storage.writable("--output", beside=True)

    def check(self, fingerprint: str, state_root: str):
        """Refuse, before any work, an output this job may not write."""
        owned(self.storage, fingerprint)

    def claim(self, fingerprint: str):  # noqa: B027  (a prefix is checked again at its upload)
        """Rank 0, once the state is this job's: the output is taken for it."""

    @abc.abstractmethod
    def building(self, fingerprint: str) -> contextlib.AbstractContextManager[str]:
        """A local directory to build the checkpoint in; removed if the build fails."""

    @abc.abstractmethod
    def publish(self, built: str, fingerprint: str):
        """Put the checkpoint built in `built` in place."""


class Directory(Destination):
    """OUT, built in OUT.partial (claimed before any work, so that a second job on it is refused at its start) and
    swapped into place (LocalStorage.swap)."""

    def __init__(self, storage: Storage):
        super().__init__(storage)
        self.partial = LocalStorage(f"{storage.root}.partial", "--output")

    def check(self, fingerprint: str, state_root: str | None = None):
        """Also refuses leftovers of an interrupted export (OUT.partial, OUT.old) that are not this job's."""
        super().check(fingerprint, state_root)
        for leftover in (self.partial, LocalStorage(f"{self.storage.root}.old", "--output")):
            if os.path.lexists(leftover.root) and listed(leftover.get(MARKER), fingerprint) is None:
                raise UsageError(f"{leftover.root} is in the way of the export and is not this job's: move it away")

    def claim(self, fingerprint: str):
        """OUT.partial holding this job's marker. Made aside and renamed into place: renaming a directory is
        atomic, so of two jobs claiming at once one wins and the other sees its marker."""
        aside = LocalStorage(f"{self.partial.root}.{uuid.uuid4().hex[:8]}", "--output")
        try:
            aside.make_root()
            aside.put(MARKER, marker(fingerprint, []))
            if not os.path.lexists(self.storage.root) and not os.path.lexists(self.partial.root):
                os.rename(aside.root, self.partial.root)
        except (OSError, StorageError):
            pass  # another job claimed it meanwhile: check() says whose it is
        finally:
            aside.remove("", best_effort=True)
        self.check(fingerprint)

    @contextlib.contextmanager
    def building(self, fingerprint: str) -> Iterator[str]:
        self.partial.remove("")  # an interrupted export of this job: check() read its marker
        try:
            yield self.partial.root
        except BaseException:
            self.partial.remove("", best_effort=True)
            raise

    def publish(self, built: str, fingerprint: str):
        self.check(fingerprint)  # again: the export took a while, and OUT is the user's to change meanwhile
        try:
            self.storage.swap(built)
        except OSError as e:  # a disk that fails the fsync (EIO; ENOSPC on NFS, which writes back only then)
            raise StorageError(self.storage.given, e) from None


class Prefix(Destination):
    """A prefix, built in a temporary directory and uploaded: an object store has no rename, so the marker goes up
    last (a reader sees the checkpoint complete only with it), after a pending marker naming every file of the
    prefix the upload may leave behind, so that an interrupted upload is known as this job's and finished by the
    next export."""

    def check(self, fingerprint: str, state_root: str):
        """Also refuses a prefix that overlaps the state's, or that cannot be written."""
        out, state = self.out, state_root.rstrip("/")
        if state == out or state.startswith(out + "/") or out.startswith(state + "/"):
            raise UsageError(f"--output {out} and --state {state} overlap: give each its own prefix")
        super().check(fingerprint, state_root)
        self.storage.writable("--output")

    def preflight(self):  # checked with the job's fingerprint
        pass

    @contextlib.contextmanager
    def building(self, fingerprint: str) -> Iterator[str]:
        scratch = tempfile.mkdtemp(prefix="elastic-oneshot-export-")
        try:
            yield os.path.join(scratch, "checkpoint")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def publish(self, built: str, fingerprint: str):
        """The pending marker, then the files in parallel, then what this job wrote before and no longer writes is
        deleted, then the marker, last; the pending marker goes after it."""
        storage = self.storage
        before = owned(storage, fingerprint)  # again: the prefix is the user's
        files = sorted(set(os.listdir(built)) - {MARKER})
        storage.put(PENDING, marker(fingerprint, sorted(before | set(files))))
        storage.remove(MARKER)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda name: storage.upload(name, os.path.join(built, name)), files))
        for name in sorted(before - set(files) - {MARKER, PENDING}):
            storage.remove(name)
        storage.upload(MARKER, os.path.join(built, MARKER))
        storage.remove(PENDING)


def write_marker(directory: str, fingerprint: str, files: list[str]):
    LocalStorage(directory, "--output").put(MARKER, marker(fingerprint, files))
