"""A throwaway etcd for tests: real server on 127.0.0.1, free ports, temp data dir.

    with EtcdServer() as etcd:          # or EtcdServer(tls=make_tls(tmp_path))
        etcd.endpoint                   # "127.0.0.1:PORT", for --rdzv-endpoint / etcd3.client
        etcd.kill(); etcd.start()       # crash and come back with the same data and ports
        etcd.restart()                  # clean stop, then start

Fails with a clear message when the `etcd` binary is missing (CI installs Debian's etcd-server).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths: the CA both sides trust, the server's cert/key, and one client cert/key signed by the CA."""
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_tls(directory, name: str = "ca") -> TLSFiles:
    """A fresh CA plus a server cert for 127.0.0.1 and a client cert, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl CLI is needed to make test certificates: apt-get install openssl")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    p = {k: str(d / f"{name}-{k}") for k in ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem",
                                              "client.key", "ext")}

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
            "-keyout", p["ca.key"], "-out", p["ca.pem"])
    for who, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
                     ("client", "extendedKeyUsage=clientAuth")):
        Path(p["ext"]).write_text(ext + "\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}-{who}",
                "-keyout", p[f"{who}.key"], "-out", p[f"{who}.pem"] + ".csr")
        openssl("x509", "-req", "-in", p[f"{who}.pem"] + ".csr", "-CA", p["ca.pem"], "-CAkey", p["ca.key"],
                "-CAcreateserial", "-days", "2", "-extfile", p["ext"], "-out", p[f"{who}.pem"])
    return TLSFiles(p["ca.pem"], p["server.pem"], p["server.key"], p["client.pem"], p["client.key"])


def _healthy(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    """Whether the etcd member at `url` answers that it is healthy."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1, context=ctx) as r:
            return b'"true"' in r.read()
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member. `tls` turns on https with client-certificate auth for the client port."""

    def __init__(self, tls: TLSFiles | None = None, data_dir: str | None = None):
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("etcd is not installed: apt-get install -y etcd-server (CI's .ci/run does this)")
        self.tls = tls
        self._tmp = tempfile.mkdtemp(prefix="etcd-test-")
        self.data_dir = data_dir or os.path.join(self._tmp, "data")
        self.log_path = os.path.join(self._tmp, "etcd.log")
        self.port, self.peer_port = _free_port(), _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def start(self, timeout: float = 30.0) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [self.binary, "--name", "default", "--data-dir", self.data_dir,
               "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"default={peer}"]
        if self.tls:
            cmd += ["--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key,
                    "--trusted-ca-file", self.tls.ca, "--client-cert-auth"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=self.tls.ca)
            ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _healthy(self.url, ctx):
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"etcd did not become healthy in {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def _signal(self, sig: int, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (clean shutdown), SIGKILL after 10 s."""
        self._signal(signal.SIGTERM, 10)

    def kill(self) -> None:
        """SIGKILL: a crash. Data in the data dir survives for start()."""
        self._signal(signal.SIGKILL, 10)

    def restart(self) -> EtcdServer:
        self.stop()
        return self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class EtcdCluster:
    """`size` etcd members, each on a host of its own on `fabric` (netns.Fabric), for the faults where quorum
    matters: a member killed and restarted (`kill`, `start`), members cut off (their hosts' `cut`, `heal`).

        cluster = EtcdCluster(fabric).start()
        cluster.endpoint                  # "A:2379,B:2379,C:2379", for --rdzv-endpoint and etcd:// URLs
        cluster.kill(cluster.leader())
    """

    def __init__(self, fabric, size: int = 3):
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("etcd is not installed: apt-get install -y etcd-server (CI's .ci/run does this)")
        self._tmp = tempfile.mkdtemp(prefix="etcd-cluster-")
        self.hosts = [fabric.host(f"etcd{i}") for i in range(size)]
        self.procs: list[subprocess.Popen | None] = [None] * size
        self.initial = ",".join(f"m{i}=http://{h.address}:2380" for i, h in enumerate(self.hosts))

    @property
    def endpoint(self) -> str:
        return ",".join(f"{h.address}:2379" for h in self.hosts)

    def start(self, member: int | None = None, timeout: float = 30.0) -> EtcdCluster:
        """Every member (or one: back on its data), then wait until each one that runs answers healthy."""
        for i in range(len(self.hosts)) if member is None else [member]:
            host, data = self.hosts[i], os.path.join(self._tmp, f"m{i}")
            client, peer = f"http://{host.address}:2379", f"http://{host.address}:2380"
            cmd = [self.binary, "--name", f"m{i}", "--data-dir", data, "--listen-client-urls", client,
                   "--advertise-client-urls", client, "--listen-peer-urls", peer,
                   "--initial-advertise-peer-urls", peer, "--initial-cluster", self.initial,
                   "--initial-cluster-state", "new"]
            with open(os.path.join(self._tmp, f"m{i}.log"), "ab") as log:
                self.procs[i] = host.popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            while proc is not None and not _healthy(f"http://{self.hosts[i].address}:2379"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member m{i} did not become healthy; see {self._tmp}/m{i}.log")
                time.sleep(0.1)
        return self

    def _status(self, i: int) -> dict | None:
        try:
            request = urllib.request.Request(f"http://{self.hosts[i].address}:2379/v3/maintenance/status",
                                             data=b"{}", method="POST")
            with urllib.request.urlopen(request, timeout=1) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def leader(self) -> int:
        """The member that leads now (waits for an election, up to 10 s)."""
        for _ in range(100):
            for i in range(len(self.hosts)):
                status = self._status(i) if self.procs[i] is not None else None
                if status and status.get("leader") and status["leader"] == status["header"]["member_id"]:
                    return i
            time.sleep(0.1)
        raise RuntimeError("the etcd cluster has no leader")

    def kill(self, i: int):
        """SIGKILL member `i`: a crash; its data stays for start(i)."""
        if self.procs[i] is not None:
            self.procs[i].kill()
            self.procs[i].wait()
            self.procs[i] = None

    def close(self):
        for i in range(len(self.hosts)):
            self.kill(i)
        shutil.rmtree(self._tmp, ignore_errors=True)
