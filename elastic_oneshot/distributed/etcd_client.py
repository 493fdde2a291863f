"""The etcd client both etcd users share: the torchrun rendezvous (etcd_rendezvous.py) and the job's records
(etcd_records.py). Import etcd3 and its transaction ops from here, never directly: this module sets protobuf up for
etcd3 first.
"""
from __future__ import annotations

import os
import threading
import warnings

# etcd3 0.12's generated *_pb2 modules predate protobuf 4 and only load with protobuf's pure-Python runtime. The
# runtime is picked once, when protobuf is first imported, so this must run before that: a torchrun agent imports
# nothing that imports protobuf before it loads the rendezvous plugin (checked with torch 2.13), and neither does
# elastic_oneshot. Left in the environment on purpose: workers inherit it and can use etcd3 too.
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

import grpc  # noqa: E402

from elastic_oneshot.retry import retrying  # noqa: E402

try:
    with warnings.catch_warnings():  # the pure-Python runtime deprecates how old generated code builds descriptors
        warnings.simplefilter("ignore", DeprecationWarning)
        import etcd3
    from etcd3.transactions import Delete, Get, Mod, Put, Value, Version  # noqa: F401  (for the users of etcd3)
except TypeError as e:  # "Descriptors cannot be created directly": protobuf was imported earlier with upb/cpp
    raise ImportError("etcd3 needs protobuf's pure-Python runtime, but protobuf was imported before "
                      "elastic_oneshot.distributed.etcd_client: set "
                      "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python") from e

RPC_TIMEOUT = 5  # s per etcd request; requests take milliseconds, so this only cuts off a dead connection
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.UNAUTHENTICATED}  # UNAUTHENTICATED: auth token lost in an etcd restart


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` says etcd is unreachable for now (down, restarting, cut off, or without a quorum: a member
    that lost it answers UNKNOWN "context deadline exceeded"), not that a request is wrong."""
    if isinstance(exc, (etcd3.exceptions.ConnectionFailedError, etcd3.exceptions.ConnectionTimeoutError)):
        return True
    return isinstance(exc, grpc.RpcError) and (exc.code() in _TRANSIENT or exc.code() == grpc.StatusCode.UNKNOWN
                                               and "deadline exceeded" in (exc.details() or ""))


def _connection_error() -> type[Exception]:
    """torch's RendezvousConnectionError: what the rendezvous must raise, and what readers of the records see.
    Imported when needed: the first import of torch's rendezvous package loads every torchrun plugin, and the
    etcd3 plugin imports this module."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    return RendezvousConnectionError


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """"HOST[:PORT][,HOST[:PORT]...]" (the members of one etcd cluster) -> [(host, port)]; ValueError if malformed."""
    out = []
    for item in text.split(","):
        host, colon, port = item.strip().rpartition(":")
        host, port = (host, port) if colon else (port, "2379")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {item!r}: expected HOST or HOST:PORT")
        out.append((host, int(port)))
    return out


class EtcdClient:
    """An etcd3 client that survives etcd restarts and the loss of a member: after a transient error the client is
    rebuilt on the next of `endpoints` (the members of one cluster; a fresh channel skips gRPC's growing reconnect
    backoff, and a fresh login replaces an auth token the restart forgot), and `call` retries with jittered
    exponential backoff for `retry_timeout` seconds. Only idempotent or compare-and-set requests may go through
    `call`; anything else uses `call_once`. Unreachable etcd raises torch's RendezvousConnectionError."""

    def __init__(self, endpoints: list[tuple[str, int]], *, cacert: str | None = None, cert: str | None = None,
                 key: str | None = None, user: str | None = None, password: str | None = None,
                 retry_timeout: float = 10, where: str = "--rdzv-conf"):
        self.endpoints, self._at = endpoints, 0
        if (cert or key) and not (cacert and cert and key):
            raise ValueError(f"etcd: TLS client auth needs all of cacert, cert and key in {where}")
        self._kwargs = dict(ca_cert=cacert, cert_cert=cert, cert_key=key, user=user, password=password,
                            timeout=RPC_TIMEOUT)
        self.retry_timeout = retry_timeout
        self._client: etcd3.Etcd3Client | None = None
        self._lock = threading.Lock()  # a keep-alive thread shares this client with the main one

    def client(self) -> etcd3.Etcd3Client:
        with self._lock:
            if self._client is None:
                self._client = etcd3.client(*self.endpoints[self._at], **self._kwargs)
                # The auth token also travels as plain metadata; as call credentials, current gRPC refuses it on
                # http channels ("does not have a sufficient security level").
                self._client.call_credentials = None
            return self._client

    @property
    def endpoint(self) -> str:
        """The member in use."""
        host, port = self.endpoints[self._at]
        return f"{host}:{port}"

    def _drop(self, failed: etcd3.Etcd3Client | None) -> None:
        with self._lock:
            if self._client is failed:
                self._client = None
                self._at = (self._at + 1) % len(self.endpoints)

    def call_once(self, method: str, *args, **kwargs):
        client = None
        try:
            client = self.client()
            return getattr(client, method)(*args, **kwargs)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._drop(client)
            raise _connection_error()(f"etcd at {self.endpoint} failed: {exc!r}") from exc

    def call(self, method: str, *args, **kwargs):
        lost = _connection_error()
        retry = retrying("etcd", self.retry_timeout, lambda e: isinstance(e, lost))
        return retry(self.call_once, method, *args, **kwargs)

    def refresh_lease(self, lease_id: int) -> int:
        """One keep-alive of `lease_id` (never retried: the caller's loop is the retry); its remaining TTL, 0 when
        etcd no longer holds the lease. Errors are etcd3's own."""
        client = None
        try:
            client = self.client()
            responses = list(client.refresh_lease(lease_id))
        except Exception as exc:
            if is_transient(exc):
                self._drop(client)
            raise
        return responses[0].TTL if responses else 0

    def close(self) -> None:
        """Close the connection; a later call opens a new one."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
