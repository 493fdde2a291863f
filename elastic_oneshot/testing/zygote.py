"""A fork server for the tests' command-line runs. Every `elastic-oneshot` process spends seconds importing torch,
transformers and compressed-tensors before it reads its first argument; the suite starts well over a hundred of them.
A zygote imports them once, then forks a child per run: the child is a real process of its own running `cli.entry`
with the run's arguments, environment, working directory and stdin, stdout and stderr (passed as descriptors), and its
exit status is the run's. Only the imports are shared. A zygote serves one environment (what torch and OpenMP read as
they import) and one run at a time; runs.start_cli starts a plain interpreter for anything else.

Protocol, on a SOCK_SEQPACKET pair: the client sends a request (JSON, and the child's three descriptors); the zygote
answers {"pid"} once it forked and {"status"} once the child ended. It exits when the client's end closes."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

UNSHARED = {"PYTEST_CURRENT_TEST"}  # read by nobody at import time, different in every test
MESSAGE = 1 << 20


def key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in UNSHARED))


class Zygote:
    def __init__(self, env: dict):
        self.lock = threading.Lock()  # held from a child's start until its status is read
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "elastic_oneshot.testing.zygote", str(theirs.fileno())],
                                     env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        theirs.close()

    def start(self, argv: list[str], env: dict, cwd: str, fds: list[int]) -> "Child":
        """A child running `elastic-oneshot ARGV` on descriptors `fds` (stdin, stdout, stderr); the caller holds
        self.lock, which the child releases once it has ended."""
        socket.send_fds(self.sock, [json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()], fds)
        return Child(self, argv, self._reply(None)["pid"])

    def _reply(self, timeout: float | None) -> dict | None:
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        data = self.sock.recv(MESSAGE)
        if not data:
            raise RuntimeError(f"the zygote ended (exit {self.proc.wait()})")
        return json.loads(data)

    def close(self):
        self.sock.close()
        self.proc.wait()


class Child:
    """What a test does with subprocess.Popen, for a zygote's child: pid, poll, wait, send_signal, kill."""

    def __init__(self, zygote: Zygote, args: list[str], pid: int):
        self.zygote, self.args, self.pid, self.returncode = zygote, args, pid, None

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            reply = self.zygote._reply(timeout)
            if reply is not None:
                self.returncode = reply["status"]
                self.zygote.lock.release()
        return self.returncode

    def send_signal(self, sig: int):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def serve(sock: socket.socket) -> tuple[dict, list[int]]:
    """The zygote's loop; returns a request and its descriptors in each child it forks."""
    from elastic_oneshot.surface import cli

    cli._OWN_PROCESS = True  # as cli.entry makes it: the collector paused over the imports, then what they made frozen
    with cli._heavy_imports():
        from elastic_oneshot.surface import api  # noqa: F401  (what a run imports before its first step)
    while True:
        data, fds, _, _ = socket.recv_fds(sock, MESSAGE, 3)
        if not data:
            sys.exit(0)
        pid = os.fork()
        if pid == 0:
            sock.close()
            return json.loads(data), fds
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())
        sock.send(json.dumps({"status": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}).encode())


def become(request: dict, fds: list[int]):
    """In the child: the process a fresh `python -m elastic_oneshot ARGV` would be, short of its imports."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [os.path.join(os.path.dirname(os.path.dirname(__file__)), "__main__.py"), *request["argv"]]


if __name__ == "__main__":
    become(*serve(socket.socket(fileno=int(sys.argv[1]))))
    from elastic_oneshot.surface.cli import entry

    entry(sys.argv[1:])
