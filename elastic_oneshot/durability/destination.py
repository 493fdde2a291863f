"""Where the checkpoint goes: a local directory, or an object-store prefix (`s3://`, `gs://`, `az://`, `file://`
URLs); `open_destination` is the one place that tells them apart. Either way the export (export.py) builds the
whole checkpoint in a local directory the destination lends it (`building`), and the destination publishes it. Both
know what is this job's by one rule (`owned`): a marker (elastic-oneshot.json) names the job's fingerprint and the
files it wrote; a destination holding anything no marker of this job lists is refused, and nothing is deleted or
replaced that a marker of this job does not list.

A directory: the checkpoint is built in OUT.partial, claimed for the job before any work (so that a second job on
the same --output is refused at its start), and renamed into place; a previous checkpoint of this job is swapped
with it atomically where the filesystem can (else it goes to OUT.old first), and removed last.

A prefix: built in a temporary directory ($TMPDIR), then uploaded. An object store has no rename, so the marker
goes up last: a reader sees the checkpoint complete only with it. Before anything else, a pending marker
(elastic-oneshot.pending.json) goes up, naming this job and every file of the prefix it may leave behind, so that an
interrupted upload is known as this job's and finished by the next export.
"""

import abc
import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from elastic_oneshot.durability.storage import ObjectStorage, is_url
from elastic_oneshot.errors import UsageError
from elastic_oneshot.surface.preflight import check_writable

MARKER = "elastic-oneshot.json"  # in every checkpoint: the job's fingerprint and the files written
PENDING = "elastic-oneshot.pending.json"  # on a prefix, while an upload is under way
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # from <fcntl.h> and <linux/fs.h>


def open_destination(output: str) -> "Destination":
    """The destination `output` names: an object-store prefix for a URL, else a local directory."""
    return Prefix(output) if is_url(output) else Directory(output)


def marker(fingerprint: str, files: list[str]) -> bytes:
    return json.dumps({"files": files, "fingerprint": fingerprint, "written_by": "elastic-oneshot"}, indent=1,
                      sort_keys=True).encode()


def listed(data: bytes | None, fingerprint: str) -> list[str] | None:
    """The files a marker (its bytes) lists, if it is this job's; None if absent, unreadable or another job's."""
    try:
        record = json.loads(data or b"")
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != fingerprint:
        return None
    return list(record.get("files") or [])


def owned(where: str, names: set[str], read: Callable[[str], bytes | None], fingerprint: str) -> set[str]:
    """The `names` at `where` that this job's markers list (with the markers); UsageError if there is anything
    else. `read(name)` gives a file's bytes."""
    mine, foreign = set(), False
    for name in (MARKER, PENDING):
        if name in names:
            files = listed(read(name), fingerprint)
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
    def __init__(self, output: str):
        self.out = output.rstrip("/") or output

    local: str | None = None  # the directory, for the checks that model, state and output are apart

    def preflight(self):  # noqa: B027  (a prefix is checked with the job's fingerprint)
        """What can be checked before the model is read."""

    @abc.abstractmethod
    def check(self, fingerprint: str, state_root: str):
        """Refuse, before any work, an output this job may not write."""

    def claim(self, fingerprint: str):  # noqa: B027  (a prefix is checked again at its upload)
        """Rank 0, once the state is this job's: the output is taken for it."""

    @abc.abstractmethod
    def building(self, fingerprint: str) -> contextlib.AbstractContextManager[str]:
        """A local directory to build the checkpoint in; removed if the build fails."""

    @abc.abstractmethod
    def publish(self, built: str, fingerprint: str):
        """Put the checkpoint built in `built` in place."""


