"""Faults of the network (launch/chaos.py --network): every node, the rendezvous store and the object store a host
of its own on a bridge (netns.Fabric), cut off, slowed, made lossy, or browned out for a while. After each, the
invariants hold and the checkpoint is the uninterrupted run's, byte for byte (it is at any world size)."""

import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest

from elastic_oneshot.testing.netns import Fabric, NamespaceUnavailable
from elastic_oneshot.testing.tiny import make_model
from launch.chaos import QUORUM_LOSS_S, Cluster, check_invariants, etcd_fault, figures, inject, reference_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["--num-samples", 16, "--seq-len", 256, "--group-size", 64, "--chunk-size", 8]  # about 1 s a layer at W=2
TIMEOUT = 10  # --collective-timeout
HOLD = TIMEOUT + 5  # seconds a fault lasts: a cut node is noticed before it heals

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture
def fabric():
    try:
        with Fabric() as net:
            yield net
    except NamespaceUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "wide16"), "llama", num_hidden_layers=16,
                      hidden_size=512, intermediate_size=1024)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    return reference_run(model, JOB, str(tmp_path_factory.mktemp("reference")))


def finished_intact(cluster: Cluster, reference: str) -> list[dict]:
    """Waits for the end; asserts every invariant and the uninterrupted run's bits; the epochs begun."""
    assert cluster.wait_done(timeout=400), "the job did not finish"
    cluster.close(etcd=False)  # every node gone; the object store stays for the checks
    failures = check_invariants(cluster, set(), reference)  # the bits among them
    assert not failures, failures
    starts = [e for e in cluster.events() if e["event"] == "start"]
    print(f"\nepochs {len(starts)}, world sizes {[e['world_size'] for e in starts]}")
    return starts


def first_commit_after(cluster: Cluster, at: float) -> float:
    return min(e["time"] for e in cluster.events() if e["event"] == "commit" and e["time"] > at) - at


@pytest.mark.parametrize("kind,object_store", [("partition", False), ("partition_keep_store", True),
                                               ("slow_link", False), ("lossy_link", False),
                                               ("store_brownout", True)])
def test_a_network_fault_on_two_nodes(kind, object_store, model, reference, fabric, tmp_path, clusters):
    cluster = clusters(str(tmp_path), model, JOB, max_nodes=2, collective_timeout=TIMEOUT, network=fabric,
                       object_store=object_store)
    cluster.add_node(), cluster.add_node()
    cluster.wait_commits(2, world_size=2)
    epoch, at = cluster.epoch(), time.time()
    print(f"\n{kind} on {inject(cluster, kind, random.Random(0), stop_s=HOLD)} for {HOLD} s")
    assert cluster.wait_progress(after_epoch=epoch if kind.startswith("partition") else -1, after_time=at)
    starts = finished_intact(cluster, reference)
    fault = figures([{"kind": kind, "time": at}], cluster.events())[0]
    print(f"{kind}: a newer epoch after {fault['detect_s']} s, work after {fault['recovery_s']} s, "
          f"layers lost {fault['lost_layers']}")
    if kind.startswith("partition"):  # the others went on without the node, which came back
        sizes = [e["world_size"] for e in starts]
        assert sizes[sizes.index(2):][:2] == [2, 1]


@pytest.mark.parametrize("object_store", [False, True], ids=["directory", "object-store"])
def test_a_node_cut_off_but_reaching_the_store_is_fenced_off(object_store, model, reference, fabric, tmp_path,
                                                             clusters):
    """The split brain: a node working alone (W=1 needs no peer) is cut off from the rendezvous but still reaches
    the state. Another node takes over in a newer epoch; the first one's next commit is refused, and after the
    cut heals it waits (the rendezvous is full) and leaves when the job is done."""
    cluster = clusters(str(tmp_path), model, JOB, max_nodes=1, collective_timeout=TIMEOUT, network=fabric,
                       object_store=object_store)
    isolated = cluster.add_node()
    cluster.wait_commits(2)
    isolated.host.cut(keep=[cluster.store_host.address] if object_store else [])
    isolated.stopped = True
    cluster.add_node()
    deadline = time.monotonic() + 300
    while not (refused := re.findall(r"fenced off: .*", open(isolated.log.name).read())):
        assert time.monotonic() < deadline and not cluster.done(), "the isolated worker was never refused"
        time.sleep(0.5)
    print(f"\nthe isolated node: {refused[0]}")
    assert re.match(r"fenced off: epoch (\d+) is stale \(epoch (\d+) has begun\): layer \d+ not committed",
                    refused[0])
    isolated.host.heal()
    isolated.stopped = False
    starts = finished_intact(cluster, reference)
    assert {e["world_size"] for e in starts} == {1} and len(starts) >= 2


@pytest.mark.etcd
def test_a_three_member_etcd_loses_its_leader_then_its_quorum(model, reference, fabric, tmp_path, clusters):
    """The rendezvous and the records in a three-member etcd cluster, each member a host of its own: the leader is
    killed mid-layer (and comes back), then two members are cut off for QUORUM_LOSS_S; the clients go from member
    to member, ride out the lost quorum within their retry budget, and the job finishes intact."""
    cluster = clusters(str(tmp_path), model, JOB, max_nodes=2, backend="etcd3", coordinator="auto",
                       collective_timeout=TIMEOUT, network=fabric)
    cluster.add_node(), cluster.add_node()
    cluster.wait_commits(2)
    at = time.time()
    print(f"\nkill_leader: {etcd_fault(cluster.etcd, 'kill_leader', hold_s=HOLD)}")
    assert cluster.wait_progress(after_time=at)
    print(f"first commit {first_commit_after(cluster, at):.1f} s after the leader was killed")
    cluster.wait_commits(cluster.commits() + 1)
    at = time.time()
    print(f"lose_quorum: {etcd_fault(cluster.etcd, 'lose_quorum', hold_s=HOLD)} and another, for {QUORUM_LOSS_S} s")
    assert not cluster.done()
    assert cluster.wait_progress(after_time=at)
    print(f"first commit {first_commit_after(cluster, at):.1f} s after the quorum was lost")
    finished_intact(cluster, reference)
    for node in cluster.nodes:  # no etcd call gave up while the quorum was lost (the agents' keep-alives too)
        log = open(node.log.name).read()
        assert "Traceback" not in log, log[log.index("Traceback"):][:3000]


@pytest.mark.usefixtures("fabric")  # skipped where namespaces cannot be made
def test_a_short_campaign(model, reference, tmp_path):
    """What CI runs of the campaign (the issue's, with 12 faults on a 48-layer model, takes minutes: the note has
    its table): three faults of a seeded schedule on the 16-layer model. The campaign compares with this module's
    uninterrupted run (one rank; the bits are the same at any world size) instead of running its own."""
    shutil.copytree(reference, tmp_path / "chaos" / "reference")
    kinds = "partition,partition_keep_store,slow_link,lossy_link,store_brownout,kill_node"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "chaos.py"), "--model", model, "--workdir",
                           str(tmp_path / "chaos"), "--network", "--faults", "3", "--seed", "1", "--kinds", kinds,
                           "--collective-timeout", str(TIMEOUT), "--report", "--", *map(str, JOB)],
                          capture_output=True, text=True, timeout=900)
    print("\n" + proc.stdout[-2500:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"^[23] faults, invariants hold$", proc.stdout, re.M)
