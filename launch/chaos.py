"""Chaos harness: K simulated nodes on one machine, faults from a seeded schedule, invariants checked.

Each node is a torchrun agent with its worker, in its own session (so a whole node can be killed,
frozen or preempted). Faults: kill -9 a worker; kill a whole node; SIGSTOP then SIGCONT a node;
SIGTERM a node (spot notice); add a node; corrupt or truncate a state file; with `--backend etcd3` and the
harness's own etcd, kill -9 etcd and restart it on the same data after a pause.

With `--network`, every node, the rendezvous store (or, with `--backend etcd3`, each member of a three-member etcd
cluster) and the S3 server holding the state are hosts of their own on a bridge (testing/netns.py: network
namespaces, removed at the end), and the network fails too, each fault healed after a while: `partition` (a node
cut off from everything), `partition_keep_store` (from its peers and the rendezvous, not from the object store:
the split brain), `slow_link` (a node's link throttled), `lossy_link` (5 % of its packets dropped),
`store_brownout` (the object store's link throttled), and with etcd `kill_leader` (the leading member killed and
restarted) and `lose_quorum` (two members cut off for QUORUM_LOSS_S).

At the end it checks that every layer was committed at most once per epoch, that progress never went backwards,
that no commit counted was made after a newer epoch began, and that the checkpoint equals an uninterrupted run's
(byte for byte, at whatever world sizes it ran), then prints figures per fault kind.

    python launch/chaos.py --model DIR --nodes 2 --max-nodes 3 --faults 10 --seed 0 --report -- --num-samples 48
    python launch/chaos.py --model DIR --backend etcd3 --coordinator --kinds restart_etcd,kill_node,add_node ...
    python launch/chaos.py --network --faults 12 --seed 1 --report   # a tiny model and job of its own

With `--backend etcd3` and no `--endpoint`, it starts its own etcd on 127.0.0.1 (data in a temp dir, stopped by PID
at the end); `--coordinator` (no URL: that etcd) keeps the job's epochs and commits in etcd too.
"""

import argparse
import contextlib
import hashlib
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import psutil

from elastic_oneshot.durability import layout
from elastic_oneshot.durability.coordinator import open_records
from elastic_oneshot.durability.state import StateStore, read_events
from elastic_oneshot.errors import CorruptStateError
from elastic_oneshot.events import History
from elastic_oneshot.testing.netns import Fabric, NamespaceUnavailable

HERE = os.path.dirname(os.path.abspath(__file__))
QUORUM_LOSS_S = 20  # lose_quorum: seconds two of the three etcd members are cut off
ETCD_RETRY_S = 40  # retry_timeout of etcd calls on --network: longer than QUORUM_LOSS_S plus an election
KINDS = ("kill_worker", "kill_node", "stop_node", "term_node", "add_node", "corrupt_file", "restart_etcd")
NETWORK_KINDS = ("partition", "partition_keep_store", "slow_link", "lossy_link", "store_brownout", "kill_leader",
                 "lose_quorum")
CUTS = ("partition", "partition_keep_store")  # faults after which the survivors go on without the node
STAYS = ("corrupt_file", "restart_etcd", "slow_link", "lossy_link", "store_brownout", "kill_leader",
         "lose_quorum")  # faults that leave the membership as it is


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(network: bool = False) -> dict:
    """A node's environment; on a Fabric, gloo uses the host's one link."""
    return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
            **({"GLOO_SOCKET_IFNAME": "eth0"} if network else {})}


class Node:
    """A torchrun agent and its worker(s), in a session of their own; on `host` (a Fabric's) if given.
    `stopped`: frozen, or cut off from the others, until the fault heals."""

    def __init__(self, name: str, cmd: list[str], log_dir: str, host=None):
        self.name, self.stopped, self.host = name, False, host
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        if host is not None:
            at = cmd.index("elastic_oneshot") - 1  # torchrun's own options end at its "-m"
            cmd = [*cmd[:at], f"--local-addr={host.address}", *cmd[at:]]
        popen = subprocess.Popen if host is None else host.popen
        self.proc = popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=node_env(host is not None),
                          start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def workers(self) -> dict[int, psutil.Process]:
        found = {}
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return found
        for child in children:
            try:
                rank = child.environ().get("RANK")
                if rank is not None and "elastic_oneshot" in " ".join(child.cmdline()):
                    found[int(rank)] = child
            except psutil.Error:
                pass
        return found

    def signal_all(self, sig):
        workers = list(self.workers().values())  # torchrun starts them in sessions of their own
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        for worker in workers:
            try:
                worker.send_signal(sig)
            except psutil.Error:
                pass