class Directory(Destination):
    def __init__(self, output: str):
        super().__init__(output)
        self.local = self.out

    def preflight(self):
        check_writable(self.out, "--output", beside=True)

    def check(self, fingerprint: str, state_root: str | None = None):
        """Also refuses leftovers of an interrupted export (OUT.partial, OUT.old) that are not this job's."""
        out = self.out
        if os.path.lexists(out) and not os.path.isdir(out):
            raise UsageError(f"--output {out} is a file, not a directory: give a directory path")
        if os.path.isdir(out):
            owned(out, set(os.listdir(out)), lambda name: _read(os.path.join(out, name)), fingerprint)
        for leftover in (f"{out}.partial", f"{out}.old"):
            if os.path.lexists(leftover) and listed(_read(os.path.join(leftover, MARKER)), fingerprint) is None:
                raise UsageError(f"{leftover} is in the way of the export and is not this job's: move it away")

    def claim(self, fingerprint: str):
        """OUT.partial holding this job's marker. Made aside and renamed into place: renaming a directory is
        atomic, so of two jobs claiming at once one wins and the other sees its marker."""
        aside = f"{self.out}.partial.{uuid.uuid4().hex[:8]}"
        os.makedirs(aside)
        try:
            _write(os.path.join(aside, MARKER), marker(fingerprint, []))
            if not os.path.lexists(self.out) and not os.path.lexists(f"{self.out}.partial"):
                os.rename(aside, f"{self.out}.partial")
        except OSError:
            pass  # another job claimed it meanwhile: check() says whose it is
        finally:
            shutil.rmtree(aside, ignore_errors=True)
        self.check(fingerprint)

    @contextlib.contextmanager
    def building(self, fingerprint: str) -> Iterator[str]:
        partial = f"{self.out}.partial"
        if os.path.lexists(partial):
            shutil.rmtree(partial)  # an interrupted export of this job: check() read its marker
        try:
            yield partial
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def publish(self, built: str, fingerprint: str):
        """OUT.partial becomes OUT. A previous checkpoint of this job is swapped with it in one step where the
        filesystem can (renameat2's RENAME_EXCHANGE: OUT is never missing), else moved to OUT.old first; either way
        it is removed last."""
        out, old = self.out, f"{self.out}.old"
        self.check(fingerprint)  # again: the export took a while, and OUT is the user's to change meanwhile
        if os.path.lexists(old):
            shutil.rmtree(old)  # this job's, by its marker
        if os.path.isdir(out) and os.listdir(out):
            if _exchange(built, out):
                shutil.rmtree(built)  # the previous checkpoint, now there
                return
            os.replace(out, old)
            os.replace(built, out)
            shutil.rmtree(old)
        else:
            os.replace(built, out)  # rename(2) also replaces an empty directory


class Prefix(Destination):
    def check(self, fingerprint: str, state_root: str):
        """Also refuses a prefix that overlaps the state's, or that cannot be written."""
        out, state = self.out, state_root.rstrip("/")
        if state == out or state.startswith(out + "/") or out.startswith(state + "/"):
            raise UsageError(f"--output {out} and --state {state} overlap: give each its own prefix")
        storage = ObjectStorage(out)
        owned(out, set(storage.names("")), storage.get, fingerprint)
        probe = f".elastic-oneshot-probe-{uuid.uuid4().hex}"
        storage.put(probe, b"")
        storage.remove(probe)

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
        storage = ObjectStorage(self.out)
        before = owned(self.out, set(storage.names("")), storage.get, fingerprint)  # again: the prefix is the user's
        files = sorted(set(os.listdir(built)) - {MARKER})
        storage.put(PENDING, marker(fingerprint, sorted(before | set(files))))
        storage.remove(MARKER)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda name: storage.upload(name, os.path.join(built, name)), files))
        for name in sorted(before - set(files) - {MARKER, PENDING}):
            storage.remove(name)
        storage.upload(MARKER, os.path.join(built, MARKER))
        storage.remove(PENDING)


def _exchange(a: str, b: str) -> bool:
    """Swap the directories `a` and `b` atomically (Linux's renameat2 with RENAME_EXCHANGE); False where the
    system or the filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def write_marker(directory: str, fingerprint: str, files: list[str]):
    _write(os.path.join(directory, MARKER), marker(fingerprint, files))


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _write(path: str, data: bytes):
    with open(path, "wb") as f:
        f.write(data)
