"""--metrics-port: Prometheus metrics from every rank, scraped over HTTP from a real run under torchrun (and from the
module alone); a busy port; no port without the flag; the alert rules and the Kubernetes manifests that use them."""

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from elastic_oneshot import metrics
from elastic_oneshot.durability.state import StateStore, read_events
from elastic_oneshot.errors import UsageError
from elastic_oneshot.testing.runs import one_thread_env, run_cli, torchrun_cmd, workers
from elastic_oneshot.testing.tiny import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = os.path.join(ROOT, "launch", "alerts.rules.yml")
JOB = ["--num-samples", 96, "--seq-len", 256, "--chunk-size", 8, "--group-size", 64]


def free_ports(count: int) -> int:
    """A port P such that P .. P + count - 1 are free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + count < 65536 and all(_free(base + i) for i in range(1, count)):
            return base
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def scrape(port: int) -> dict[str, list]:
    """/metrics at `port`, parsed by prometheus_client: samples by name, as (labels, value)."""
    out = {}
    for family in text_string_to_metric_families(fetch(port)):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(samples: dict, name: str, **labels) -> float:
    (found,) = [v for lab, v in samples[f"elastic_oneshot_{name}"] if labels.items() <= lab.items()]
    return found


def served(worker: psutil.Process) -> set[int]:
    """The ports `worker` listens on for every interface, but its process group's store (rank 0 hosts it on
    MASTER_PORT); gloo listens on the host's own address."""
    wildcard = {c.laddr.port for c in worker.net_connections("inet") if c.status == psutil.CONN_LISTEN
                and c.laddr.ip in ("0.0.0.0", "::")}
    return wildcard - {int(worker.environ()["MASTER_PORT"])}


# -- the module alone ------------------------------------------------------------------------------------------------
def test_served_metrics_parse_and_follow_the_hooks(monkeypatch):
    monkeypatch.setattr(metrics, "_on", False)
    monkeypatch.setattr(metrics, "_values", {name: {} for name in metrics.METRICS})
    monkeypatch.setattr(metrics, "_labels", {**metrics._labels, "rank": "3"})
    metrics.committed({"gptq": 1.0}, {0: 1}, [])  # off: nothing is kept
    assert not any(metrics._values.values())
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        with pytest.raises(UsageError, match=rf"cannot serve metrics on port {busy.getsockname()[1]} of .*: "
                                             "Address already in use; choose a free port"):
            metrics.serve(busy.getsockname()[1])
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(metrics.PORT_ENV, "x")
    with pytest.raises(UsageError, match="ELASTIC_ONESHOT_METRICS_PORT=x: expected a port number"):
        metrics.serve()
    port = free_ports(2)
    monkeypatch.setenv(metrics.PORT_ENV, str(port))
    metrics.serve()  # on PORT + LOCAL_RANK
    metrics.job("ab" * 32)
    metrics.epoch_began(2, 4, 10, {0: 1, 1: 1, 2: 2}, [2])
    metrics.committed({"load": 0.5, "gptq": 2.0, "commit": 0.25}, {0: 1, 1: 1, 2: 2, 3: 2, 5: 2}, [2, 4])
    for n in (100, 20):
        metrics.bytes_written("s3://b/p", n)
    metrics.bytes_read("s3://b/p", 7)
    metrics.retried("etcd")
    metrics.silence(1, 1.5)
    samples = scrape(port + 1)
    base = {"job_id": "abababababababab", "rank": "3", "node": socket.gethostname(), "epoch": "2"}
    assert value(samples, "epoch") == 2 and value(samples, "world_size") == 4 and value(samples, "layers") == 10
    assert all(labels.items() >= base.items() for name in samples for labels, _ in samples[name])
    assert value(samples, "commits_total") == 1 and value(samples, "layers_committed") == 5
    assert value(samples, "durable_boundary") == 4 and value(samples, "replay_layers") == 0  # layer 4 is next
    assert value(samples, "layer_phase_seconds", phase="gptq") == 2.0
    assert value(samples, "storage_wait_seconds_total") == 0.25
    assert value(samples, "storage_written_bytes_total", store="s3://b/p") == 120
    assert value(samples, "storage_read_bytes_total", store="s3://b/p") == 7
    assert value(samples, "retries_total", service="etcd") == 1
    assert value(samples, "peer_silence_seconds", peer="1") == 1.5
    assert abs(value(samples, "last_commit_timestamp_seconds") - time.time()) < 60
    assert exported_names() - {"elastic_oneshot_restarts", "elastic_oneshot_lost_seconds"} == set(samples)


