"""A network namespace behind a link of a given bandwidth, for tests and benchmarks that need a real link.

    with Namespace(mbit=26) as ns:          # a veth pair, 10.201.N.1 (here) <-> 10.201.N.2 (in ns)
        server = ns.popen([...])            # a process inside it, reached at ns.address

Both directions of the veth pair are shaped by a token bucket (`tc qdisc ... tbf`), so concurrent transfers share
the bandwidth as they would on a real link. Everything is created here and removed on exit, also on failure: the
namespace (deleting it deletes the pair and its qdiscs); no other interface, qdisc or rule is touched. Where the
machine does not allow it (not root, no `ip`), NamespaceUnavailable says so in one line.
"""

import os
import shutil
import subprocess


class NamespaceUnavailable(RuntimeError):
    """This machine cannot create network namespaces."""


def _ip(*args: str, namespace: str | None = None):
    cmd = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise NamespaceUnavailable(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _tc(*args: str, namespace: str | None = None):
    cmd = [*(["ip", "netns", "exec", namespace] if namespace else []), "tc", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise NamespaceUnavailable(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _free_subnet() -> int:
    """N such that no interface here has an address in 10.201.N.0/24."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    return next(n for n in range(1 + os.getpid() % 200, 255) if f"10.201.{n}." not in used)


class Namespace:
    """A namespace named eo-PID-N holding one end of a veth pair; `address` is its end, `host` ours; `mbit`:
    the link's rate each way (None: not shaped)."""

    def __init__(self, mbit: float | None = None):
        self.mbit, self.name, self._link = mbit, None, None

    def __enter__(self) -> "Namespace":
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            raise NamespaceUnavailable("network namespaces need root and the ip and tc commands (iproute2)")
        n = _free_subnet()
        self.name, here, there = f"eo-{os.getpid()}-{n}", f"eoh{n}", f"eon{n}"
        self.host, self.address = f"10.201.{n}.1", f"10.201.{n}.2"
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            self._link = here
            _ip("link", "set", there, "netns", self.name)
            _ip("addr", "add", f"{self.host}/30", "dev", here)
            _ip("link", "set", here, "up")
            _ip("addr", "add", f"{self.address}/30", "dev", there, namespace=self.name)
            _ip("link", "set", there, "up", namespace=self.name)
            _ip("link", "set", "lo", "up", namespace=self.name)
            if self.mbit:
                shape = ["root", "tbf", "rate", f"{self.mbit}mbit", "burst", "32kb", "latency", "100ms"]
                _tc("qdisc", "add", "dev", here, *shape)
                _tc("qdisc", "add", "dev", there, *shape, namespace=self.name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """`cmd` started inside the namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *cmd], **kwargs)

    def __exit__(self, *exc):
        if self._link is not None:  # gone with the namespace if its peer was moved there
            subprocess.run(["ip", "link", "del", self._link], capture_output=True)
            self._link = None
        if self.name is not None:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            self.name = None
