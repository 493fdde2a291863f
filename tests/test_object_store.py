"""The state on object storage (`--state s3://bucket/prefix`), against a real S3-compatible server on 127.0.0.1
(moto in server mode, a subprocess stopped by its PID), spoken to over HTTP by the product's own client."""

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time

import obstore
import pytest

from elastic_oneshot import oneshot
from elastic_oneshot.durability.records import FileRecords
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.durability.storage import ObjectStorage, is_transient, is_url
from elastic_oneshot.errors import StaleEpochError, StorageError, UsageError
from elastic_oneshot.loop.runner import COMMITS_BEHIND
from elastic_oneshot.testing.netns import Namespace, NamespaceUnavailable
from elastic_oneshot.testing.runs import run_cli, start_cli, tree_digest
from elastic_oneshot.testing.s3_server import S3Server
from elastic_oneshot.testing.tiny import make_model

pytest.importorskip("moto.server")

JOB = dict(num_calibration_samples=16, max_seq_length=64, group_size=64, chunk_size=4)
CLI_JOB = ["--num-samples", 16, "--seq-len", 64, "--chunk-size", 4, "--group-size", 64]
BUCKET = "elastic-oneshot"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server with its bucket, and the environment that points the product at it (what a user sets)."""
    with S3Server(BUCKET) as server:
        saved = {k: os.environ.get(k) for k in server.env}
        os.environ.update(server.env)
        try:
            yield server.endpoint
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama4"), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(llama4, tmp_path_factory):
    """A run with a local state directory: the bytes every object-store run must reproduce."""
    out = str(tmp_path_factory.mktemp("ref") / "out")
    oneshot(model=llama4, output_dir=out, **JOB)
    return tree_digest(out)


@pytest.mark.slow
@pytest.mark.s3
def test_urls_name_object_stores():
    assert is_url("s3://b/p") and is_url("gs://b") and is_url("file:///x") and not is_url("/tmp/s3:/x")


@pytest.mark.slow
@pytest.mark.s3
def test_the_checkpoint_is_the_same_with_the_state_on_the_server(s3, llama4, reference, tmp_path):
    url = f"s3://{BUCKET}/same"
    out = str(tmp_path / "out")
    oneshot(model=llama4, output_dir=out, state_dir=url, boundary_every=2, **JOB)
    assert tree_digest(out) == reference
    state = StateStore(url)
    assert sorted(state.names("commits")) == [f"0000{i}.e00001.json" for i in range(4)]
    assert state.names("") and "events.jsonl" not in state.names("")  # events are objects of their own there
    assert [e["event"] for e in state.events()][:2] == ["start", "layer"]
    report = json.loads(run_cli("status", "--state", url, "--json").stdout)
    assert report["layers_done"] == 4 and report["complete"]
    resumed = tmp_path / "again"
    run_cli("export", "--state", url, "--output", resumed)
    assert tree_digest(resumed) == reference


@pytest.mark.slow
@pytest.mark.s3
def test_behind_a_shaped_link_commits_are_written_behind(llama4, reference, tmp_path, monkeypatch):
    """The server in a network namespace of its own behind a 4 Mbit/s token-bucket link each way (a real link:
    concurrent uploads share it): every layer's commit lands while the next layer computes, in order, and the
    checkpoint is the same."""
    with contextlib.ExitStack() as stack:
        try:
            link = stack.enter_context(Namespace(mbit=4))
        except NamespaceUnavailable as e:
            pytest.skip(str(e))
        server = stack.enter_context(S3Server(namespace=link))
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        url = f"s3://{server.bucket}/shaped"
        oneshot(model=llama4, output_dir=str(tmp_path / "out"), state_dir=url, **JOB)
        events = [(e["event"], e["layer"]) for e in StateStore(url).events() if e["event"] in ("layer", "commit")]
    assert [layer for event, layer in events if event == "commit"] == [0, 1, 2, 3]
    assert all(events.index(("layer", n + 1)) < events.index(("commit", n)) for n in range(3))
    assert tree_digest(str(tmp_path / "out")) == reference


def committed(url: str) -> int:
    return len(StateStore(url).names("commits"))


@pytest.mark.slow
@pytest.mark.s3
def test_kill_9_at_random_moments_with_the_state_on_the_server(s3, llama4, reference, tmp_path):
    rng, url, out = random.Random(13), f"s3://{BUCKET}/killed", tmp_path / "out"
    cmd = ["run", "--model", llama4, "--output", out, "--state", url, *CLI_JOB, "--boundary-every", 2]
    kills, progress = 0, []
    while kills < 3:
        with open(tmp_path / f"run{kills}.log", "w") as log:
            proc = start_cli(*cmd, stderr=log, stdout=log)
        while committed(url) <= (progress[-1] if progress else 0) and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.3))
        if proc.poll() is not None:
            break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        progress.append(committed(url))
    assert kills >= 2, f"the job finished before it could be killed enough ({kills} kills)"
    events = StateStore(url).events()
    for epoch in {e["epoch"] for e in events if e["event"] == "layer"}:
        started = {e["layer"] for e in events if e["event"] == "layer" and e["epoch"] == epoch}
        done = {e["layer"] for e in events if e["event"] == "commit" and e["epoch"] == epoch}
        assert len(started - done) <= 1 + COMMITS_BEHIND, f"epoch {epoch} lost {sorted(started - done)}"
    final = run_cli("run", "--model", llama4, "--output", out, "--state", url, *CLI_JOB, "--boundary-every", 2)
    assert "resuming" in final.stderr
    assert tree_digest(out) == reference


@pytest.mark.slow
@pytest.mark.s3
def test_a_stale_worker_is_refused_by_the_servers_precondition(s3):
    state = StateStore(f"s3://{BUCKET}/stale")
    r = FileRecords(state)
    e1 = r.begin_epoch({})
    r.commit(0, e1, {"layer": 0})
    with pytest.raises(StaleEpochError, match=f"layer 0 was already committed in epoch {e1}"):
        r.commit(0, e1, {"layer": 0, "again": True})  # the server's If-None-Match refuses the second
    stale = FileRecords(state)
    stale.epochs = lambda: [e1 - 1] if e1 > 1 else []  # a worker that has not seen epoch e1 (a stale list)
    with pytest.raises(StaleEpochError, match=f"epoch {e1} was begun by another process"):
        stale.begin_epoch({})
    e2 = r.begin_epoch(r.committed())
    with pytest.raises(StaleEpochError, match=f"epoch {e1} is stale"):
        FileRecords(state).commit(1, e1, {"layer": 1})
    state.write_json(FileRecords.commit_path(1, e1), {"layer": 1}, exclusive=True)  # slipped in after e2's fence
    assert r.committed() == {0: e1} and r.current_epoch() == e2


@pytest.mark.slow
@pytest.mark.s3
def test_transient_errors_are_retried_and_others_are_not(s3, monkeypatch, caplog):
    import obstore

    store = ObjectStorage(f"s3://{BUCKET}/retry")
    real, calls = obstore.put, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) < 3:
            raise obstore.exceptions.GenericError("Generic S3 error: Server returned non-2xx status code: "
                                                  "503 Service Unavailable: SlowDown")
        return real(*args, **kwargs)

    monkeypatch.setattr(obstore, "put", flaky)
    store.put("x.json", b"{}", exclusive=True)
    assert len(calls) == 3 and store.get("x.json") == b"{}"
    assert "retrying" in caplog.text
    assert not is_transient(obstore.exceptions.GenericError("Generic S3 error: 403 Forbidden"))
    with pytest.raises(FileExistsError):
        store.put("x.json", b"{}", exclusive=True)


@pytest.mark.slow
@pytest.mark.s3
def test_a_missing_bucket_is_a_storage_error(s3):
    from elastic_oneshot.errors import StorageError

    with pytest.raises(StorageError, match="cannot write s3://no-such-bucket/p/job.json"):
        StateStore("s3://no-such-bucket/p").write_bytes("job.json", b"{}")


class FaultyProxy:
    """An HTTP proxy between the product and the server, one request per connection: it answers 503 SlowDown
    to every `every`-th request, drops every `every`-th + 1 (closes the connection before forwarding it), and
    delays every `every`-th + 2. A faulty request never reaches the server, so its retry is always safe."""

    def __init__(self, upstream: str, every: int = 5):
        import threading

        self.upstream, self.every, self.count, self.faults = upstream, every, 0, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import threading

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(client,), daemon=True).start()

    def _one(self, client: socket.socket):
        with client:
            request = _read_request(client)
            with self.lock:
                self.count += 1
                n = self.count % self.every
                self.faults += n in (0, 1)
            if request is None or n == 1:
                return
            if n == 0:
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            if n == 2:
                time.sleep(0.3)
            host, port = self.upstream.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port))) as server:
                server.sendall(request)
                while data := server.recv(1 << 16):
                    client.sendall(data)


def _read_request(sock: socket.socket) -> bytes | None:
    """One HTTP request with its body (Content-Length), rewritten to close the connection after the response."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    length = next((int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += sock.recv(1 << 16)
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


