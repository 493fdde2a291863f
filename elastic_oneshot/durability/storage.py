"""Where a state lives: a local (POSIX) directory, or an object store (`s3://`, `gs://`, `az://`, `file://` URLs).

The state (state.py) needs five operations of its storage: write an object whole, optionally only if no object of
that name exists (the commit protocol's fences and commits); read one back whole; list a folder; delete a folder;
and add an event to the history. A local directory does them with fsync, rename(2) and link(2) (LocalStorage, the
format docs/state-format.md specifies). An object store does them with single PUTs, which land whole or not at
all, and a PUT with `If-None-Match: *` for the exclusive ones (ObjectStorage, through obstore: the Rust
object_store crate, which speaks S3, GCS and Azure natively, with conditional puts and multipart uploads). An
object store cannot append, so there each event is an object of its own under events/; `events()` reads both
layouts.

Listing is used only where a stale list costs work but never correctness: a fence missed by a list makes the
next fence's conditional create fail (the process stops as stale), a commit or solved-group record missed is
redone. Read-after-write of one object must be strong, and the conditional create atomic: AWS S3 (and its strong
list consistency since 2020), GCS, Azure Blob, MinIO and R2 give both.

Credentials and endpoints come from where their tools keep them, never from the URL, so never into job.json or
events: for s3:// botocore's chain, as the AWS CLI finds them (aws_options); for gs:// and az:// the environment
as object_store reads it (GOOGLE_APPLICATION_CREDENTIALS or gcloud's application default credentials;
AZURE_STORAGE_*).
"""

import abc
import contextlib
import ctypes
import datetime
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

import obstore
import obstore.exceptions
from obstore.store import from_url

from elastic_oneshot.durability import layout
from elastic_oneshot.errors import StorageError, UsageError
from elastic_oneshot.jsonforms import event_line
from elastic_oneshot.retry import retrying

log = logging.getLogger("elastic_oneshot")

DEBRIS = re.compile(r".+\.tmp(\d+)")  # the temporary name of a local write that was interrupted
URL = re.compile(r"[a-z][a-z0-9+.-]*://")
PART = 8 << 20  # bytes: objects larger than this go up as multipart uploads and come down as ranged reads, in parallel
RETRY_S = 20.0  # s of retries of one request by default; a job passes half its collective timeout
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # from <fcntl.h> and <linux/fs.h>
_TRANSIENT = re.compile(r"status code: (5\d\d|429)|error sending request|error decoding response body|timed out|"
                        r"[Cc]onnection (reset|closed|refused)|SlowDown|Throttl")


def is_url(location) -> bool:
    """Whether `location` (a str or a path) is a URL."""
    return isinstance(location, str) and bool(URL.match(location))


def open_storage(location: str, retry_s: float = RETRY_S, option: str = "--state") -> "Storage":
    """The storage at `location` (given as `option`): a URL names an object store (its requests retried for `retry_s`
    seconds), anything else a local directory."""
    return ObjectStorage(location, retry_s) if is_url(location) else LocalStorage(location, option)


