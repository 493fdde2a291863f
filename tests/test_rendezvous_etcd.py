"""`--rdzv-backend=etcd3` against a real etcd, with real torchrun agents ("nodes": one agent and one worker each,
several on this machine) running a real gloo job."""
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import etcd3  # protobuf set up for it by conftest.py
import etcd3.etcdrpc as etcdrpc
import grpc
import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from elastic_oneshot.distributed.etcd_rendezvous import KEY_ROOT, create_backend
from elastic_oneshot.testing.etcd_server import EtcdServer, make_tls

# Short rendezvous timings: a node is declared dead 3 s after its last heartbeat.
RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,close_timeout=10"

WORKER = textwrap.dedent('''
    """Sums ones over gloo every 0.1 s until the test creates OUT/release, or just once after a restart."""
    import json, os, sys, time
    import torch, torch.distributed as dist

    def record(kind, **info):
        path = os.path.join(sys.argv[1], f"{kind}-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(info, f)
        os.rename(path + ".tmp", path)

    dist.init_process_group("gloo")
    me = dict(pid=os.getpid(), agent=os.getppid(), group_rank=int(os.environ["GROUP_RANK"]),
              rank=dist.get_rank(), world=dist.get_world_size())
    record("started", **me)
    while True:
        stop = os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" or os.path.exists(os.path.join(sys.argv[1], "release"))
        sums = torch.tensor([1.0, float(stop)])
        dist.all_reduce(sums)  # [world size, ranks that want to stop]: all ranks stop at the same step
        if sums[1] > 0:
            break
        time.sleep(0.1)
    record("done", **me, total=sums[0].item())
    dist.destroy_process_group()
''')


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


def records(out, kind: str) -> list[dict]:
    return [json.load(open(out / f)) for f in sorted(os.listdir(out)) if f.startswith(kind) and f.endswith(".json")]


@pytest.fixture
def nodes(tmp_path):
    """nodes(endpoint, run_id, nnodes, ...) starts one torchrun agent, in its own session so a test can kill the
    whole node; teardown stops whatever is left. Worker records land in nodes.out; nodes.release() ends the job."""
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    agents = []

    def start(endpoint, run_id, nnodes, *, max_restarts=0, conf=""):
        log = open(tmp_path / f"agent-{len(agents)}.log", "w")
        agent = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
             "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
             f"--rdzv-conf={RDZV_CONF}{conf}", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
             str(tmp_path / "worker.py"), str(out)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        agent.log = log.name
        agents.append(agent)
        return agent

    start.out = out
    start.release = (out / "release").touch
    yield start
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)  # the agent stops its workers
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
    for worker in records(out, "started"):
        kill_quietly(worker["pid"])


