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


def _run(*cmd: str, namespace: str | None = None):
    """`cmd` (ip, tc, iptables), inside `namespace` if given; NamespaceUnavailable with its error if it fails."""
    cmd = (*(["ip", "netns", "exec", namespace] if namespace else []), *cmd)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise NamespaceUnavailable(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _remove(link: str | None, namespaces: list[str | None]):
    """Delete our veth `link` (with its peer) and our `namespaces` (with what is in them), whatever exists."""
    if link is not None:
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    for name in namespaces:
        if name is not None:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _free_subnet(prefix: str = "10.201") -> int:
    """N such that no interface here has an address in PREFIX.N.0/24."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    return next(n for n in range(1 + os.getpid() % 200, 255) if f"{prefix}.{n}." not in used)


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
            _run("ip", "netns", "add", self.name)
            _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            self._link = here
            _run("ip", "link", "set", there, "netns", self.name)
            _run("ip", "addr", "add", f"{self.host}/30", "dev", here)
            _run("ip", "link", "set", here, "up")
            _run("ip", "addr", "add", f"{self.address}/30", "dev", there, namespace=self.name)
            _run("ip", "link", "set", there, "up", namespace=self.name)
            _run("ip", "link", "set", "lo", "up", namespace=self.name)
            if self.mbit:
                shape = ["root", "tbf", "rate", f"{self.mbit}mbit", "burst", "32kb", "latency", "100ms"]
                _run("tc", "qdisc", "add", "dev", here, *shape)
                _run("tc", "qdisc", "add", "dev", there, *shape, namespace=self.name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """`cmd` started inside the namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *cmd], **kwargs)

    def __exit__(self, *exc):
        _remove(self._link, [self.name])  # the link first: gone with the namespace only once its peer was moved
        self._link = self.name = None


class Fabric:
    """A switch and the hosts on it, for tests that fail by the network: each host is a namespace whose `eth0` has
    an address on 10.202.N.0/24; the switch is a bridge in a namespace of its own; this machine reaches every
    host at `gateway` through one veth pair of ours. Faults act inside a host's namespace (its firewall, its
    qdisc), so they touch nothing of the machine's. Removing the namespaces removes everything made here.

        with Fabric() as net:
            store = net.host("store"); node = net.host("node0")
            node.popen([...]); node.cut(keep=[store.address]); node.throttle(mbit=2); node.heal()
    """

    def __init__(self):
        self.hosts: dict[str, Host] = {}
        self.hub = self._link = None

    def __enter__(self) -> "Fabric":
        if os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "tc", "iptables")):
            raise NamespaceUnavailable("network faults need root and the ip, tc and iptables commands "
                                       "(Debian: iproute2, iptables)")
        self.n = n = _free_subnet(prefix="10.202")
        self.subnet, self.hub, gateway_link = f"10.202.{n}", f"eo-{os.getpid()}-{n}-hub", f"eob{n}"
        self.gateway = f"{self.subnet}.254"
        try:
            _run("ip", "netns", "add", self.hub)
            _run("ip", "link", "add", "br0", "type", "bridge", namespace=self.hub)
            _run("ip", "link", "set", "br0", "up", namespace=self.hub)
            _run("ip", "link", "add", gateway_link, "type", "veth", "peer", "name", "gw", "netns", self.hub)
            self._link = gateway_link
            _run("ip", "link", "set", "gw", "master", "br0", "up", namespace=self.hub)
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", gateway_link)
            _run("ip", "link", "set", gateway_link, "up")
            _run("iptables", "-S", namespace=self.hub)  # a kernel without netfilter says so here
        except BaseException:
            self.__exit__()
            raise
        return self

    def host(self, name: str) -> "Host":
        """A new host named `name`, up, with the next address."""
        index = len(self.hosts) + 1
        host = Host(f"eo-{os.getpid()}-{self.n}-{name}", f"{self.subnet}.{index}")
        self.hosts[name] = host
        _run("ip", "netns", "add", host.namespace)
        _run("ip", "link", "add", f"p{index}", "type", "veth", "peer", "name", "eth0", "netns", host.namespace,
            namespace=self.hub)
        _run("ip", "link", "set", f"p{index}", "master", "br0", "up", namespace=self.hub)
        _run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0", namespace=host.namespace)
        _run("ip", "link", "set", "eth0", "up", namespace=host.namespace)
        _run("ip", "link", "set", "lo", "up", namespace=host.namespace)
        return host

    def __exit__(self, *exc):
        _remove(self._link, [h.namespace for h in self.hosts.values()] + [self.hub])
        self.hosts, self._link, self.hub = {}, None, None


class Host:
    """One machine on a Fabric: a namespace whose one link, `eth0`, has `address`."""

    def __init__(self, namespace: str, address: str):
        self.namespace, self.address = namespace, address

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """`cmd` started on this host."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace, *cmd], **kwargs)

    def _run(self, *cmd: str):
        _run(*cmd, namespace=self.namespace)

    def cut(self, keep: list[str] = ()):
        """A partition: every packet to or from another host dropped, but those of the addresses in `keep`."""
        for address in keep:
            self._run("iptables", "-A", "INPUT", "-i", "eth0", "-s", address, "-j", "ACCEPT")
            self._run("iptables", "-A", "OUTPUT", "-o", "eth0", "-d", address, "-j", "ACCEPT")
        self._run("iptables", "-A", "INPUT", "-i", "eth0", "-j", "DROP")
        self._run("iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "DROP")

    def lose(self, fraction: float):
        """A lossy link: each packet in or out dropped with probability `fraction`."""
        for chain, side in (("INPUT", "-i"), ("OUTPUT", "-o")):
            self._run("iptables", "-A", chain, side, "eth0", "-m", "statistic", "--mode", "random",
                      "--probability", str(fraction), "-j", "DROP")

    def throttle(self, mbit: float, latency_ms: int = 500):
        """A slow link: what leaves this host goes through a token bucket of `mbit`, queueing up to
        `latency_ms` (netem, which would add a fixed delay, is missing from some kernels: this one's included)."""
        self._run("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit", "burst", "16kb",
                  "latency", f"{latency_ms}ms")

    def heal(self):
        """Every fault above undone."""
        self._run("iptables", "-F")
        subprocess.run(["ip", "netns", "exec", self.namespace, "tc", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True)  # fails when there is none