class Cluster:
    """Nodes sharing one rendezvous (a standalone c10d store, or etcd) and one state directory. With `network` (a
    netns.Fabric), every node, the rendezvous store and the object store (`object_store`: a local S3 server the
    cluster starts, holding the state) are hosts of their own on it."""

    def __init__(self, workdir: str, model: str, job_args: list[str], max_nodes: int,
                 backend: str = "c10d", endpoint: str | None = None, collective_timeout: float = 10.0,
                 coordinator: str | None = None, etcd_pause: float = 2.0, state_url: str | None = None,
                 network=None, object_store: bool = False):
        self.workdir, self.max_nodes, self.backend, self.network = workdir, max_nodes, backend, network
        self.state, self.output = state_url or os.path.join(workdir, "state"), os.path.join(workdir, "out")
        os.makedirs(workdir, exist_ok=True)
        self.store = self.etcd = self.s3 = self.store_host = None
        self.etcd_pause = etcd_pause
        if object_store:
            self.state = self._start_object_store()
        if endpoint is None and backend == "etcd3":
            from elastic_oneshot.testing.etcd_server import EtcdCluster, EtcdServer

            self.etcd = EtcdCluster(network).start() if network else EtcdServer().start()
            endpoint = self.etcd.endpoint
        elif endpoint is None:
            endpoint = self._start_store()
        conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=300"
        if backend == "c10d":
            conf = "is_host=false," + conf
        elif network:  # the agents ride out a lost quorum for up to ETCD_RETRY_S, the workers' records too
            conf += f",retry_timeout={ETCD_RETRY_S}"
        self.cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{max_nodes}",
                    "--nproc-per-node=1", "--max-restarts=1000", "--monitor-interval=0.2",
                    f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", "--rdzv-id=chaos",
                    f"--rdzv-conf={conf}", "-m", "elastic_oneshot", "run", "--model", model,
                    "--state", self.state, "--output", self.output,
                    "--collective-timeout", str(collective_timeout), *map(str, job_args)]
        if coordinator == "auto":
            if backend != "etcd3":
                raise SystemExit("--coordinator without a URL uses the rendezvous etcd: add --backend etcd3")
            coordinator = f"etcd://{endpoint}/elastic-oneshot-chaos/{int(time.time())}"
            coordinator += f"?retry_timeout={ETCD_RETRY_S}" if network else ""
        if coordinator:
            self.cmd += ["--coordinator", coordinator]
        self.nodes: list[Node] = []

    def _start_store(self) -> str:
        host = self.network.host("rdzv") if self.network else None
        address, port = (host.address, 29400) if host else ("127.0.0.1", free_port())
        cmd = [sys.executable, os.path.join(HERE, "store.py"), "--host", address, "--port", str(port)]
        self.store = (host.popen if host else subprocess.Popen)(cmd, stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        return f"{address}:{port}"

    def _start_object_store(self) -> str:
        """The state on a local S3 server (on a host of its own on the network): its credentials and endpoint go
        into this process's environment, which the nodes inherit."""
        from elastic_oneshot.testing.s3_server import S3Server

        self.store_host = self.network.host("s3") if self.network else None
        self.s3 = S3Server(namespace=self.store_host).start()
        os.environ.update(self.s3.env)
        return f"s3://{self.s3.bucket}/chaos"

    def add_node(self) -> Node:
        name = f"node{len(self.nodes)}"
        node = Node(name, self.cmd, self.workdir, self.network.host(name) if self.network else None)
        self.nodes.append(node)
        return node

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive and not n.stopped]

    def events(self) -> list[dict]:
        return read_events(self.state)

    def history(self) -> History:
        return History(self.events())

    def commits(self) -> int:
        return len(self.history().commits)

    def epoch(self) -> int:
        return max((e["epoch"] for e in self.history().starts), default=0)

    def wait_progress(self, after_epoch: int = -1, after_time: float = 0.0, timeout: float = 180) -> bool:
        """Until a layer commits in an epoch newer than `after_epoch` and later than `after_time`, or the job is
        done; False if neither happens within `timeout` seconds (the job is stuck)."""
        deadline = time.monotonic() + timeout
        while not self.done():
            if any(e["epoch"] > after_epoch and e["time"] > after_time for e in self.history().commits):
                return True
            if time.monotonic() > deadline or not any(n.alive for n in self.nodes):
                return False
            time.sleep(0.05)
        return True

    def done(self) -> bool:
        return os.path.isfile(os.path.join(self.output, "config.json"))

    def wait_commits(self, count: int, timeout: float = 300, world_size: int | None = None):
        """Until `count` layers are committed, or the job is done; with `world_size`, `count` committed in epochs of
        that many ranks, the job's end before them an error (nodes started together may still begin apart: one that
        starts late joins the next rendezvous, not the first)."""
        deadline = time.monotonic() + timeout
        while (got := sum(world_size in (None, c["world_size"]) for c in self.history().commits)) < count:
            if self.done() and world_size is None:
                return
            if time.monotonic() > deadline or self.done():
                raise TimeoutError(f"{got} of {count} commits{f' at world size {world_size}' if world_size else ''} "
                                   f"within {timeout} s")
            time.sleep(0.05)

    def wait_done(self, timeout: float = 600) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.done() and not any(n.alive for n in self.nodes if not n.stopped):
                return True
            time.sleep(0.2)
        return False

    def rank0(self) -> Node | None:
        return next((n for n in self.live() if 0 in n.workers()), None)

    def close(self, etcd: bool = True):
        for node in self.nodes:
            node.signal_all(signal.SIGCONT)
            node.signal_all(signal.SIGKILL)
        if self.store:
            self.store.kill()
        if self.s3 and etcd:
            self.s3.stop()
        if self.etcd and etcd:
            self.etcd.close()  # SIGKILL by PID, then its temp dir goes


