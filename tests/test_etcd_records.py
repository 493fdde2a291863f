"""Job state in etcd (`--coordinator etcd://...`, elastic_oneshot/etcd_records.py) against a real etcd: the commit and
epoch transactions directly, TLS, and real jobs on two simulated nodes (torchrun agents with `--rdzv-backend=etcd3`,
each in its own session) that lose the rank-0 node or see etcd killed and restarted mid-run."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_oneshot.durability.etcd_records import EtcdRecords, parse_url, redact
from elastic_oneshot.errors import StaleEpochError, UsageError
from elastic_oneshot.testing.etcd_server import EtcdServer, make_tls
from elastic_oneshot.testing.runs import assert_same_bits, one_thread_env, run_cli, tree_digest, workers
from elastic_oneshot.testing.tiny import make_model

JOB = ["--num-samples", 48, "--seq-len", 256, "--group-size", 64, "--chunk-size", 8]
LAYERS = 8
# A lost node is declared dead 3 s after its last heartbeat; a round waits 2 s for more nodes once one is in.
RDZV_CONF = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,close_timeout=10"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama8"), "llama", num_hidden_layers=LAYERS)


def records(endpoint: str, prefix: str, **options) -> EtcdRecords:
    query = "&".join(f"{k}={v}" for k, v in options.items())
    return EtcdRecords.from_url(f"etcd://{endpoint}/{prefix}" + (f"?{query}" if query else ""))


# -- the transactions, directly --------------------------------------------------------------------------
def test_url():
    p = parse_url("etcd://h:1234/jobs/x/?cacert=/a.pem&cert=/c.pem&key=/k.pem&user=u&password=s3cret&ttl=4")
    assert (p["endpoints"], p["prefix"]) == ([("h", 1234)], "/jobs/x/")
    assert parse_url("etcd://a:1,b,10.0.0.3:3/j")["endpoints"] == [("a", 1), ("b", 2379), ("10.0.0.3", 3)]
    assert p["options"]["password"] == "s3cret" and p["options"]["ttl"] == "4"
    assert "s3cret" not in redact("etcd://h:1234/jobs/x?user=u&password=s3cret") and "user=u" in redact(
        "etcd://h:1234/jobs/x?user=u&password=s3cret")
    for bad in ("http://h:1/x", "etcd://h:1/", "etcd://h:1/x?colour=red", "etcd://h:1/x?cert=/c.pem", "etcd://h:x/j",
                "etcd://a:1,,b:2/j"):
        with pytest.raises(UsageError):
            EtcdRecords.from_url(bad)


@pytest.mark.slow
@pytest.mark.etcd
def test_a_stale_epoch_cannot_commit(etcd):
    r = records(etcd.endpoint, "t/stale")
    r.claim({"fingerprint": "f"}, "/state")
    e1 = r.begin_epoch({})
    r.commit(0, e1, {"layer": 0})
    r.commit(1, e1, {"layer": 1})
    stale = records(etcd.endpoint, "t/stale")  # a worker of epoch e1 that slept through the next restart
    e2 = r.begin_epoch({0: e1, 1: e1})
    assert e2 == e1 + 1 and r.current_epoch() == e2 and r.epochs() == [e1, e2]
    with pytest.raises(StaleEpochError, match=f"epoch {e1} is stale"):
        stale.commit(2, e1, {"layer": 2})
    with pytest.raises(StaleEpochError, match="commits layer 2 next, not layer 3"):
        r.commit(3, e2, {"layer": 3})  # out of order
    r.commit(2, e2, {"layer": 2, "epoch": e2})
    with pytest.raises(StaleEpochError, match="already committed"):
        r.commit(2, e2, {"layer": 2, "again": True})
    assert r.committed() == {0: e1, 1: e1, 2: e2}
    assert r.manifest(2, e2) == {"layer": 2, "epoch": e2} and r.manifest(2, e1) is None

    # A redo: the new fence lacks layer 1 (its files failed their check); the cursor goes 1, then 3, skipping 2.
    e3 = r.begin_epoch({0: e1, 2: e2})
    with pytest.raises(StaleEpochError, match="next, not layer 3"):
        r.commit(3, e3, {})
    r.commit(1, e3, {"layer": 1})
    r.commit(3, e3, {"layer": 3})
    assert r.committed() == {0: e1, 1: e3, 2: e2, 3: e3}
    assert r.fence(e3)["committed"] == {"0": e1, "2": e2}
    progress = r.progress()
    assert (progress["epoch"], progress["layers_committed"], progress["last_layer"]) == (e3, 4, 3)

    # A --restart of the job drops the records but keeps the epoch counter growing.
    r.claim({"fingerprint": "g"}, "/state")
    assert r.committed() == {} and r.progress() is None and r.begin_epoch({}) == e3 + 1
    with pytest.raises(UsageError, match="another job"):
        records(etcd.endpoint, "t/stale").adopt({"fingerprint": "h"}, "/elsewhere")


@pytest.mark.slow
@pytest.mark.etcd
def test_two_processes_race_to_begin_the_same_epoch(etcd):
    a, b = records(etcd.endpoint, "t/race"), records(etcd.endpoint, "t/race")
    a.claim({"fingerprint": "f"}, "/state")
    call = a.etcd.call

    def b_goes_first(method, *args, **kwargs):  # b begins the epoch between a's read and a's transaction
        if method == "transaction" and kwargs["compare"]:
            a.etcd.call = call
            b.begin_epoch({})
        return call(method, *args, **kwargs)

    a.etcd.call = b_goes_first
    with pytest.raises(StaleEpochError, match="epoch 1 was begun by another process"):
        a.begin_epoch({})
    assert b.current_epoch() == 1 and b.epochs() == [1]

    # The same between real processes, many times: every epoch is begun exactly once, by one of them.
    code = ("from elastic_oneshot.durability.etcd_records import EtcdRecords\n"
            "from elastic_oneshot.errors import StaleEpochError\n"
            f"r = EtcdRecords.from_url('etcd://{etcd.endpoint}/t/race')\n"
            "won = []\n"
            "for _ in range(40):\n"
            "    try:\n"
            "        won.append(r.begin_epoch({}))\n"
            "    except StaleEpochError:\n"
            "        won.append(-1)\n"
            "print(won)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    won = sorted(e for r in results for e in r if e > 0)
    lost = sum(e < 0 for r in results for e in r)
    print(f"\n80 begin_epoch calls from 2 processes: {len(won)} epochs begun, {lost} refused")
    assert won == list(range(2, 2 + len(won))), "an epoch was begun twice, or skipped"
    assert b.current_epoch() == 1 + len(won) and len(won) + lost == 80


@pytest.mark.slow
@pytest.mark.etcd
def test_a_lost_lease_ends_the_worker_and_fences_its_commits(etcd):
    r = records(etcd.endpoint, "t/lease", ttl=2)
    r.claim({"fingerprint": "f"}, "/state")
    lost = threading.Event()
    r.on_lost = lambda reason: lost.set()
    r.attach(0, 1, 4)
    epoch = r.begin_epoch({})
    r.commit(0, epoch, {})
    assert r.progress()["live_ranks"] == [0]
    records(etcd.endpoint, "t/lease").etcd.call("revoke_lease", r._lease)  # as if it expired
    with pytest.raises(StaleEpochError, match="no longer holds its etcd lease"):
        r.commit(1, epoch, {})
    assert lost.wait(5), "the watchdog did not notice the lost lease"
    assert r.progress()["live_ranks"] == []


@pytest.mark.slow
@pytest.mark.etcd
def test_progress_is_followed_across_an_etcd_restart():
    with EtcdServer() as server:
        writer, reader = records(server.endpoint, "t/watch"), records(server.endpoint, "t/watch")
        writer.claim({"fingerprint": "f"}, "/state")
        writer.world_size, writer.layers_total = 1, 4

        def work():
            epoch = writer.begin_epoch({})
            for layer in range(4):
                time.sleep(0.3)
                if layer == 2:
                    server.kill()
                    time.sleep(0.5)
                    server.start()
                writer.commit(layer, epoch, {"layer": layer})

        thread = threading.Thread(target=work)
        thread.start()
        seen = [p["layers_committed"] for p in reader.watch_progress(timeout=60, interval=0.05)]
        thread.join()
    assert seen == sorted(seen) and seen[-1] == 4 and len(set(seen)) >= 3, seen


@pytest.mark.slow
@pytest.mark.etcd
def test_tls_and_a_client_certificate_from_another_ca(tmp_path):
    tls, rogue = make_tls(tmp_path / "tls", "trusted"), make_tls(tmp_path / "rogue", "rogue")
    with EtcdServer(tls=tls) as server:
        good = records(server.endpoint, "t/tls", cacert=tls.ca, cert=tls.client_cert, key=tls.client_key)
        good.claim({"fingerprint": "f"}, "/state")
        good.commit(0, good.begin_epoch({}), {"layer": 0})
        assert good.committed() == {0: 1}
        for options in (dict(cacert=tls.ca, cert=rogue.client_cert, key=rogue.client_key), dict(cacert=tls.ca), {}):
            with pytest.raises(RendezvousConnectionError):  # refused in the handshake, or http to an https port
                records(server.endpoint, "t/tls", retry_timeout=1, **options).committed()


# -- real jobs on two simulated nodes ---------------------------------------------------------------------
class Nodes:
    """torchrun agents, each in its own session with its worker: a simulated node."""

    def __init__(self, tmp_path, model, endpoint, name, url=None):
        self.tmp, self.endpoint, self.name = tmp_path, endpoint, name
        self.out, self.state = tmp_path / f"{name}-out", tmp_path / f"{name}-state"
        self.url = url or f"etcd://{endpoint}/jobs/{name}"
        self.cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                    "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={name}",
                    f"--rdzv-conf={RDZV_CONF}", "--max-restarts=3", "--monitor-interval=0.2",
                    "-m", "elastic_oneshot", "run", "--model", model, "--output", self.out, "--state", self.state,
                    "--coordinator", self.url, "--collective-timeout", "20", *JOB]
        self.agents: list[subprocess.Popen] = []
        self.records = EtcdRecords.from_url(self.url)

    def start(self, count: int = 2):
        for _ in range(count):
            log = open(self.tmp / f"{self.name}-agent{len(self.agents)}.log", "w")
            agent = subprocess.Popen(list(map(str, self.cmd)), stdout=log, stderr=subprocess.STDOUT,
                                     env=one_thread_env(), start_new_session=True)
            agent.log = log.name
            self.agents.append(agent)
        return self

    def workers(self, agent) -> dict[int, psutil.Process]:
        return workers(agent)

    def wait_layers(self, count: int, timeout: float = 120) -> float:
        """Until `count` layers are committed (read from etcd); returns when."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                progress = self.records.progress()
            except Exception:  # etcd restarting
                progress = None
            if progress and progress["layers_committed"] >= count:
                return time.monotonic()
            for agent in self.agents:
                assert agent.poll() in (None, 0), self.log(agent)
            assert time.monotonic() < deadline, f"no {count} layers within {timeout} s"
            time.sleep(0.02)

    def log(self, agent) -> str:
        return open(agent.log).read()[-6000:]

    def finish(self, agents=None, timeout: float = 150):
        for agent in agents or self.agents:
            try:
                rc = agent.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            assert rc == 0, f"agent exit {rc}:\n{self.log(agent)}"

    def events(self) -> list[dict]:
        with open(self.state / "events.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self):
        for agent in self.agents:
            procs = [agent] + list(self.workers(agent).values()) if agent.poll() is None else []
            for p in procs:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            agent.wait()
        self.records.close()


@pytest.fixture
def nodes(tmp_path, deep_llama):
    made = []

    def make(endpoint, name, url=None):
        made.append(Nodes(tmp_path, deep_llama, endpoint, name, url))
        return made[-1]

    yield make
    for n in made:
        n.close()


@pytest.fixture(scope="module")
def reference(etcd, deep_llama, tmp_path_factory):
    """Two nodes, uninterrupted: the bytes a run at world size 2 must reproduce."""
    n = Nodes(tmp_path_factory.mktemp("reference"), deep_llama, etcd.endpoint, "reference")
    t = time.monotonic()
    try:
        n.start(2).finish()
    finally:
        n.close()
    n.seconds = time.monotonic() - t
    return n


@pytest.mark.slow
@pytest.mark.etcd
def test_two_nodes_complete_a_job_with_its_state_in_etcd(reference, tmp_path):
    print(f"\ntwo nodes, {LAYERS} layers, state in etcd: {reference.seconds:.1f} s")
    starts = [e for e in reference.events() if e["event"] == "start"]
    assert starts[-1]["world_size"] == 2, starts  # (a node that starts late joins the second rendezvous)
    progress = EtcdRecords.from_url(reference.url).progress()
    assert (progress["layers_committed"], progress["layers_total"], progress["done"]) == (LAYERS, LAYERS, True)
    assert not (reference.state / "commits").exists() and not (reference.state / "epochs").exists()
    job = json.load(open(reference.state / "job.json"))["body"]
    assert job["job"]["coordinator"] == reference.url
    run_cli("export", "--state", reference.state, "--output", tmp_path / "export")  # finds etcd from job.json
    assert tree_digest(tmp_path / "export") == tree_digest(reference.out)


@pytest.mark.slow
@pytest.mark.etcd
def test_the_survivor_finishes_when_the_rank0_node_is_killed(etcd, nodes, reference):
    n = nodes(etcd.endpoint, "kill-rank0").start(2)
    n.wait_layers(2)
    victim = next(a for a in n.agents if 0 in n.workers(a))
    worker = n.workers(victim)[0]
    os.killpg(victim.pid, signal.SIGKILL)  # the agent's session...
    worker.kill()  # ...and its worker, which torchrun starts in a session of its own
    victim.wait()
    killed_at = time.monotonic()
    before = n.records.progress()["layers_committed"]
    assert before < LAYERS, "the job finished before the node was killed"
    survivor = next(a for a in n.agents if a is not victim)
    n.finish([survivor])
    print(f"\nrank-0 node killed after {before} layers; the survivor finished "
          f"{time.monotonic() - killed_at:.1f} s later")
    progress = n.records.progress()
    assert (progress["layers_committed"], progress["world_size"], progress["done"]) == (LAYERS, 1, True)
    assert [e["world_size"] for e in n.events() if e["event"] == "start"][-1] == 1
    assert_same_bits(n.out, reference.out)


@pytest.mark.slow
@pytest.mark.etcd
def test_etcd_killed_and_restarted_mid_run(deep_llama, nodes, reference, tmp_path):
    with EtcdServer() as server:  # its own: the rendezvous and the job state both live in it
        n = nodes(server.endpoint, "restart-etcd")
        n.start(2)
        n.wait_layers(2)
        before = n.records.progress()["layers_committed"]
        server.kill()
        down = time.monotonic()
        time.sleep(1.5)
        server.start()
        up = time.monotonic()
        after = n.wait_layers(before + 1)
        n.finish()
    starts = [e for e in n.events() if e["event"] == "start"]
    print(f"\netcd down {up - down:.1f} s after {before} layers; next commit {after - up:.1f} s after it was back; "
          f"epochs {[(e['epoch'], e['world_size']) for e in starts]}")
    assert before < LAYERS, "the job finished before etcd was killed"
    assert {e["world_size"] for e in starts} == {2}
    assert tree_digest(n.out) == tree_digest(reference.out)


@pytest.mark.slow
@pytest.mark.distributed
def test_chaos_with_etcd_restarts(deep_llama, tmp_path):
    """launch/chaos.py on its own etcd (rendezvous and job state), with restart_etcd among the faults. A larger job
    than above, so that four faults land before it ends; seed 19 draws restart_etcd first, then kill_node."""
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "chaos.py"), "--model", deep_llama, "--workdir", tmp_path,
         "--backend", "etcd3", "--coordinator", "--faults", "4", "--kinds",
         "restart_etcd,kill_worker,kill_node,add_node", "--nodes", "2", "--max-nodes", "3", "--seed", "19",
         "--etcd-pause", "1.5", "--", "--num-samples", "96", "--seq-len", "512", "--group-size", "64",
         "--chunk-size", "8"], capture_output=True, text=True, timeout=400)
    print(f"\nchaos ({time.monotonic() - t:.0f} s):\n{proc.stdout}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fault 1: restart_etcd" in proc.stdout and "invariants hold" in proc.stdout
