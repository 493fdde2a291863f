"""A fork server for the tests' command-line runs. Every `elastic-oneshot` process spends seconds importing torch,
transformers and compressed-tensors before it reads its first argument; the suite starts well over a hundred of them.
A zygote imports them once, then forks a child per run: the child is a real process of its own running `cli.entry`
with the run's arguments, environment, working directory and files for stdout and stderr, and its exit status is the
run's. Only the imports are shared. A zygote serves one environment (what torch and OpenMP read as they import), one
run at a time; runs.run_cli starts a plain interpreter for anything else.

Protocol, one JSON object per line: the client writes a request, the zygote answers {"pid"} once it forked and
{"status"} once the child ended; it exits when its stdin closes."""

import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

UNSHARED = {"PYTEST_CURRENT_TEST"}  # read by nobody at import time, different in every test


def key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in UNSHARED))


class Zygote:
    def __init__(self, env: dict):
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "elastic_oneshot.testing.zygote"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.buffer = b""

    def _line(self, deadline: float | None) -> dict | None:
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], wait)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the zygote ended (exit {self.proc.wait()})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], env: dict, cwd: str, timeout: float | None) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"argv": argv, "env": env, "cwd": cwd, "stdout": out, "stderr": err}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pid = self._line(None)["pid"]
            reply = self._line(None if timeout is None else time.monotonic() + timeout)
            if reply is None:
                os.kill(pid, signal.SIGKILL)
                self._line(None)
                raise subprocess.TimeoutExpired(argv, timeout, _read(out), _read(err))
            return subprocess.CompletedProcess(argv, reply["status"], _read(out), _read(err))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def _read(path: str) -> str:
    with open(path) as f:  # decoded as subprocess.run(text=True) decodes
        return f.read()


def serve() -> dict:
    """The zygote's loop; returns a request in each child it forks."""
    gc.disable()
    from elastic_oneshot.surface import api, cli  # noqa: F401  (what a run imports before its first step)
    gc.freeze()
    gc.enable()
    requests = sys.stdin.buffer
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        os.write(1, json.dumps({"pid": pid}).encode() + b"\n")
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        os.write(1, json.dumps({"status": status}).encode() + b"\n")
    sys.exit(0)


def become(request: dict):
    """In the child: the process a fresh `python -m elastic_oneshot ARGV` would be, short of its imports."""
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])


if __name__ == "__main__":
    child = serve()
    become(child)
    from elastic_oneshot.surface.cli import entry

    sys.argv = [os.path.join(os.path.dirname(os.path.dirname(__file__)), "__main__.py"), *child["argv"]]
    entry(child["argv"])