# -- faults -----------------------------------------------------------------------------------------
def inject(cluster: Cluster, kind: str, rng: random.Random, stop_s: float) -> str:
    live = cluster.live()
    node = rng.choice(live) if live else None
    if kind == "kill_worker":
        victim = rng.choice(list(node.workers().values()) or [None])
        if victim:
            victim.send_signal(signal.SIGKILL)
        return node.name
    if kind == "kill_node":
        node.signal_all(signal.SIGKILL)
        return node.name
    if kind == "stop_node":
        node.signal_all(signal.SIGSTOP)
        node.stopped = True
        later(stop_s, lambda: node.signal_all(signal.SIGCONT), node)
        return node.name
    if kind == "term_node":
        node.signal_all(signal.SIGTERM)
        return node.name
    if kind == "add_node":
        return cluster.add_node().name
    if kind == "corrupt_file":
        return corrupt(cluster.state, rng)
    if kind == "restart_etcd":
        cluster.etcd.kill()
        time.sleep(cluster.etcd_pause)
        cluster.etcd.start()
        return "etcd"
    if kind in NETWORK_KINDS:
        return network_fault(cluster, kind, node, hold_s=stop_s)
    raise ValueError(kind)


def network_fault(cluster: Cluster, kind: str, node: Node, hold_s: float) -> str:
    """A network fault on `node`'s link (the object store's for store_brownout, etcd's for the last two), healed
    after `hold_s`."""
    if kind in ("kill_leader", "lose_quorum"):
        return etcd_fault(cluster.etcd, kind, hold_s)
    host = cluster.store_host if kind == "store_brownout" else node.host
    if kind in CUTS:  # from the peers and the rendezvous; partition_keep_store still reaches the object store
        host.cut(keep=[cluster.store_host.address] if kind == "partition_keep_store" and cluster.store_host else [])
        node.stopped = True
    elif kind == "slow_link":
        host.throttle(mbit=1)
    elif kind == "lossy_link":
        host.lose(0.05)
    else:
        host.throttle(mbit=2, latency_ms=2000)
    later(hold_s, host.heal, node)
    return "s3" if kind == "store_brownout" else node.name


