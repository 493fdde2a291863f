"""`torchrun --rdzv-backend=etcd3`: torch's dynamic rendezvous with its state and store in etcd, over the v3 API.

torch's own `etcd`/`etcd-v2` backends speak etcd's v2 API, which etcd 3.4 serves only with --enable-v2 and 3.6
removed. Unlike `c10d`, whose store lives inside one agent, nothing here dies with a node: any node, rank 0
included, can be killed and the others re-rendezvous without it.

Keys, all under /torchrun/elastic-oneshot/<run_id>/ (stale ones: see clear_finished_run):
    state      torch's pickled rendezvous state; writes are compare-and-set on the key's mod_revision
    store/...  the c10d Store the agents share (MASTER_ADDR/PORT, rank assignment, exit barrier)

--rdzv-endpoint: HOST:PORT, or every member of the cluster, HOST:PORT,HOST:PORT,... (a member lost is skipped).
--rdzv-conf options: cacert, cert, key (TLS; plain http without cacert), user, password (etcd auth; torchrun logs
--rdzv-conf, password included), read_timeout (s a blocking store read waits, default 60, as for c10d),
retry_timeout (s of retrying an unreachable etcd, default 10: the longest loss of etcd's quorum the agents ride out;
keep it below the rendezvous timeouts).
"""
from __future__ import annotations

import logging
import os
import random
import time
from datetime import timedelta


def entry_point():
    """The `torchrun.handlers` entry point: torchrun calls it with no arguments and registers what it returns.

    Defined before the imports and late-bound: the first import of torch's rendezvous package loads every
    entry point, so when this module is what imports that package, the package re-enters it half-initialized.
    """
    return lambda params: create_rdzv_handler(params)


from elastic_oneshot.distributed.etcd_client import (  # noqa: E402,I001  (first: it sets protobuf up, before torch might load it)
    Delete, EtcdClient, Get, Mod, Put, Value, Version, etcd3, parse_endpoints)

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler, RendezvousBackend, Token, create_handler)

log = logging.getLogger(__name__)

KEY_ROOT = "/torchrun/elastic-oneshot/"
_MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