# -- alerts and manifests --------------------------------------------------------------------------------------------
def exported_names() -> set[str]:
    return {f"elastic_oneshot_{name}" + ("_total" if kind == "counter" else "")
            for name, (kind, _, _) in metrics.METRICS.items()}


def test_alert_rules_name_only_exported_metrics():
    with open(RULES) as f:
        rules = [r for group in yaml.safe_load(f)["groups"] for r in group["rules"]]
    assert [r["alert"] for r in rules] == ["ElasticOneshotNoCommit", "ElasticOneshotRestarting",
                                           "ElasticOneshotStorageWait"]
    for rule in rules:
        named = set(re.findall(r"\belastic_oneshot_\w+", rule["expr"]))
        assert named and named <= exported_names(), rule["alert"]
        assert "job_id" in rule["expr"]  # every series of a job, across its epochs


@pytest.mark.skipif(shutil.which("promtool") is None and not os.environ.get("CI"),
                    reason="promtool (Debian's prometheus package; .ci/run unpacks it) is not installed")
def test_promtool_accepts_the_rules_and_each_alert_fires_when_it_should():
    subprocess.run(["promtool", "check", "rules", RULES], check=True, capture_output=True)
    proc = subprocess.run(["promtool", "test", "rules", os.path.join(ROOT, "tests", "alerts.test.yml")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("manifest", ["k8s.yaml", "k8s-object-store.yaml"])
def test_kubernetes_workers_serve_metrics_where_the_annotations_say(manifest):
    with open(os.path.join(ROOT, "launch", manifest)) as f:
        job = next(d for d in yaml.safe_load_all(f) if d["kind"] == "PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    (container,) = pod["spec"]["containers"]
    port = {e["name"]: e["value"] for e in container["env"]}[metrics.PORT_ENV]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == port
    assert {"name": "metrics", "containerPort": int(port)} in container["ports"]


# -- real runs -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama16(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama16"), "llama", num_hidden_layers=16)


def commit_events(state, epoch: int) -> list[dict]:
    return [e for e in read_events(str(state)) if e["event"] == "commit" and e["epoch"] == epoch]


def settled(launcher, state, port: int, epoch: int, timeout: float = 120) -> dict:
    """Both ranks' metrics in `epoch` at a moment when their commits counters have moved and agree with the commit
    events before and after the scrape (no commit landed meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the job ended before it could be scraped"
        before = len(commit_events(state, epoch))
        try:
            ranks = [scrape(port), scrape(port + 1)]
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)  # not serving yet (starting, or restarting)
            continue
        after = len(commit_events(state, epoch))
        if all(r.get("elastic_oneshot_commits_total") and value(r, "epoch") == epoch
               and value(r, "commits_total") == before for r in ranks) and before == after:
            return ranks
        time.sleep(0.05)
    raise AssertionError(f"no settled scrape of epoch {epoch}")


def check_counters(ranks: list[dict], state, epoch: int, job_id: str):
    """Every rank's metrics agree with the events and the files of `epoch`."""
    commits = commit_events(state, epoch)
    for rank, samples in enumerate(ranks):
        labels = {"job_id": job_id, "rank": str(rank), "node": socket.gethostname(), "epoch": str(epoch)}
        assert all(lab.items() >= labels.items() for name in samples for lab, _ in samples[name])
        assert value(samples, "epoch") == epoch and value(samples, "world_size") == 2
        assert value(samples, "commits_total") == len(commits)  # every rank commits every layer with rank 0
        assert value(samples, "layers_committed") == commits[-1]["layer"] + 1 and value(samples, "layers") == 16
        phases = {lab["phase"]: v for lab, v in samples["elastic_oneshot_layer_phase_seconds"]}
        assert set(phases) == {"load", "calibrate", "hessian", "gptq", "propagate", "commit"}
        if rank == 0:
            assert phases == pytest.approx(commits[-1]["seconds"])  # the last commit's, as its event says
        own = sum(os.path.getsize(os.path.join(state, "layers", f"{e['layer']:05d}", name)) for e in commits
                  for name in os.listdir(os.path.join(state, "layers", f"{e['layer']:05d}"))
                  if name.startswith(f"e{epoch:05d}.r{rank}."))
        written = value(samples, "storage_written_bytes_total", store=str(state))
        assert written >= own and written > 0  # at least the solved groups it wrote of the layers committed
        assert value(samples, "peer_silence_seconds", peer=str(1 - rank)) < 60  # the watchdog's bound


@pytest.mark.slow
@pytest.mark.distributed
def test_scraped_during_a_run_under_torchrun_and_across_a_killed_worker(llama16, tmp_path):
    state, port = tmp_path / "state", free_ports(2)
    args = ["run", "--model", llama16, "--state", state, "--output", tmp_path / "out", *JOB, "--metrics-port", port]
    with open(tmp_path / "torchrun.log", "w") as log:
        launcher = subprocess.Popen(torchrun_cmd(2, *args, max_restarts=1), stdout=log, stderr=subprocess.STDOUT,
                                    env=one_thread_env())
        try:
            first = settled(launcher, state, port, epoch=1)
            job_id = StateStore(str(state)).job()["fingerprint"][:16]
            check_counters(first, state, 1, job_id)
            assert value(first[0], "restarts") == 0 and "elastic_oneshot_restarts" not in first[1]  # rank 0's
            assert {r: served(w) for r, w in workers(launcher).items()} == {0: {port}, 1: {port + 1}}
            later = settled(launcher, state, port, epoch=1)  # after at least one more layer
            while value(later[0], "commits_total") == value(first[0], "commits_total"):
                later = settled(launcher, state, port, epoch=1)
            check_counters(later, state, 1, job_id)
            assert value(later[0], "storage_written_bytes_total", store=str(state)) > \
                value(first[0], "storage_written_bytes_total", store=str(state))
            shown = ("elastic_oneshot_commits_total", "elastic_oneshot_epoch", "elastic_oneshot_storage_written")
            print("\n" + "\n".join(line for line in fetch(port).splitlines() if line.startswith(shown)))

            workers(launcher)[1].send_signal(signal.SIGKILL)  # torchrun restarts both workers: epoch 2
            second = settled(launcher, state, port, epoch=2)
            check_counters(second, state, 2, job_id)
            assert value(second[0], "restarts") == 1 and value(second[0], "lost_seconds") > 0
            assert value(second[0], "storage_read_bytes_total", store=str(state)) > 0  # the restart read its state
            assert launcher.wait(timeout=300) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
        finally:
            launcher.kill()
            launcher.wait()
    for p in (port, port + 1):  # the servers ended with their workers
        with pytest.raises(urllib.error.URLError):
            scrape(p)


@pytest.mark.slow
@pytest.mark.distributed
def test_no_port_is_opened_without_the_flag(tiny_llama, tmp_path):
    env = {k: v for k, v in one_thread_env().items() if k != metrics.PORT_ENV}
    args = ["run", "--model", tiny_llama, "--output", tmp_path / "out", *JOB]
    launcher = subprocess.Popen(torchrun_cmd(2, *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    checked = set()
    try:
        while launcher.poll() is None:
            for rank, worker in workers(launcher).items():
                try:
                    listening = [c for c in worker.net_connections("inet") if c.status == psutil.CONN_LISTEN]
                    if any(c.laddr.ip not in ("0.0.0.0", "::") for c in listening):  # gloo is up: so would be metrics
                        assert served(worker) == set(), rank
                        checked.add(rank)
                except psutil.Error:
                    pass  # it just ended
            time.sleep(0.05)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 0 and checked == {0, 1}


@pytest.mark.slow
def test_a_busy_port_ends_the_run_before_any_work(tiny_llama, tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli("run", "--model", tiny_llama, "--output", tmp_path / "out", *JOB, check=False,
                       env={**os.environ, metrics.PORT_ENV: str(port)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"elastic-oneshot: error: cannot serve metrics on port {port} of "
                                   f"{socket.gethostname()} ({metrics.PORT_ENV} {port} + local rank 0): Address "
                                   "already in use; choose a free port")
    assert not (tmp_path / "out.state").exists()