def etcd_fault(etcd, kind: str, hold_s: float) -> str:
    """kill_leader: the leading member killed, back on its data after `hold_s`; lose_quorum: the leader and
    another member cut off for QUORUM_LOSS_S (the third alone has no quorum)."""
    leader = etcd.leader()
    if kind == "kill_leader":
        etcd.kill(leader)
        later(hold_s, lambda: etcd.start(leader))
    else:
        cut = [etcd.hosts[leader], etcd.hosts[(leader + 1) % len(etcd.hosts)]]
        for host in cut:
            host.cut()
        later(QUORUM_LOSS_S, lambda: [host.heal() for host in cut])
    return f"etcd member {leader}"


def later(seconds: float, undo, node: Node | None = None):
    """`undo` a fault after `seconds`, in a thread; then `node` counts as working again."""
    def run():
        time.sleep(seconds)
        try:
            undo()
        except RuntimeError:
            pass  # the network or etcd went with the harness
        if node is not None:
            node.stopped = False
    threading.Thread(target=run, daemon=True).start()


def corrupt(state: str, rng: random.Random) -> str:
    """Flip bytes in, or truncate, a committed layer file, a manifest or a boundary chunk."""
    if StateStore(state).local is None:
        return corrupt_object(state, rng)
    candidates = []
    for sub in (layout.SOLVED, layout.COMMITS, layout.BOUNDARIES):
        for dirpath, _, files in os.walk(os.path.join(state, sub)):
            candidates += [os.path.join(dirpath, f) for f in files if ".tmp" not in f]
    if not candidates:
        return "nothing"
    path = rng.choice(sorted(candidates))
    try:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            if rng.random() < 0.5:
                f.truncate(size // 2)
            else:
                f.seek(rng.randrange(max(1, size - 8)))
                f.write(b"\xff\x00\xff\x00")
    except OSError:
        return "vanished"
    return os.path.relpath(path, state)


def corrupt_object(url: str, rng: random.Random) -> str:
    """corrupt() on an object store: the object is written again, damaged."""
    import obstore

    storage = StateStore(url).storage
    candidates = sorted(o["path"] for sub in (layout.SOLVED, layout.COMMITS, layout.BOUNDARIES)
                        for batch in obstore.list(storage.store, sub) for o in batch)
    if not candidates:
        return "nothing"
    rel = rng.choice(candidates)
    data = storage.get(rel)
    if data is None:
        return "vanished"
    at = rng.randrange(max(1, len(data) - 8))
    storage.put(rel, data[:len(data) // 2] if rng.random() < 0.5 else data[:at] + b"\xff\x00\xff\x00" + data[at + 4:])
    return rel


def feasible(cluster: Cluster, kinds) -> list[str]:
    n = len(cluster.live())
    ok = []
    for kind in kinds:
        if kind in ("kill_node", "stop_node", "term_node") and n < 2:
            continue
        if kind == "add_node" and n + sum(node.stopped for node in cluster.nodes) >= cluster.max_nodes:
            continue
        if kind == "kill_worker" and n < 1:
            continue
        if kind == "restart_etcd" and (cluster.etcd is None or hasattr(cluster.etcd, "leader")):
            continue  # only the one-member etcd this harness started
        if kind in NETWORK_KINDS and (cluster.network is None or kind in CUTS and n < 2):
            continue
        if kind == "store_brownout" and cluster.store_host is None:
            continue
        if kind in ("kill_leader", "lose_quorum") and not hasattr(cluster.etcd, "leader"):
            continue  # a three-member cluster: --backend etcd3 --network
        ok.append(kind)
    return ok


# -- invariants -------------------------------------------------------------------------------------
def check_invariants(cluster: Cluster, corrupted_layers: set[int], reference: str) -> list[str]:
    failures = []
    seen = set()
    for e in cluster.history().commits:
        key = (e["epoch"], e["layer"])
        if key in seen:
            failures.append(f"layer {e['layer']} committed twice in epoch {e['epoch']}")
        seen.add(key)
    store = StateStore(cluster.state)
    records = open_records(store)  # in etcd when job.json names a coordinator
    fences = []
    for epoch in records.epochs():
        try:
            fences.append(records.fence(epoch))
        except CorruptStateError:
            pass  # a fence the harness corrupted
    for a, b in zip(fences, fences[1:]):
        lost = set(map(int, a["committed"])) - set(map(int, b["committed"])) - corrupted_layers
        if lost:
            failures.append(f"progress went backwards from epoch {a['epoch']} to {b['epoch']}: layers {sorted(lost)}")
    committed = records.committed()
    failures += late_writes(store, records, committed, corrupted_layers)
    layers = store.job()["num_layers"]
    if sorted(committed) != list(range(layers)):
        failures.append(f"final state lacks layers {sorted(set(range(layers)) - set(committed))}")
    same = compare(cluster.output, reference)
    if same["bytes"] is not True:  # at any world size, and whatever the faults, the bits are the same
        failures.append(f"the checkpoint is not the uninterrupted run's, byte for byte: {same['codes']:.4%} codes "
                        f"identical, perplexity x{same['ppl_ratio']:.5f}")
    return failures


def late_writes(store: StateStore, records, committed: dict[int, int], corrupted_layers: set[int]) -> list[str]:
    """A commit that counts must be older than the fence of the epoch after its own (else a worker of an older
    epoch committed), and the weight files it names older than it (else something wrote into a committed
    layer). Read from the files' modification times; etcd's commits are transactions on the epoch key, and carry
    no time, so only the commits kept as files are checked. A commit record the harness corrupted (of a layer in
    `corrupted_layers`) is passed over: the job had read it, or it would have redone the layer."""
    if records.url is not None:
        return []
    slack = 1.0 if store.local is None else 0.0  # object stores keep whole seconds
    when = modified_times(store)
    failures = []
    for layer, epoch in sorted(committed.items()):
        commit = when.get(layout.commit(layer, epoch))
        newer = when.get(layout.fence(epoch + 1))
        if commit is not None and newer is not None and commit > newer + slack:
            failures.append(f"layer {layer} was committed in epoch {epoch} {commit - newer:.1f} s after epoch "
                            f"{epoch + 1} began")
        try:
            manifest = records.manifest(layer, epoch)
        except CorruptStateError:  # corrupted by the harness after the job's last read of it: the bits tell
            if layer not in corrupted_layers:
                failures.append(f"layer {layer}'s commit record of epoch {epoch} is unreadable")
            continue
        for record in manifest["weights"]:
            written = when.get(record["path"])
            if commit is not None and written is not None and written > commit + slack:
                failures.append(f"{record['path']} was written {written - commit:.1f} s after layer {layer}'s "
                                f"commit")
    return failures


def modified_times(store: StateStore) -> dict[str, float]:
    """Every file's modification time (Unix seconds), by its path in the state."""
    if store.local is not None:
        return {os.path.relpath(os.path.join(d, f), store.root): os.stat(os.path.join(d, f)).st_mtime
                for d, _, files in os.walk(store.root) for f in files}
    import obstore

    return {o["path"]: o["last_modified"].timestamp() for batch in obstore.list(store.storage.store) for o in batch}


def digest(root: str) -> dict:
    out = {}
    for f in sorted(os.listdir(root)):
        with open(os.path.join(root, f), "rb") as fh:
            out[f] = hashlib.sha256(fh.read()).hexdigest()
    return out


def compare(out: str, reference: str) -> dict:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    from elastic_oneshot.surface.evaluate import perplexity

    if digest(out) == digest(reference):
        return {"bytes": True, "codes": 1.0, "ppl_ratio": 1.0}
    a, b = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(reference, "model.safetensors"))
    same = total = 0
    for k in a:
        if k.endswith("weight_packed"):
            shape = a[k.replace("_packed", "_shape")]
            bits = 32 * a[k].shape[-1] // int(shape[-1])
            ca, cb = unpack_from_int32(a[k], bits, shape), unpack_from_int32(b[k], bits, shape)
            same += (ca == cb).sum().item()
            total += ca.numel()
    ratio = perplexity(out, num_samples=4, seq_len=128) / perplexity(reference, num_samples=4, seq_len=128)
    return {"bytes": False, "codes": same / total, "ppl_ratio": ratio}


# -- figures ----------------------------------------------------------------------------------------
def figures(faults: list[dict], events: list[dict]) -> list[dict]:
    """Per fault: seconds until a newer epoch began (detected) and until its first layer started (recovered), and
    whether the layer in flight was lost. A fault that leaves the membership as it is (etcd restarted, a slow
    link): seconds until the next commit, and whether the workers restarted."""
    history = History(events)
    starts = history.layers
    commits = {(e["epoch"], e["layer"]) for e in history.commits}
    for f in faults:
        epoch = history.epoch_at(f["time"])
        began = [e for e in history.starts if e["epoch"] > epoch and e["time"] >= f["time"]]
        f["detect_s"] = began[0]["time"] - f["time"] if began and f["kind"] != "corrupt_file" else None
        if f["kind"] in STAYS:
            after = [e for e in history.commits if e["time"] >= f["time"]]
            f["recovery_s"] = after[0]["time"] - f["time"] if after else None
            f["lost_layers"] = int(bool(after) and after[0]["epoch"] > epoch)
            continue
        after = [e for e in starts if e["epoch"] > epoch and e["time"] >= f["time"]]
        f["recovery_s"] = after[0]["time"] - f["time"] if after and f["kind"] != "corrupt_file" else None
        in_flight = [e for e in starts if e["epoch"] == epoch and e["time"] <= f["time"]]
        f["lost_layers"] = int(bool(in_flight) and (epoch, in_flight[-1]["layer"]) not in commits
                               and f["recovery_s"] is not None)
    return faults


def table(faults: list[dict], events: list[dict]) -> str:
    rows = ["fault                 count  recovered  median detect (s)  median recovery (s)  layers lost"]
    for kind in KINDS + NETWORK_KINDS:
        mine = [f for f in faults if f["kind"] == kind]
        if not mine:
            continue
        rec = [f["recovery_s"] for f in mine if f["recovery_s"] is not None]
        det = [f["detect_s"] for f in mine if f["detect_s"] is not None]
        med = f"{statistics.median(rec):.1f}" if rec else "-"
        mdet = f"{statistics.median(det):.1f}" if det else "-"
        rows.append(f"{kind:21} {len(mine):5d}  {len(rec):9d}  {mdet:>17}  {med:>19}  "
                    f"{sum(f['lost_layers'] for f in mine):11d}")
    epochs = History(events).starts
    rows.append(f"epochs {len(epochs)}, world sizes {[e['world_size'] for e in epochs]}")
    return "\n".join(rows)


def reference_run(model: str, job_args: list[str], workdir: str) -> str:
    """The uninterrupted run the campaign's checkpoint must equal, byte for byte: one process, one thread (the bits
    are the same at any world size), made once per workdir."""
    out = os.path.join(workdir, "reference")
    if not os.path.isfile(os.path.join(out, "config.json")):
        shutil.rmtree(out + ".state", ignore_errors=True)
        subprocess.run([sys.executable, "-m", "elastic_oneshot", "run", "--model", model, "--output", out,
                        *map(str, job_args)], check=True, env=node_env(), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="chaos test of elastic-oneshot on one machine")
    p.add_argument("--model", help="the model to compress (default: a tiny random 48-layer Llama, made in the "
                                    "workdir, with a job of a second or two per layer)")
    p.add_argument("--workdir", default="chaos-work")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--max-nodes", type=int, default=3)
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--kinds", help=f"comma-separated, of {', '.join(KINDS + NETWORK_KINDS)} (default: all that "
                                   "apply: the network ones with --network)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="c10d", choices=["c10d", "etcd3"])
    p.add_argument("--endpoint", help="rendezvous endpoint (default: start a standalone c10d store, or an etcd)")
    p.add_argument("--coordinator", nargs="?", const="auto",
                   help="keep the job state in etcd: a URL, or none for the etcd of --backend etcd3")
    p.add_argument("--etcd-pause", type=float, default=2.0, help="seconds etcd stays down in restart_etcd")
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--state-url", help="keep the state on object storage (s3://BUCKET/PREFIX; emptied first), "
                                       "credentials and endpoint from the environment (AWS_ENDPOINT_URL...)")
    p.add_argument("--object-store", action="store_true",
                   help="keep the state on a local S3 server (moto) that the harness starts (the default with "
                        "--network, whose nodes share no directory on a real fleet)")
    p.add_argument("--shared-directory", action="store_true", help="with --network: the state in a directory")
    p.add_argument("--network", action="store_true",
                   help="every node and server a network namespace of its own on one bridge (root; removed at "
                        "the end): the network faults need it")
    p.add_argument("--report", action="store_true", help="print the median time from fault to recovery")
    p.add_argument("job", nargs="*", help="arguments for `elastic-oneshot run` (after --)")
    a = p.parse_args(argv)
    a.kinds = a.kinds.split(",") if a.kinds else list(KINDS + (NETWORK_KINDS if a.network else ()))
    unknown = set(a.kinds) - set(KINDS + NETWORK_KINDS)
    if unknown:
        p.error(f"unknown fault kinds: {', '.join(sorted(unknown))}")
    if set(a.kinds) & set(NETWORK_KINDS) and not a.network:
        p.error("network faults need --network")
    a.object_store = a.object_store or a.network and not (a.shared_directory or a.state_url)
    if a.model is None:
        from elastic_oneshot.testing.tiny import make_model

        a.model = make_model(os.path.join(a.workdir, "model"), "llama", num_hidden_layers=48, hidden_size=512,
                             intermediate_size=1024)
        a.job = a.job or ["--num-samples", "128", "--seq-len", "256", "--group-size", "64", "--chunk-size", "8"]
    return a


def campaign(cluster: Cluster, a: argparse.Namespace, rng: random.Random) -> tuple[list[dict], set[int], str | None]:
    """Start the nodes, inject `a.faults` faults, wait for the end: the faults, the layers whose files were
    corrupted, and why the job did not finish (None if it did)."""
    faults, corrupted = [], set()
    for _ in range(a.nodes):
        cluster.add_node()
    stuck = None if cluster.wait_progress() else "no layer committed after the start"
    while len(faults) < a.faults and not cluster.done() and not stuck:
        time.sleep(rng.uniform(0, 0.5))
        if cluster.done():
            break
        kind = rng.choice(feasible(cluster, a.kinds))
        target = inject(cluster, kind, rng, stop_s=a.collective_timeout + 5)
        faults.append({"kind": kind, "target": target, "time": time.time()})
        if kind == "corrupt_file" and target.startswith((layout.SOLVED, layout.COMMITS)):
            corrupted.add(int(target.split("/")[1].split(".")[0]))
        print(f"{time.strftime('%H:%M:%S')} fault {len(faults)}: {kind} {target}", flush=True)
        if not cluster.live() and not any(n.stopped for n in cluster.nodes):
            cluster.add_node()
        # Work again after this fault, in the new membership unless the fault leaves it as it is.
        restarts = kind not in STAYS  # etcd coming back, or a link healing, restarts nothing
        if not cluster.wait_progress(cluster.epoch() if restarts else -1, faults[-1]["time"]):
            stuck = f"no layer committed within 180 s after fault {len(faults)}"
    if not cluster.live() and not stuck:
        cluster.add_node()
    if not stuck and not cluster.wait_done():
        stuck = "not done within 600 s after the last fault"
    return faults, corrupted, stuck


def main(argv=None) -> int:
    a = parse(argv)
    rng = random.Random(a.seed)
    shutil.rmtree(os.path.join(a.workdir, "state"), ignore_errors=True)
    if a.state_url:
        StateStore(a.state_url).clear()
    shutil.rmtree(os.path.join(a.workdir, "out"), ignore_errors=True)
    os.makedirs(a.workdir, exist_ok=True)
    reference = reference_run(a.model, a.job, a.workdir)
    with contextlib.ExitStack() as stack:
        try:
            network = stack.enter_context(Fabric()) if a.network else None
        except NamespaceUnavailable as e:
            print(f"chaos: {e}")
            return 2
        cluster = Cluster(a.workdir, a.model, a.job, a.max_nodes, a.backend, a.endpoint, a.collective_timeout,
                          a.coordinator, a.etcd_pause, a.state_url, network, a.object_store)
        stack.callback(cluster.close)
        try:
            faults, corrupted, stuck = campaign(cluster, a, rng)
        finally:
            cluster.close(etcd=False)  # the checks may read the job state from it
        if stuck:
            print(f"the job did not finish: {stuck} (node logs: {a.workdir})")
            return 1
        failures = check_invariants(cluster, corrupted, reference)
        events = cluster.events()
    print(table(figures(faults, events), events))
    rec = [f["recovery_s"] for f in faults if f["recovery_s"] is not None]
    if a.report and rec:
        print(f"median time from fault to first work in the new membership: {statistics.median(rec):.1f} s "
              f"(n={len(rec)}, min {min(rec):.1f}, max {max(rec):.1f})")
    for f in failures:
        print(f"INVARIANT VIOLATED: {f}")
    print(f"{len(faults)} faults, invariants {'hold' if not failures else 'VIOLATED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