def kill_quietly(pid: int, sig=signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def finish(agent, timeout: float = 90) -> str:
    try:
        rc = agent.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    log = open(agent.log).read()
    assert rc == 0, f"agent exit {rc}:\n{log[-5000:]}"
    return log


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


def params(endpoint: str, run_id: str, **conf) -> RendezvousParameters:
    return RendezvousParameters("etcd3", endpoint, run_id, 1, 2, **conf)


def kill_node(agent, worker_pid: int) -> None:
    """kill -9 a whole node: the agent's session, and its worker (torchrun starts workers in their own sessions)."""
    os.killpg(agent.pid, signal.SIGKILL)
    kill_quietly(worker_pid)
    agent.wait()


def both_started(out):
    pair = [r for r in records(out, "started") if r["world"] == 2]
    return pair if len(pair) == 2 else None


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.etcd
def test_two_nodes_run_a_gloo_job(etcd, nodes):
    nodes.release()
    agents = [nodes(etcd.endpoint, "two-nodes", "2:2") for _ in range(2)]
    for agent in agents:
        finish(agent)
    done = sorted((r["rank"], r["world"], r["total"]) for r in records(nodes.out, "done"))
    assert done == [(0, 2, 2.0), (1, 2, 2.0)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.etcd
def test_survivor_finishes_alone_when_the_rank0_node_is_killed(etcd, nodes):
    # With c10d, losing the node that hosts its store (the --rdzv-endpoint host) ends the job; here no node is special.
    agents = [nodes(etcd.endpoint, "failover", "1:2", max_restarts=3) for _ in range(2)]
    pair = wait_for(lambda: both_started(nodes.out), 60, "both workers of a two-node round")
    rank0 = next(r for r in pair if r["group_rank"] == 0)
    victim = next(a for a in agents if a.pid == rank0["agent"])
    kill_node(victim, rank0["pid"])
    survivor = next(a for a in agents if a is not victim)
    finish(survivor, 60)
    assert [(r["rank"], r["world"], r["total"]) for r in records(nodes.out, "done")] == [(0, 1, 1.0)]


@pytest.mark.slow
@pytest.mark.etcd
def test_compare_and_set_refuses_a_stale_token(etcd):
    backend, _ = create_backend(params(etcd.endpoint, "cas"))
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"first")
    assert (state, ok) == (b"first", True)
    assert backend.set_state(b"create again") == (b"first", token, False)
    _, token2, ok = backend.set_state(b"second", token)
    assert ok and token2 != token
    assert backend.set_state(b"stale", token) == (b"second", token2, False)
    assert backend.get_state() == (b"second", token2)


@pytest.mark.slow
@pytest.mark.etcd
def test_store_semantics(etcd):
    _, store = create_backend(params(etcd.endpoint, "store"))
    threads = [threading.Thread(target=lambda: [store.add("n", 1) for _ in range(20)]) for _ in range(3)]
    for t in threads:
        t.start()
    threading.Timer(0.3, store.set, ("late", b"v")).start()
    assert store.get("late") == b"v"  # blocks until set
    for t in threads:
        t.join()
    assert store.add("n", 0) == 60
    store.multi_set(["a", "b"], [b"1", b"2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"] and store.check(["a", "b"]) and not store.check(["a", "c"])
    assert store.compare_set("cs", "", "x") == b"x" and store.compare_set("cs", "y", "z") == b"x"
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.wait(["missing"], timedelta(seconds=0.2))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.etcd
def test_tls_and_a_client_certificate_from_another_ca(tmp_path, nodes):
    tls, rogue = make_tls(tmp_path / "tls", "trusted"), make_tls(tmp_path / "rogue", "rogue")
    nodes.release()
    with EtcdServer(tls=tls) as server:
        finish(nodes(server.endpoint, "tls", "1", conf=f",cacert={tls.ca},cert={tls.client_cert},key={tls.client_key}"))
        assert [r["world"] for r in records(nodes.out, "done")] == [1]
        for conf in (dict(cacert=tls.ca, cert=rogue.client_cert, key=rogue.client_key), {}):
            backend, _ = create_backend(params(server.endpoint, "tls", retry_timeout=1, **conf))
            with pytest.raises(RendezvousConnectionError):
                backend.get_state()


@pytest.mark.slow
@pytest.mark.etcd
def test_user_and_password_survive_an_etcd_restart():
    with EtcdServer() as server:
        root = etcd3.client("127.0.0.1", server.port)
        auth = etcdrpc.AuthStub(root.channel)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="secret"))
        auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"))
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"))
        auth.AuthEnable(etcdrpc.AuthEnableRequest())
        backend, _ = create_backend(params(server.endpoint, "auth", user="root", password="secret"))
        token = backend.set_state(b"before")[1]
        server.restart()  # etcd forgets the auth token it gave out
        assert backend.set_state(b"after", token)[2]
        for conf in (dict(user="root", password="wrong"), {}):
            with pytest.raises(grpc.RpcError):
                create_backend(params(server.endpoint, "auth", **conf))[0].get_state()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.etcd
def test_a_node_joins_a_running_job(etcd, nodes):
    first = nodes(etcd.endpoint, "scale-up", "1:2")
    wait_for(lambda: records(nodes.out, "started"), 60, "the first node's worker")
    second = nodes(etcd.endpoint, "scale-up", "1:2")
    wait_for(lambda: both_started(nodes.out), 60, "a round with both nodes")
    nodes.release()
    finish(first), finish(second)
    done = sorted((r["rank"], r["world"], r["total"]) for r in records(nodes.out, "done"))
    assert done == [(0, 2, 2.0), (1, 2, 2.0)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.etcd
def test_rerun_with_the_id_of_a_finished_run(etcd, nodes):
    nodes.release()
    finish(nodes(etcd.endpoint, "rerun", "1"))
    log = finish(nodes(etcd.endpoint, "rerun", "1"))  # torch closed this rendezvous for good at the end of run 1
    assert "was closed by an earlier run" in log
    assert [r["world"] for r in records(nodes.out, "done")] == [1, 1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.etcd
def test_rerun_with_the_id_of_a_crashed_run(etcd, nodes):
    agent = nodes(etcd.endpoint, "crashed", "1:2")
    worker = wait_for(lambda: records(nodes.out, "started"), 60, "the worker")[0]
    kill_node(agent, worker["pid"])
    state = create_backend(params(etcd.endpoint, "crashed"))[0].get_state()
    assert not pickle.loads(state[0]).closed  # a crash leaves the state open, with a dead node in it
    nodes.release()
    finish(nodes(etcd.endpoint, "crashed", "1:2"))
    assert [r["world"] for r in records(nodes.out, "done")] == [1]


@pytest.mark.slow
@pytest.mark.etcd
def test_closed_run_with_a_live_agent_fails_fast(etcd):
    backend, _ = create_backend(params(etcd.endpoint, "live"))
    state = _RendezvousState()
    state.closed = True
    token = backend.set_state(pickle.dumps(state))[1]
    stop = threading.Event()

    def heartbeat(token=token):
        while not stop.wait(0.2):
            token = backend.set_state(pickle.dumps(state), token)[1]

    threading.Thread(target=heartbeat).start()
    try:
        with pytest.raises(RendezvousClosedError, match=f"etcdctl del --prefix {KEY_ROOT}live/$") as e:
            backend.clear_finished_run(lambda: True, timedelta(seconds=1))  # the handler's is_closed()
        assert "\n" not in str(e.value)
    finally:
        stop.set()