class Storage(abc.ABC):
    """Objects named by paths relative to `root` ("layers/00003/e00001.r0.b0000.json"), written whole."""

    root: str  # shown to people: an absolute directory or the URL
    local: str | None = None  # the directory, for a local one: the checks that model, state and output are apart

    def where(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    @abc.abstractmethod
    def writable(self, option: str, beside: bool = False):
        """UsageError, before any work, if nothing can be written here (or `beside` it, where a directory is built
        and moved into place); `option` names it."""

    @abc.abstractmethod
    def put(self, rel: str, data: bytes, exclusive: bool = False):
        """Durably store `data` at `rel`. With `exclusive`, FileExistsError if `rel` exists, decided atomically by
        the storage. A refusal (full, read-only, unreachable) raises StorageError and leaves nothing at `rel`."""

    @abc.abstractmethod
    def get(self, rel: str, size: int | None = None) -> bytes | None:
        """The bytes at `rel`; None if absent. `size`, if known, lets a large object come down in parallel parts."""

    @abc.abstractmethod
    def names(self, folder: str) -> list[str]:
        """Names of the files and folders directly in `folder` ("" for the root); [] if none."""

    @abc.abstractmethod
    def sizes(self, folder: str) -> dict[str, int]:
        """The files directly in `folder` with their sizes in bytes, from one listing; {} if none."""

    @abc.abstractmethod
    def remove(self, rel: str, best_effort: bool = False):
        """Delete the file or the whole folder `rel`, if present; with `best_effort`, errors are ignored."""

    @abc.abstractmethod
    def append_event(self, event: dict):
        """Add `event` to the history (events.jsonl, or one object under events/)."""

    def make_root(self):  # noqa: B027  (an object store has no folders to make)
        """Make the root exist, for a state about to be written."""

    def remove_debris(self):  # noqa: B027  (an object store leaves no debris: a put lands whole or not at all)
        """Delete what interrupted writes left."""

    def events(self) -> list[dict]:
        """The history: lines of events.jsonl, then the objects under events/ in the order of their names (time),
        skipping what a kill tore."""
        lines = (self.get(layout.EVENTS) or b"").decode(errors="replace").splitlines()
        names = sorted(n for n in self.names(layout.EVENT_FOLDER) if n.endswith(".json"))
        with ThreadPoolExecutor(16) as pool:
            lines += [(b or b"").decode(errors="replace")
                      for b in pool.map(self.get, [f"{layout.EVENT_FOLDER}/{n}" for n in names])]
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


def _fsync(path: str):
    """A file, or a directory's names, on the disk. A filesystem that cannot fsync a directory (EINVAL: some network
    and FUSE ones) is let be, as databases let it: its names are as durable as it makes them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (e.errno == errno.EINVAL and os.path.isdir(path)):
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: str):
    """Every file and directory under `root`, and `root`, on the disk."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(os.path.join(folder, name))
        _fsync(folder)


def _write_durably(path: str, data: bytes):
    """`data` at `path`, fsynced; a parent directory created here is fsynced into its own parent."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        _fsync(os.path.dirname(parent))
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _link(tmp: str, path: str) -> bool:
    """Give `tmp`'s file the name `path` unless that exists (link(2) is atomic); `tmp` goes either way."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(tmp)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (on another host sharing the directory, it may be any)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return pid != 0


class LocalStorage(Storage):
    """A directory: every file written to `NAME.tmpPID`, fsynced, then renamed (or, if exclusive, hard-linked) to
    `NAME`, and its directory fsynced. Its path is resolved once, when opened: a link in it re-pointed while the job
    runs leaves the job where it began (it would otherwise write into whatever the link leads to now)."""

    def __init__(self, root: str, option: str = "--state"):
        self.given, self.root = root, os.path.realpath(root)  # as given, for messages; as resolved, for use
        self.local = self.root
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise UsageError(f"{option} {root} is a file, not a directory: give a directory path")

    def where(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def writable(self, option: str, beside: bool = False):
        """Create and remove a file where the directory (existing or to be made) will be written, or `beside` it.
        A dangling link is refused, not created: it may lead into a filesystem that is not mounted."""
        if os.path.islink(self.given) and not os.path.exists(self.given):
            raise UsageError(f"{option} {self.given} is a symbolic link to {os.readlink(self.given)}, which does not "
                             "exist: create it (or mount what holds it), or give another path")
        where = os.path.dirname(self.root.rstrip(os.sep)) if beside else self.root
        while not os.path.isdir(where):
            if os.path.lexists(where):
                raise UsageError(f"{option} {self.given}: {where} is a file, not a directory: give a path under a "
                                 "directory")
            where = os.path.dirname(where)
        try:
            fd, probe = tempfile.mkstemp(prefix=".elastic-oneshot-probe-", dir=where)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise UsageError(f"{option} {self.given}: cannot create a file in {where} "
                             f"({errno.errorcode.get(e.errno, e.errno)}: {e.strerror}): give a writable "
                             "location") from None

    def swap(self, built: str):
        """The directory `built` becomes this one, durably: its files are fsynced before it is put in place (a
        crash after the swap would otherwise find them empty or short, under the name of a finished one), and the
        swap before the previous one is removed. A previous one is swapped with it in one step where the
        filesystem can (renameat2's RENAME_EXCHANGE: this directory is never missing), else moved to ROOT.old
        first; either way it is removed last."""
        _fsync_tree(built)
        old, parent = f"{self.root}.old", os.path.dirname(self.root)
        if os.path.lexists(old):
            shutil.rmtree(old)
        if os.path.isdir(self.root) and os.listdir(self.root):
            if _exchange(built, self.root):
                _fsync(parent)
                shutil.rmtree(built)  # the previous one, now there
                return
            os.replace(self.root, old)
            os.replace(built, self.root)
            _fsync(parent)
            shutil.rmtree(old)
        else:
            os.replace(built, self.root)  # rename(2) also replaces an empty directory
            _fsync(parent)

    def put(self, rel: str, data: bytes, exclusive: bool = False):
        path = self.where(rel)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            _write_durably(tmp, data)
            placed = _link(tmp, path) if exclusive else True
            if not exclusive:
                os.replace(tmp, path)
            if placed:
                _fsync(os.path.dirname(path))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise StorageError(path, e) from None
        if not placed:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)

    def get(self, rel: str, size: int | None = None) -> bytes | None:
        try:
            with open(self.where(rel), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def names(self, folder: str) -> list[str]:
        path = self.where(folder) if folder else self.root
        return os.listdir(path) if os.path.isdir(path) else []

    def sizes(self, folder: str) -> dict[str, int]:
        try:
            with os.scandir(self.where(folder)) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def remove(self, rel: str, best_effort: bool = False):
        path = self.where(rel)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=best_effort)
        elif os.path.exists(path):
            with contextlib.suppress(*((OSError,) if best_effort else ())):
                os.remove(path)

    def make_root(self):
        os.makedirs(self.root, exist_ok=True)

    def append_event(self, event: dict):
        path = self.where(layout.EVENTS)
        try:
            with open(path, "ab") as f:
                f.write(event_line(event))
        except OSError as e:
            raise StorageError(path, e) from None

    def remove_debris(self):
        """Delete the temporary files of interrupted writes (`NAME.tmpPID`). A file of a process alive here is
        left to it: a worker frozen mid-write and woken after this start is then told that it was fenced off,
        not that its file vanished."""
        for folder, _, names in os.walk(self.root):
            for name in names:
                found = DEBRIS.fullmatch(name)
                if found and not _alive(int(found.group(1))):
                    os.remove(os.path.join(folder, name))


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


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` says the store is unreachable or busy for now (5xx, throttled, timed out, connection cut),
    not that the request is wrong. object_store reports these only in its message."""
    return isinstance(exc, obstore.exceptions.GenericError) and bool(_TRANSIENT.search(_first_line(exc)))


def _first_line(exc: BaseException) -> str:
    return str(exc).split("\n", 1)[0]


class ObjectStorage(Storage):
    """An object store bucket and prefix. Every request is retried on transient errors for `retry_s` seconds (with
    object_store's own retries off, so that one budget holds): puts of objects written once under a name no other
    writer uses are idempotent; an exclusive put is conditional, and if a retry finds the object there the race
    counts as lost, which is safe (the caller stops as stale; the object, if its own, is a valid record)."""

    def __init__(self, url: str, retry_s: float = RETRY_S):
        self.root, self.given, self.retry_s = url.rstrip("/"), url, retry_s
        # file://: obstore's local store renames and links into place without fsync; `_settle` does it
        self.folder = urllib.parse.unquote(urllib.parse.urlparse(self.root).path) \
            if self.root.startswith("file://") else None
        kwargs = {"mkdir": True} if self.folder else aws_options(self.root)
        self.store = from_url(self.root, retry_config={"max_retries": 0, "retry_timeout": _seconds(retry_s)},
                              **kwargs)

    def _call(self, what: str, fn, *args, **kwargs):
        """`fn(*args, **kwargs)`, retried on transient errors; `what` (a verb and a path) goes to the log."""
        def logged(attempt):
            log.warning("object store: retrying %s after %s", what, _first_line(attempt.outcome.exception()))

        return retrying("storage", self.retry_s, is_transient, before_sleep=logged)(fn, *args, **kwargs)

    def put(self, rel: str, data: bytes, exclusive: bool = False):
        try:
            self._call(f"put {rel}", obstore.put, self.store, rel, data, mode="create" if exclusive else "overwrite",
                       use_multipart=False if exclusive else len(data) > PART, chunk_size=PART)
        except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), self.where(rel)) from None
        except (obstore.exceptions.BaseError, OSError) as e:
            raise StorageError(self.where(rel), OSError(errno.EIO, _first_line(e))) from None
        self._settle(rel)

    def upload(self, rel: str, path: str):
        """The local file `path` to `rel`, streamed (a large one in parallel parts), never held in memory whole."""
        try:
            self._call(f"put {rel}", obstore.put, self.store, rel, pathlib.Path(path), chunk_size=PART)
        except (obstore.exceptions.BaseError, OSError) as e:
            raise StorageError(self.where(rel), OSError(errno.EIO, _first_line(e))) from None
        self._settle(rel)

    def _settle(self, rel: str):
        """On a file:// store, the object just put on the disk, and its name in every folder from its own up to
        the root (folders obstore made for it included), as a local directory's writes are."""
        if self.folder is None:
            return
        path = os.path.join(self.folder, rel)
        try:
            _fsync(path)
            while path != self.folder and path.startswith(self.folder):
                path = os.path.dirname(path)
                _fsync(path)
        except OSError as e:
            raise StorageError(self.where(rel), e) from None

    def get(self, rel: str, size: int | None = None) -> bytes | None:
        if size is not None and size > PART:
            starts = list(range(0, size, PART))
            with contextlib.suppress(obstore.exceptions.BaseError, OSError):  # not that size: read whole, judge then
                parts = self._call(f"get {rel} in parts", obstore.get_ranges, self.store, rel, starts=starts,
                                   ends=[min(s + PART, size) for s in starts])
                return b"".join(bytes(p) for p in parts)
        try:
            return self._call(f"get {rel}", lambda: bytes(obstore.get(self.store, rel).bytes()))
        except (FileNotFoundError, obstore.exceptions.NotFoundError):
            return None
        except obstore.exceptions.BaseError as e:
            raise self._unreadable(rel, e) from None

    def _listed(self, folder: str) -> dict:
        try:
            return self._call(f"list {folder}/", obstore.list_with_delimiter, self.store, folder or None)
        except obstore.exceptions.BaseError as e:
            raise self._unreadable(folder, e) from None

    def names(self, folder: str) -> list[str]:
        listed = self._listed(folder)
        return [p.rsplit("/", 1)[-1] for p in listed["common_prefixes"]] + \
            [o["path"].rsplit("/", 1)[-1] for o in listed["objects"]]

    def sizes(self, folder: str) -> dict[str, int]:
        return {o["path"].rsplit("/", 1)[-1]: o["size"] for o in self._listed(folder)["objects"]}

    def remove(self, rel: str, best_effort: bool = False):
        try:
            listed = self._call(f"list {rel}/", lambda: list(obstore.list(self.store, rel)))
            paths = [o["path"] for batch in listed for o in batch]
            if paths:  # a folder
                self._call(f"delete {rel}/", obstore.delete, self.store, paths)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self._call(f"delete {rel}", obstore.delete, self.store, rel)
        except (obstore.exceptions.BaseError, OSError) as e:
            if not best_effort:
                raise StorageError(self.where(rel), OSError(errno.EIO, _first_line(e))) from None

    def writable(self, option: str, beside: bool = False):
        """A probe object written and deleted: credentials, bucket and permissions checked before any work."""
        probe = f".elastic-oneshot-probe-{uuid.uuid4().hex}"
        self.put(probe, b"")
        self.remove(probe)

    def _unreadable(self, rel: str, e: Exception) -> OSError:
        """A failed read as the OSError the command line reports (denied, or unreachable past the retries)."""
        return OSError(errno.EIO, _first_line(e), self.where(rel))

    def append_event(self, event: dict):
        """events/<time in ns>.<random>.json: a name no other writer uses, in time order."""
        self.put(layout.event_object(time.time_ns(), uuid.uuid4().hex[:12]),
                 event_line(event))


def aws_options(url: str) -> dict:
    """from_url's credentials, region and endpoint for an s3:// URL, found as the AWS CLI finds them (botocore):
    the environment (AWS_ACCESS_KEY_ID..., AWS_REGION, AWS_ENDPOINT_URL[_S3]), then AWS_PROFILE's profile (or the
    default one) in ~/.aws/credentials and ~/.aws/config (keys, SSO, credential_process, assumed roles, region,
    endpoint_url), web identity, container and instance metadata. object_store alone reads only the environment.
    The keys stay in this process's memory (refreshed by obstore's provider when they expire)."""
    if not url.startswith(("s3://", "s3a://")):
        return {}
    import botocore.configprovider
    import botocore.exceptions
    import botocore.session
    from obstore.auth.boto3 import Boto3CredentialProvider

    session = botocore.session.get_session()
    try:
        region = os.environ.get("AWS_REGION") or session.get_config_variable("region")
        endpoint = botocore.configprovider.ConfiguredEndpointProvider(session.full_config,
                                                                      session.get_scoped_config(), "s3").provide()
        provider = Boto3CredentialProvider(session)
    except botocore.exceptions.BotoCoreError as e:
        raise UsageError(f"{url}: {e}") from None
    except ValueError:
        raise UsageError(f"{url}: no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                         "AWS_PROFILE naming a profile in ~/.aws/credentials or ~/.aws/config") from None
    config = {k: v for k, v in (("region", region), ("endpoint", endpoint)) if v}
    http = {"client_options": {"allow_http": True}} if (endpoint or "").startswith("http://") else {}
    return {"credential_provider": provider, "config": config, **http}


def _seconds(s: float):
    return datetime.timedelta(seconds=s)
