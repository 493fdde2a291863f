"""The launchers in launch/: valid, carrying launch/env.sh's settings, and the simple ones run for real."""

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import yaml

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch")
SHELL = ["single_node.sh", "c10d.sh", "etcd3.sh", "slurm.sbatch"]
JOB = ["--num-samples", "8", "--seq-len", "64", "--chunk-size", "4", "--group-size", "64"]


def env_sh(name: str) -> str:
    """A setting's default in env.sh."""
    with open(os.path.join(LAUNCH, "env.sh")) as f:
        return re.search(rf'{name}="\$\{{{name}:-([^}}]*)\}}"', f.read()).group(1)


@pytest.mark.parametrize("name", SHELL)
def test_shell_launchers_parse_and_source_env(name):
    path = os.path.join(LAUNCH, name)
    subprocess.run(["bash", "-n", path], check=True)
    with open(path) as f:
        text = f.read()
    assert re.search(r'^source ".*/env\.sh"$', text, re.M), name
    assert "torchrun" in text and "-m elastic_oneshot run" in text


def test_slurm_requeues_and_gets_sigterm_early():
    with open(os.path.join(LAUNCH, "slurm.sbatch")) as f:
        directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", f.read(), re.M))
    assert "requeue" in directives and re.fullmatch(r"(B:)?TERM@\d+", directives["signal"])
    assert directives["ntasks-per-node"] == "1"  # one torchrun per node


def test_kubernetes_manifest():
    with open(os.path.join(LAUNCH, "k8s.yaml")) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    assert list(docs) == ["PersistentVolumeClaim", "Deployment", "Service", "PyTorchJob"]
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    job = docs["PyTorchJob"]["spec"]
    elastic = job["elasticPolicy"]
    assert 1 <= elastic["minReplicas"] <= elastic["maxReplicas"] == job["pytorchReplicaSpecs"]["Worker"]["replicas"]
    assert elastic["rdzvHost"] == docs["Service"]["metadata"]["name"]  # the store, off the spot nodes
    conf = {c["key"]: c["value"] for c in elastic["rdzvConf"]}
    assert conf == {"is_host": "false", **dict(kv.split("=") for kv in env_sh("RDZV_CONF").split(","))}
    assert elastic["maxRestarts"] == int(env_sh("MAX_RESTARTS"))
    pod = job["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    args = container["args"]
    assert args[args.index("--collective-timeout") + 1] == env_sh("ELASTIC_ONESHOT_COLLECTIVE_TIMEOUT")
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]


def launcher_env(**extra) -> dict:
    return {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            **extra}


@pytest.mark.slow
def test_single_node_launcher_runs(tiny_llama, tmp_path):
    proc = subprocess.run([os.path.join(LAUNCH, "single_node.sh"), "--model", tiny_llama, "--output", tmp_path / "out",
                           *JOB], env=launcher_env(NPROC="2"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 2" in proc.stderr
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.slow
def test_c10d_launcher_runs_against_the_standalone_store(tiny_llama, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = subprocess.Popen([sys.executable, os.path.join(LAUNCH, "store.py"), "--host", "127.0.0.1",
                              "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert "serving" in store.stdout.readline()
        t = time.monotonic()
        proc = subprocess.run([os.path.join(LAUNCH, "c10d.sh"), "--model", tiny_llama, "--output", tmp_path / "out",
                               *JOB], env=launcher_env(STORE=f"127.0.0.1:{port}", JOB_ID="test", MIN="1", MAX="1"),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (tmp_path / "out" / "config.json").is_file()
        print(f"\nc10d.sh with the standalone store: {time.monotonic() - t:.1f} s")
    finally:
        store.kill()
        store.wait()


def test_multi_node_launchers_require_a_shared_job_id(tmp_path):
    env = launcher_env(STORE="127.0.0.1:1")
    env.pop("JOB_ID", None)
    proc = subprocess.run([os.path.join(LAUNCH, "c10d.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "JOB_ID" in proc.stderr