def client_from_params(params: RendezvousParameters) -> EtcdClient:
    """The client for torchrun's --rdzv-endpoint and --rdzv-conf (see the module docstring)."""
    try:
        endpoints = parse_endpoints(params.endpoint)
    except ValueError as e:
        raise ValueError(f"--rdzv-endpoint: {e}") from None
    return EtcdClient(endpoints, cacert=params.get("cacert"), cert=params.get("cert"), key=params.get("key"),
                      user=params.get("user"), password=params.get("password"),
                      retry_timeout=params.get_as_int("retry_timeout", 10))


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Holds torch's rendezvous state in one etcd key; the fencing token is the key's mod_revision."""

    def __init__(self, etcd: EtcdClient, run_id: str):
        if not run_id or "/" in run_id:
            raise ValueError(f"etcd3 rendezvous: the run id must be non-empty and have no '/': {run_id!r}")
        self.etcd = etcd
        self.run_id = run_id
        self.prefix = f"{KEY_ROOT}{run_id}/"
        self.key = self.prefix + "state"

    @property
    def name(self) -> str:
        return "etcd3"

    def get_state(self) -> tuple[bytes, Token] | None:
        value, meta = self.etcd.call("get", self.key)
        return None if meta is None else (value, meta.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        # Absent key: version 0. Retrying is safe: if a lost reply hid our write, the retry fails the compare and
        # returns our own state, which torch takes as the current one.
        unchanged = Version(self.key) == 0 if token is None else Mod(self.key) == int(token)
        ok, responses = self.etcd.call("transaction", compare=[unchanged],
                                       success=[Put(self.key, state), Get(self.key)], failure=[Get(self.key)])
        kvs = responses[-1]
        if not kvs:
            return None
        value, meta = kvs[0]
        return value, meta.mod_revision, ok

    def clear_finished_run(self, is_closed, quiet: timedelta) -> None:
        """Delete everything under this run's prefix if an earlier run with this id has ended.

        torchrun closes the rendezvous for good when a run ends, failed or not (only killed agents leave it open),
        so without this a rerun under the same id, which c10d allows, would die with RendezvousClosedError.
        Deleting is safe once no agent of the old run is alive. Live agents rewrite the state with a heartbeat
        every keep_alive_interval, so wait for `quiet` (keep_alive_interval * keep_alive_max_attempt, after which
        torch itself declares a node dead) and delete only if the state has not changed since. A crashed run that
        never closed needs nothing: torch drops its dead nodes from the state by itself. Store keys are prefixed
        with the rendezvous round, which only grows while the state lives, so no run reads another's.
        `is_closed` is the handler's own check (torch decodes its state; we never unpickle anything).
        """
        current = self.get_state()
        if current is None or not is_closed():
            return
        log.warning("etcd3 rendezvous: run '%s' was closed by an earlier run; deleting %s if it stays unchanged for "
                    "%.0fs", self.run_id, self.prefix, quiet.total_seconds())
        time.sleep(quiet.total_seconds())
        everything = Delete(self.prefix, range_end=etcd3.utils.increment_last_byte(self.prefix.encode()))
        deleted, _ = self.etcd.call("transaction", compare=[Mod(self.key) == current[1]], success=[everything],
                                    failure=[])
        if not deleted and self.get_state() is not None and is_closed():
            raise RendezvousClosedError(
                f"etcd3 rendezvous '{self.run_id}' is closed and an agent of the run that closed it is still alive: "
                f"wait for it to exit, use another --rdzv-id, or run: etcdctl del --prefix {self.prefix}")


class EtcdV3Store(dist.Store):
    """A c10d Store on etcd keys under `prefix`, for the agents (workers bootstrap their own TCPStore from the
    MASTER_ADDR/PORT kept here). Blocking reads poll: polling has no watch to lose when etcd restarts."""

    def __init__(self, etcd: EtcdClient, prefix: str, timeout: timedelta):
        super().__init__()
        self.etcd = etcd
        self.prefix = prefix
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _read(self, keys: list[str]) -> list[bytes | None]:
        values = []
        for i in range(0, len(keys), _MAX_TXN_OPS):
            _, responses = self.etcd.call("transaction", compare=[],
                                          success=[Get(self._key(k)) for k in keys[i:i + _MAX_TXN_OPS]], failure=[])
            values += [kvs[0][0] if kvs else None for kvs in responses]
        return values

    def _wait_read(self, keys: list[str], timeout: timedelta | None = None) -> list[bytes]:
        timeout = self.timeout if timeout is None else timeout
        deadline, delay = time.monotonic() + timeout.total_seconds(), 0.01
        while None in (values := self._read(keys)):
            if time.monotonic() >= deadline:
                missing = [k for k, v in zip(keys, values) if v is None]
                raise dist.DistStoreError(f"etcd3 store: timed out after {timeout} waiting for {missing}")
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(2 * delay, 0.25)
        return values

    def set(self, key: str, value: bytes) -> None:
        self.etcd.call("put", self._key(key), value)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for i in range(0, len(keys), _MAX_TXN_OPS):
            puts = [Put(self._key(k), v) for k, v in zip(keys[i:i + _MAX_TXN_OPS], values[i:i + _MAX_TXN_OPS])]
            self.etcd.call("transaction", compare=[], success=puts, failure=[])

    def get(self, key: str) -> bytes:
        return self._wait_read([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_read(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_read(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return None not in self._read(keys)

    def add(self, key: str, amount: int) -> int:
        # Not retried: a write whose reply was lost can't be told from someone else's, so a retry could count twice.
        k = self._key(key)
        while True:
            value, meta = self.etcd.call("get", k)
            new = amount + (int(value) if meta else 0)
            unchanged = Mod(k) == meta.mod_revision if meta else Version(k) == 0
            ok, _ = self.etcd.call_once("transaction", compare=[unchanged], success=[Put(k, str(new))], failure=[])
            if ok:
                return new
            time.sleep(random.uniform(0, 0.05))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        # TCPStore's semantics: empty `expected` means "absent"; returns the value now held (or `expected` when the
        # key is absent). Retrying is safe: a lost successful write makes the retry return `desired`.
        k = self._key(key)
        cmp = Version(k) == 0 if not expected else Value(k) == expected
        ok, responses = self.etcd.call("transaction", compare=[cmp], success=[Put(k, desired)], failure=[Get(k)])
        if ok:
            return etcd3.utils.to_bytes(desired)
        return responses[0][0][0] if responses[0] else etcd3.utils.to_bytes(expected)


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    etcd = client_from_params(params)
    backend = EtcdV3RendezvousBackend(etcd, params.run_id)
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    return backend, EtcdV3Store(etcd, backend.prefix + "store/", read_timeout)


def create_rdzv_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    # torch 2.13's default, one TCPStore hosted by the rank-0 agent for its workers, breaks scale-up: a node that
    # joins a running job waits for a MASTER_ADDR the old rank 0 never republishes, until read_timeout kills it.
    # With this set, each round publishes a fresh MASTER_ADDR/PORT here and rank-0 workers host their own store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    s = handler.settings
    backend.clear_finished_run(handler.is_closed, s.keep_alive_interval * s.keep_alive_max_attempt)
    return handler

