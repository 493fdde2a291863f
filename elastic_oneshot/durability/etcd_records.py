"""Job state in etcd: `--coordinator etcd://HOST:PORT/PREFIX`. The epochs, commits and progress live in etcd; the
files (weights, boundaries, tokens, job.json, events) stay in the state directory on shared storage.

    etcd://127.0.0.1:2379/jobs/llama-w4                      plain http
    etcd://h:2379/jobs/x?cacert=ca.pem&cert=me.pem&key=me.key  TLS with a client certificate (all three, or cacert only)
    etcd://h:2379/jobs/x?user=u&password=p                   etcd authentication (or set ELASTIC_ONESHOT_ETCD_PASSWORD)
    further options: ttl=10 (s, worker leases), retry_timeout=8 (s of retrying an unreachable etcd)

job.json records the URL without its password, and every reader of the state (export, status) uses it from there:
give them the password in ELASTIC_ONESHOT_ETCD_PASSWORD.

Keys under PREFIX:
    job                  {"fingerprint", "state"}: the job, and the state directory, these keys belong to
    epoch                the current epoch (decimal); only ever grows, also across --restart
    epochs/EEEEE         fence of epoch E: {"epoch", "committed": {layer: epoch}, "nonce", "time"}; created once
    cursor               "E:L": the layer epoch E commits next
    commits/EEEEE/LLLLL  layer L's manifest (JSON), committed in epoch E
    progress             {"epoch", "world_size", "layers_committed", "layers_total", "last_layer", "last_commit_time",
                          "time", "done"}, written by the same transactions as the epochs and commits
    workers/R            rank R's liveness {"rank", "host", "pid", "lease", "nonce"}, bound to its lease

Choices:
- The manifest itself is in etcd, written by the commit transaction. The commit and the record of what it commits
  are then one atomic step (no window where a manifest file exists uncommitted or a commit names a missing file,
  and nothing rests on the shared filesystem's rename atomicity or cache coherence for the truth); readers such
  as `status` need etcd only. The files a manifest names are still checked against its sha256s. A manifest is
  about 150 bytes per sample chunk and 60 per module: far below etcd's 1.5 MiB request limit (refused above 1 MiB).
- The commit condition: epoch E still current, layer L not committed in E, the committing rank's liveness key
  still held by this process, and L == the cursor: the smallest layer that is neither in E's fence nor committed
  in E. "The last committed layer is L-1" is not correct here: a new epoch redoes any layer whose files failed
  their checksum (its fence has holes), so it may commit layer 2 after layer 6 was committed in an earlier epoch.
  The cursor is the strongest order that stays correct: the runner commits each layer only after every earlier
  one is valid in its view, in increasing order, and this refuses anything else (a skipped layer, a repeat).
- Liveness: every rank holds a lease (TTL 10 s by default) kept alive once a second by a thread, with its key
  workers/R bound to it. The thread ends the process (os._exit) when etcd says the lease is gone, or when no
  keep-alive has succeeded for a TTL (the node is frozen, or cut off from etcd, and its lease has expired or
  soon will): a partitioned node stops writing files. Safety does not rest on it (a stale epoch cannot commit,
  and a commit compares the committer's liveness key). 10 s rides through an etcd restart (a few seconds,
  tests/test_etcd_records.py) without disturbing the workers, and matches the rendezvous' own retry budget: a
  longer outage ends the agents.
- Retries (tenacity, through etcd_client.EtcdClient): only reads, idempotent puts and compare-and-set
  transactions, each on this rank's own connection, never inside a collective; jittered exponential backoff for
  at most retry_timeout (8 s: below the process-group timeout and the rendezvous timeouts, so a commit stuck on
  etcd fails before the other ranks give up on it). A compare-and-set retried after a lost reply recognises its own
  write (the same bytes, or the fence's nonce) and succeeds. Granting a lease is the one non-idempotent call;
  a duplicate grant leaves an orphan lease that expires after its TTL.
- Progress is followed by polling (watch_progress): etcd3 0.12's watches do not resume after an etcd restart and
  cannot time out, and a display needs no more than a read every half second.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.parse
import uuid

from elastic_oneshot.distributed.etcd_client import (
    Delete,
    EtcdClient,
    Get,
    Mod,
    Put,
    Value,
    Version,
    etcd3,
    is_transient,
    parse_endpoints,
)
from elastic_oneshot.distributed.watchdog import Watchdog
from elastic_oneshot.durability import layout
from elastic_oneshot.durability.records import Records
from elastic_oneshot.errors import CorruptStateError, StaleEpochError, UsageError, exit_now, report
from elastic_oneshot.jsonforms import canonical_json

log = logging.getLogger("elastic_oneshot")

DEFAULT_TTL = 10
DEFAULT_RETRY_TIMEOUT = 8
PASSWORD_ENV = "ELASTIC_ONESHOT_ETCD_PASSWORD"
MAX_MANIFEST_BYTES = 1 << 20
LEASE_LOST_EXIT = 1
_OPTIONS = {"cacert", "cert", "key", "user", "password", "ttl", "retry_timeout"}


def parse_url(url: str) -> dict:
    """etcd://HOST[:PORT][,HOST[:PORT]...]/PREFIX[?options] (a cluster's members, tried in turn) ->
    {endpoints, prefix, options}; UsageError when malformed."""
    parts = urllib.parse.urlsplit(url)
    usage = f"--coordinator {redact(url)}: expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX[?cacert=..&cert=..&key=..]"
    if parts.scheme != "etcd" or not parts.netloc:
        raise UsageError(usage)
    try:
        endpoints = parse_endpoints(parts.netloc)
    except ValueError:
        raise UsageError(usage) from None
    prefix = "/" + parts.path.strip("/")
    if prefix == "/":
        raise UsageError(f"--coordinator {redact(url)}: give a key prefix for this job, e.g. etcd://HOST:PORT/jobs/NAME")
    options = {}
    for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if k not in _OPTIONS:
            raise UsageError(f"--coordinator: unknown option {k!r} (known: {', '.join(sorted(_OPTIONS))})")
        options[k] = v
    return {"endpoints": endpoints, "prefix": prefix + "/", "options": options}


def redact(url: str) -> str:
    """The URL without its password (what job.json records)."""
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True) if k != "password"]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, safe="/:.,")))


class EtcdRecords(Records):
    """Epoch fences, commits and progress in etcd (see the module docstring), with all of records.Records: claim
    and adopt (the job owns the prefix), attach/detach (a rank's lease), progress and watch_progress."""

    def __init__(self, endpoints: list[tuple[str, int]], prefix: str = "/elastic-oneshot/", *, cacert=None, cert=None,
                 key=None, user=None, password=None, ttl: float = DEFAULT_TTL,
                 retry_timeout: float = DEFAULT_RETRY_TIMEOUT, url: str | None = None):
        super().__init__()
        if user and password is None:
            password = os.environ.get(PASSWORD_ENV)
        try:
            self.etcd = EtcdClient(endpoints, cacert=cacert, cert=cert, key=key, user=user, password=password,
                                    retry_timeout=retry_timeout, where="the --coordinator URL")
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.url = url or f"etcd://{','.join(f'{h}:{p}' for h, p in endpoints)}{self.prefix.rstrip('/')}"
        self.ttl = ttl
        self.on_lost = self._exit  # what the watchdog does when the lease is lost (tests replace it)
        self.rank = self.world_size = self.layers_total = None
        self._worker: bytes | None = None  # this process's liveness value, once attached
        self._lease: int | None = None
        self._watchdog: Watchdog | None = None
        self._view: tuple[int, dict[int, int], set[int]] | None = None  # (epoch, its fence, its own commits)
        self._manifests: dict[tuple[int, int], dict] = {}  # commits never change (only claim drops them)

    @classmethod
    def from_url(cls, url: str) -> EtcdRecords:
        p = parse_url(url)
        o = p["options"]
        try:
            ttl = float(o.get("ttl", DEFAULT_TTL))
            retry = float(o.get("retry_timeout", DEFAULT_RETRY_TIMEOUT))
        except ValueError:
            raise UsageError("--coordinator: ttl and retry_timeout must be numbers of seconds") from None
        return cls(p["endpoints"], p["prefix"], cacert=o.get("cacert"), cert=o.get("cert"), key=o.get("key"),
                   user=o.get("user"), password=o.get("password"), ttl=ttl, retry_timeout=retry, url=redact(url))

    def __repr__(self):
        return f"EtcdRecords({self.url})"

    # -- keys ---------------------------------------------------------------------------------------------
    def _k(self, name: str) -> str:
        return self.prefix + name

    def _fence_key(self, epoch: int) -> str:
        return self._k(f"epochs/{epoch:05d}")

    def _commit_key(self, layer: int, epoch: int) -> str:
        return self._k(f"commits/{epoch:05d}/{layer:05d}")

    def _range(self, name: str) -> dict:
        key = self._k(name)
        return {"key": key, "range_end": etcd3.utils.increment_last_byte(etcd3.utils.to_bytes(key))}

    def _keys(self, name: str) -> list[str]:
        found = self.etcd.call("get_prefix", self._k(name), keys_only=True)
        return [meta.key.decode()[len(self._k(name)):] for _, meta in found]

    def _get(self, key: str):
        return self.etcd.call("get", key)

    def _txn(self, compare, success, failure=()):
        return self.etcd.call("transaction", compare=list(compare), success=list(success), failure=list(failure))

    # -- the Records interface ------------------------------------------------------------------------------
    def epochs(self) -> list[int]:
        return sorted(int(n) for n in self._keys("epochs/") if n.isdigit())

    def current_epoch(self) -> int:
        value, meta = self._get(self._k("epoch"))
        return int(value) if meta else 0

    def fence(self, epoch: int) -> dict | None:
        """Epoch `epoch`'s fence: {"epoch", "committed": {"layer": epoch}, ...}, or None."""
        value, meta = self._get(self._fence_key(epoch))
        return json.loads(value) if meta else None

    def committed(self) -> dict[int, int]:
        """Layer -> epoch of its valid commit: the current epoch's fence plus that epoch's own commits."""
        epoch = self.current_epoch()
        fence = self.fence(epoch) if epoch else None
        view = {int(k): v for k, v in (fence or {}).get("committed", {}).items()}
        view.update({int(n): epoch for n in self._keys(f"commits/{epoch:05d}/") if n.isdigit()} if epoch else {})
        return view

    def manifest(self, layer: int, epoch: int) -> dict | None:
        if (layer, epoch) in self._manifests:
            return json.loads(json.dumps(self._manifests[layer, epoch]))  # a copy: callers may change theirs
        value, meta = self._get(self._commit_key(layer, epoch))
        if meta is None:
            return None
        try:
            self._manifests[layer, epoch] = json.loads(value)
        except ValueError:
            raise CorruptStateError(f"etcd {self._commit_key(layer, epoch)} is not JSON") from None
        return self.manifest(layer, epoch)

    def begin_epoch(self, committed: dict[int, int]) -> int:
        """Fence a new epoch (see FileRecords.begin_epoch): one transaction creates epochs/E+1 only if absent and
        moves `epoch` from E to E+1 only if unchanged since read; StaleEpochError if another process won."""
        ok, (current, progress) = self._txn([], [Get(self._k("epoch")), Get(self._k("progress"))])
        value, meta = current[0] if current else (None, None)
        epoch, nonce = (int(value) if meta else 0) + 1, uuid.uuid4().hex
        fence = canonical_json({"epoch": epoch, "committed": {str(k): v for k, v in sorted(committed.items())},
                                "nonce": nonce, "time": time.time(), "world_size": self.world_size})
        cursor = 0
        while cursor in committed:
            cursor += 1
        before = json.loads(progress[0][0]) if progress else {}
        compare = [Version(self._fence_key(epoch)) == 0,
                   Mod(self._k("epoch")) == meta.mod_revision if meta else Version(self._k("epoch")) == 0,
                   *self._alive()]
        success = [Put(self._fence_key(epoch), fence), Put(self._k("epoch"), str(epoch)),
                   Put(self._k("cursor"), f"{epoch}:{cursor}"),
                   Put(self._k("progress"), self._progress(epoch, len(committed), before, None))]
        ok, responses = self._txn(compare, success, [Get(self._fence_key(epoch)), *self._alive_get()])
        if not ok:
            won = responses[0][0][0] if responses[0] else None
            if won != fence:  # else: our own write, whose reply was lost before a retry
                self._check_alive(responses[1:])
                raise StaleEpochError(f"epoch {epoch} was begun by another process")
        self._view = (epoch, dict(committed), set())
        self._tags[epoch] = layout.tag(epoch, nonce)
        return epoch

    def commit(self, layer: int, epoch: int, manifest: dict):
        """Commit layer `layer` for `epoch` with `manifest`, in one transaction that succeeds only if `epoch` is
        still the newest, the layer is not committed in it yet, `layer` is the next one in order (the cursor:
        see the module docstring) and this rank still holds its lease; StaleEpochError otherwise."""
        body = canonical_json(manifest)
        if len(body) > MAX_MANIFEST_BYTES:
            raise UsageError(f"the manifest of layer {layer} has {len(body)} bytes, too many for etcd: use a larger "
                             "--chunk-size (fewer chunk files), or no --coordinator")
        fence, done = self._epoch_view(epoch)
        following = layer + 1
        while following in fence or following in done:
            following += 1
        count = len(set(fence) | done | {layer})
        key = self._commit_key(layer, epoch)
        compare = [Value(self._k("epoch")) == str(epoch), Value(self._k("cursor")) == f"{epoch}:{layer}",
                   Version(key) == 0, *self._alive()]
        success = [Put(key, body), Put(self._k("cursor"), f"{epoch}:{following}"),
                   Put(self._k("progress"), self._progress(epoch, count, {}, layer))]
        failure = [Get(key), Get(self._k("epoch")), Get(self._k("cursor")), *self._alive_get()]
        ok, responses = self._txn(compare, success, failure)
        if not ok and not (responses[0] and responses[0][0][0] == body):  # else: ours, reply lost before a retry
            held = [kvs[0][0].decode() if kvs else None for kvs in responses[:3]]
            if held[1] != str(epoch):
                raise StaleEpochError(f"epoch {epoch} is stale (epoch {held[1]} has begun): layer {layer} "
                                      "not committed")
            if held[0] is not None:
                raise StaleEpochError(f"layer {layer} was already committed in epoch {epoch}")
            self._check_alive(responses[3:])
            raise StaleEpochError(f"epoch {epoch} commits layer {(held[2] or '?:?').split(':')[1]} next, not layer "
                                  f"{layer}: refused")
        done.add(layer)

    def _epoch_view(self, epoch: int) -> tuple[dict[int, int], set[int]]:
        if self._view is None or self._view[0] != epoch:
            fence = self.fence(epoch) or {"committed": {}}
            done = {int(n) for n in self._keys(f"commits/{epoch:05d}/") if n.isdigit()}
            self._view = (epoch, {int(k): v for k, v in fence["committed"].items()}, done)
        return self._view[1], self._view[2]

    def _progress(self, epoch: int, count: int, before: dict, layer: int | None) -> bytes:
        now = time.time()
        return canonical_json({"epoch": epoch, "world_size": self.world_size, "layers_committed": count,
                      "layers_total": self.layers_total, "last_layer": layer if layer is not None else
                      before.get("last_layer"), "last_commit_time": now if layer is not None else
                      before.get("last_commit_time"), "time": now,
                      "done": self.layers_total is not None and count >= self.layers_total})

    # -- which job owns the prefix ----------------------------------------------------------------------------
    def claim(self, record: dict, state_root: str):
        """A job starts (or restarts) in `state_root`: drop the prefix's epochs, commits, cursor and progress, and
        record the job. The epoch counter is kept, so epochs keep growing (a stale worker of the previous run
        can never match a new epoch). Idempotent."""
        job = canonical_json({"fingerprint": record["fingerprint"], "state": state_root})
        self._txn([], [Delete(**self._range("epochs/")), Delete(**self._range("commits/")),
                       Delete(self._k("cursor")), Delete(self._k("progress")), Put(self._k("job"), job)])
        self._view = None
        self._manifests.clear()

    def adopt(self, record: dict, state_root: str):
        """The job resumes in `state_root`: the prefix must hold this job's records. It may hold none (etcd lost
        them, or a crash came between claiming the state directory and the prefix): then they start afresh and
        committed layers are redone. A prefix that holds another job is refused, unless it was this state
        directory's previous job (its records are stale: claimed again)."""
        value, meta = self._get(self._k("job"))
        if meta is None:
            log.warning("%s holds no records of this job: starting them afresh (committed layers are redone)", self.url)
            return self.claim(record, state_root)
        held = json.loads(value)
        if held.get("fingerprint") == record["fingerprint"]:
            return None
        if held.get("state") == state_root:
            return self.claim(record, state_root)
        raise UsageError(f"etcd prefix {self.url} holds the records of another job (state directory "
                         f"{held.get('state')}): use another prefix, or --restart to discard them")

    # -- liveness -----------------------------------------------------------------------------------------------
    def attach(self, rank: int, world_size: int | None = None, layers_total: int | None = None):
        """This process is rank `rank`: take a lease, hold workers/RANK on it, and keep it alive from a thread that
        ends the process if the lease is lost. Also sets what progress reports (world size, layers in all)."""
        self.rank, self.world_size, self.layers_total = rank, world_size, layers_total
        self._lease = self.etcd.call("lease", int(max(1, round(self.ttl)))).id  # a duplicate grant just expires
        self._worker = canonical_json({"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                                       "lease": self._lease, "nonce": uuid.uuid4().hex})
        self.etcd.call("put", self._k(f"workers/{rank}"), self._worker, lease=self._lease)
        self._last_ok, self._failing = time.monotonic(), None
        self._watchdog = Watchdog("etcd-lease", self._keepalive, min(1.0, self.ttl / 4),
                                  lambda reason: self.on_lost(reason)).start()

    def detach(self):
        """Stop keeping the lease alive and revoke it (which deletes workers/RANK). Never raises."""
        if self._watchdog is None:
            return
        self._watchdog.stop()
        self._watchdog = None
        try:
            self.etcd.call_once("revoke_lease", self._lease)
        except Exception as e:  # it expires by itself
            log.debug("revoking lease %s: %s", self._lease, e)
        self._worker = self._lease = None

    def _keepalive(self) -> str | None:
        """One keep-alive of this rank's lease: the reason to leave if the lease is gone, or if no keep-alive has
        succeeded for a TTL (the node is frozen, or cut off from etcd, and its lease has expired or soon will)."""
        sent = time.monotonic()
        if sent - self._last_ok > self.ttl:
            return f"no keep-alive of its etcd lease for {sent - self._last_ok:.1f} s (TTL {self.ttl:g} s)"
        try:
            ttl = self.etcd.refresh_lease(self._lease)
        except Exception as e:
            if self._failing is None:
                log.warning("etcd lease keep-alive failed (%s); the lease lasts %g s", e, self.ttl)
            self._failing = e
            return None
        if ttl <= 0:
            return f"etcd says its lease {self._lease:x} has expired"
        if self._failing is not None:
            log.warning("etcd lease keep-alive works again after %.1f s", sent - self._last_ok)
            self._failing = None
        self._last_ok = sent
        return None

    def _exit(self, reason: str):
        report(f"rank {self.rank}: {reason}; leaving so that no partitioned or frozen worker goes on writing",
               after_bar=True)
        exit_now(LEASE_LOST_EXIT)

    def _alive(self) -> list:
        return [Value(self._k(f"workers/{self.rank}")) == self._worker] if self._worker else []

    def _alive_get(self) -> list:
        return [Get(self._k(f"workers/{self.rank}"))] if self._worker else []

    def _check_alive(self, responses):
        if self._worker and (not responses or not responses[0] or responses[0][0][0] != self._worker):
            raise StaleEpochError(f"rank {self.rank} no longer holds its etcd lease (expired, or another process "
                                  "took its rank): nothing committed")

    # -- progress ---------------------------------------------------------------------------------------------
    def _read_progress(self) -> tuple[dict | None, int]:
        ok, (progress, workers) = self._txn([], [Get(self._k("progress")), Get(**self._range("workers/"))])
        if not progress:
            return None, 0
        value, meta = progress[0]
        out = json.loads(value)
        out["live_ranks"] = sorted(json.loads(v)["rank"] for v, _ in workers)
        return out, meta.mod_revision

    def progress(self) -> dict | None:
        """{epoch, world_size, layers_committed, layers_total, last_layer, last_commit_time, time, done,
        live_ranks}, or None before the first epoch."""
        return self._read_progress()[0]

    def watch_progress(self, timeout: float | None = None, interval: float = 0.5):
        """The progress now, then at each change, until it is done or `timeout` seconds have passed (None: no
        limit). Polls: an etcd restart only delays it (unreachable etcd is retried until the timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = -1
        while deadline is None or time.monotonic() < deadline:
            try:
                progress, revision = self._read_progress()
            except Exception as e:
                if not is_transient(e) and not is_transient(e.__cause__ or e):
                    raise
                progress, revision = None, seen
            if progress is not None and revision != seen:
                seen = revision
                yield progress
                if progress.get("done"):
                    return
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))

    def close(self):
        self.detach()
        self.etcd.close()