@pytest.mark.slow
@pytest.mark.s3
def test_the_job_finishes_through_503s_drops_and_delays(s3, llama4, reference, tmp_path, monkeypatch, caplog):
    proxy = FaultyProxy(s3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    out = str(tmp_path / "out")
    oneshot(model=llama4, output_dir=out, state_dir=f"s3://{BUCKET}/faulty", boundary_every=2, **JOB)
    assert tree_digest(out) == reference
    assert proxy.faults > 10 and caplog.text.count("object store: retrying") >= proxy.faults


@pytest.mark.slow
@pytest.mark.s3
def test_large_objects_go_in_parallel_parts(s3):
    store = ObjectStorage(f"s3://{BUCKET}/large")
    data = random.Random(0).randbytes(20 << 20)
    start = time.perf_counter()
    store.put("big.safetensors", data)
    up = time.perf_counter() - start
    start = time.perf_counter()
    assert store.get("big.safetensors", len(data)) == data
    down = time.perf_counter() - start
    print(f"\n20 MiB to the local server: up {20 / up:.0f} MiB/s, down {20 / down:.0f} MiB/s")
    assert store.get("big.safetensors", len(data) + 1) == data  # a wrong size is read whole, and judged by its reader
    assert store.get("absent.safetensors", len(data)) is None


@pytest.fixture(scope="module")
def w1_reference(llama4, tmp_path_factory):
    """The W=1 run on one thread per rank, as the nodes run."""
    from elastic_oneshot.testing.runs import one_thread_env

    out = tmp_path_factory.mktemp("w1") / "out"
    run_cli("run", "--model", llama4, "--output", out, *CLI_JOB, env=one_thread_env())
    return tree_digest(out)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
@pytest.mark.parametrize("rank0", [False, True], ids=["other-node", "rank0-node"])
def test_two_nodes_one_killed_the_survivor_finishes(s3, llama4, w1_reference, tmp_path, rank0):
    """Two torchrun agents (simulated nodes) with the state on the server and no shared directory; one node is
    killed, either one: the rendezvous store runs apart from the agents (launch/store.py), so losing rank 0's
    node loses the workers' process group but not the rendezvous. The survivor finishes at world size 1, byte for
    byte the W=1 run, and writes the checkpoint as the new rank 0."""
    from launch.chaos import Cluster

    cluster = Cluster(str(tmp_path / "cluster"), llama4, [*CLI_JOB, "--boundary-every", 2], max_nodes=2,
                      collective_timeout=10, state_url=f"s3://{BUCKET}/nodes-{int(rank0)}")
    try:
        nodes = [cluster.add_node(), cluster.add_node()]
        cluster.wait_commits(1, world_size=2)
        victim = next(n for n in nodes if (0 in n.workers()) == rank0)
        victim.signal_all(signal.SIGKILL)
        assert cluster.wait_done(timeout=300), "the job did not finish"
    finally:
        cluster.close()
    worlds = [e["world_size"] for e in cluster.events() if e["event"] == "start"]
    print(f"\nworld sizes {worlds}")
    assert worlds[-1] == 1  # (after an epoch of 2 that committed: wait_commits)
    assert tree_digest(cluster.output) == w1_reference


@pytest.mark.slow
@pytest.mark.s3
def test_an_unreachable_store_fails_after_the_retry_budget(s3, monkeypatch, caplog):
    monkeypatch.setenv("AWS_ENDPOINT_URL", S3Server().endpoint)  # a free port, where nothing listens
    store = ObjectStorage(f"s3://{BUCKET}/gone", retry_s=1)
    start = time.monotonic()
    with pytest.raises(OSError, match="error sending request") as failed:
        store.get("job.json")
    assert 1 <= time.monotonic() - start < 5 and failed.value.filename == f"s3://{BUCKET}/gone/job.json"
    assert "object store: retrying get job.json" in caplog.text


def test_kubernetes_manifest_without_a_shared_volume():
    import yaml

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch",
                           "k8s-object-store.yaml")) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    assert list(docs) == ["Deployment", "Service", "PyTorchJob"]
    pod = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert is_url(args[args.index("--state") + 1]) and not any("persistentVolumeClaim" in v for v in pod["volumes"])
    assert not any("AWS_SECRET" in str(e) for e in container["env"])  # credentials only through the Secret


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
def test_chaos_campaign_with_the_state_on_the_server(s3, tmp_path):
    model = make_model(str(tmp_path / "llama32"), "llama", num_hidden_layers=32)  # enough work for four faults
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "launch", "chaos.py"), "--model", model,
                           "--workdir", str(tmp_path / "chaos"), "--faults", "4", "--seed", "5",
                           "--kinds", "kill_node,kill_worker,corrupt_file,add_node", "--collective-timeout", "10",
                           "--state-url", f"s3://{BUCKET}/chaos", "--", *map(str, CLI_JOB), "--boundary-every", "3"],
                          capture_output=True, text=True, timeout=900)
    print("\n" + proc.stdout[-2500:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "4 faults, invariants hold" in proc.stdout


def leaks(secret: str) -> list[bytes]:
    """Every 8 characters in a row of `secret`: any of them found counts as the secret found."""
    return [secret[i:i + 8].encode() for i in range(len(secret) - 7)]


def scan(url: str, secrets: list[bytes]) -> int:
    """How many objects under `url` were read; AssertionError if one holds any of `secrets`."""
    store = ObjectStorage(url)
    paths = [o["path"] for batch in obstore.list(store.store) for o in batch]
    for path in paths:
        data = store.get(path)
        assert not any(s in data for s in secrets), f"{path} holds a credential"
    return len(paths)


@pytest.fixture
def aws_home(tmp_path, monkeypatch):
    """A server that checks signatures, and a HOME whose ~/.aws files alone say how to reach it: profile 'eo'
    with its keys, region and endpoint; nothing in the environment but AWS_PROFILE (and AWS_ALLOW_HTTP)."""
    with S3Server(BUCKET, auth=True) as server:
        key, secret = server.env["AWS_ACCESS_KEY_ID"], server.env["AWS_SECRET_ACCESS_KEY"]
        (tmp_path / ".aws").mkdir()
        (tmp_path / ".aws" / "credentials").write_text(
            f"[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n"
            f"[eo]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
        (tmp_path / ".aws" / "config").write_text(f"[default]\nendpoint_url = {server.endpoint}\n\n"
                                                  f"[profile eo]\nregion = us-east-1\n"
                                                  f"endpoint_url = {server.endpoint}\n")
        for name in list(os.environ):
            if name.startswith("AWS_") and name != "AWS_ALLOW_HTTP":
                monkeypatch.delenv(name)
        monkeypatch.setenv("HOME", str(tmp_path))
        monkeypatch.setenv("AWS_PROFILE", "eo")
        yield key, secret, server.log.name


@pytest.mark.slow
@pytest.mark.s3
def test_credentials_from_a_profile_file_never_reach_the_state(aws_home, llama4, reference, tmp_path, monkeypatch,
                                                                caplog, capfd):
    """The profile file's keys sign every request of the run: the server checks each signature, and its log shows
    the profile's access key in each request's Authorization header. Nothing of the secret (no 8 characters of it
    in a row) is in the state (its events included), the output, the run's logs or what it printed."""
    key, secret, server_log = aws_home
    caplog.set_level(logging.DEBUG, "elastic_oneshot")
    with open(server_log) as f:
        before = len(f.readlines())  # the bucket, and the access key issued
    url, out = f"s3://{BUCKET}/profile", str(tmp_path / "out")
    oneshot(model=llama4, output_dir=out, state_dir=url, **JOB)
    assert tree_digest(out) == reference
    with open(server_log) as f:
        requests = [line for line in f.readlines()[before:] if " Authorization: " in line]
    unsigned = [r for r in requests if f"Authorization: AWS4-HMAC-SHA256 Credential={key}/" not in r]
    assert len(requests) > 20 and not unsigned, unsigned
    secret_pieces = leaks(secret)
    assert scan(url, [key.encode(), *secret_pieces]) > 10
    written = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files]
    for path in written:
        with open(path, "rb") as f:
            data = f.read()
        assert not any(s in data for s in secret_pieces), f"{path} holds the secret"
    printed = capfd.readouterr()
    assert caplog.records and not any(s.decode() in caplog.text + printed.out + printed.err for s in secret_pieces)
    monkeypatch.setenv("AWS_PROFILE", "default")  # the server checks signatures: the wrong key is refused
    with pytest.raises(StorageError, match="403 Forbidden"):
        ObjectStorage(url).put("x.json", b"{}")
    monkeypatch.setenv("AWS_PROFILE", "nowhere")
    with pytest.raises(UsageError, match="nowhere"):
        ObjectStorage(url)


def download(url: str, to) -> str:
    store = ObjectStorage(url)
    os.makedirs(to)
    for name in store.names(""):
        with open(os.path.join(to, name), "wb") as f:
            f.write(store.get(name))
    return str(to)


@pytest.mark.slow
@pytest.mark.s3
def test_export_to_the_server_all_or_nothing(s3, llama4, reference, tmp_path, monkeypatch):
    """A run whose --output is a prefix: the checkpoint there equals a local export byte for byte and loads in
    transformers; the marker goes up last (a failed upload leaves none, and the next export finishes it); a
    prefix holding what this job did not write is refused and left as it was."""
    import transformers

    from elastic_oneshot.durability.coordinator import open_records
    from elastic_oneshot.durability.destination import MARKER, PENDING, open_destination
    from elastic_oneshot.surface.export import export

    state_url, out_url = f"s3://{BUCKET}/export.state", f"s3://{BUCKET}/export"
    oneshot(model=llama4, output_dir=out_url, state_dir=state_url, **JOB)
    assert tree_digest(download(out_url, tmp_path / "a")) == reference
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert type(model).__name__ == "LlamaForCausalLM"

    state, out = StateStore(state_url), ObjectStorage(out_url)
    real, uploaded = ObjectStorage.upload, []

    def failing(self, rel, path):
        if uploaded:
            raise StorageError(self.where(rel), OSError(5, "connection lost"))
        uploaded.append(rel)
        real(self, rel, path)

    monkeypatch.setattr(ObjectStorage, "upload", failing)
    with pytest.raises(StorageError, match="connection lost"):
        export(state, open_records(state), open_destination(out_url))
    assert MARKER not in out.names("") and PENDING in out.names("")  # a reader sees it incomplete
    monkeypatch.undo()
    run_cli("export", "--state", state_url, "--output", out_url)
    assert MARKER in out.names("") and PENDING not in out.names("")
    assert tree_digest(download(out_url, tmp_path / "b")) == reference

    out.put("notes.txt", b"mine")
    refused = run_cli("export", "--state", state_url, "--output", out_url, check=False)
    assert refused.returncode == 2 and "files this tool did not write (notes.txt)" in refused.stderr
    assert out.get("notes.txt") == b"mine" and MARKER in out.names("")
    other = ObjectStorage(f"s3://{BUCKET}/someone-else")
    other.put("model.safetensors", b"theirs")
    refused = run_cli("export", "--state", state_url, "--output", other.root, check=False)
    assert refused.returncode == 2 and "is not this job's checkpoint" in refused.stderr
    assert other.names("") == ["model.safetensors"]
    refused = run_cli("export", "--state", state_url, "--output", f"{state_url}/out", check=False)
    assert "overlap" in refused.stderr


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["directory", "prefix"])
def test_one_destination_rule_for_a_directory_and_a_prefix(kind, s3, tmp_path):
    """The same cases against a local directory and a prefix on the server: a publish replaces this job's previous
    files (and drops one it no longer writes), the marker lists exactly what is there, and a file this tool did not
    write or another job's output is refused and left as it was."""
    from elastic_oneshot.durability.destination import MARKER, listed, open_destination, write_marker

    where = str(tmp_path / "out") if kind == "directory" else f"s3://{BUCKET}/dest-{tmp_path.name}"
    files = (lambda: sorted(os.listdir(where))) if kind == "directory" else (
        lambda: sorted(ObjectStorage(where).names("")))
    read = (lambda name: (tmp_path / "out" / name).read_bytes()) if kind == "directory" else ObjectStorage(where).get

    def publish(fingerprint: str, contents: dict[str, bytes]):
        destination = open_destination(where)
        destination.check(fingerprint, str(tmp_path / "state"))
        destination.claim(fingerprint)
        with destination.building(fingerprint) as built:
            os.makedirs(built, exist_ok=True)
            for name, data in contents.items():
                (tmp_path / built / name).write_bytes(data)
            write_marker(built, fingerprint, sorted(contents))
            destination.publish(built, fingerprint)

    publish("job-a", {"model.safetensors": b"1", "old.json": b"{}"})
    publish("job-a", {"model.safetensors": b"2"})
    assert files() == [MARKER, "model.safetensors"] and read("model.safetensors") == b"2"
    assert listed(read(MARKER), "job-a") == ["model.safetensors"] and listed(read(MARKER), "job-b") is None
    with pytest.raises(UsageError, match="is not this job's checkpoint"):
        publish("job-b", {"model.safetensors": b"3"})
    if kind == "directory":
        (tmp_path / "out" / "notes.txt").write_bytes(b"mine")
    else:
        ObjectStorage(where).put("notes.txt", b"mine")
    with pytest.raises(UsageError, match=r"holds files this tool did not write \(notes.txt\)"):
        publish("job-a", {"model.safetensors": b"4"})
    assert files() == [MARKER, "model.safetensors", "notes.txt"] and read("model.safetensors") == b"2"
