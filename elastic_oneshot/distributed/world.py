"""The distributed plumbing: process group from torchrun's environment, and the few collectives we use.

Without torchrun (no WORLD_SIZE), everything degenerates to one process and no collective is issued.
"""

import datetime
import logging
import os
import re
import shutil
import time

import torch
import torch.distributed as dist

from elastic_oneshot import metrics
from elastic_oneshot.distributed.watchdog import Watchdog
from elastic_oneshot.errors import UsageError, exit_now, report

log = logging.getLogger("elastic_oneshot")


_RANK_LOST = re.compile(r"(?:\[[^\]]*\] )?(.*?(?:Connection reset by peer|Connection closed by peer|Broken pipe|"
                        r"Timed out waiting \d+ms for \w+ operation to complete|"
                        r"Application timeout caused pair closure))")


_TIMED_OUT = re.compile(r"Timed out waiting|Application timeout")
_world: "World | None" = None  # the process's, for the command line's line on a lost rank


def rank_lost(error: BaseException) -> str | None:
    """gloo's words, if `error` says that another rank vanished (killed, or its node lost) or froze (the
    collective timed out before the liveness watchdog spoke) mid-collective."""
    found = _RANK_LOST.search(str(error)) if isinstance(error, RuntimeError) else None
    return found.group(1) if found else None


def lost_line(error: BaseException) -> str | None:
    """The one line for `error` if it says that another rank vanished or froze; None otherwise. A collective that
    timed out while the heartbeats found a rank silent (frozen, or cut off) is the liveness watchdog's finding, a
    moment early: named, and recorded (`on_lost`), as the watchdog names and records it."""
    reason = rank_lost(error)
    if reason is None:
        return None
    silent = _world.silent() if _world is not None and _TIMED_OUT.search(reason) else None
    if silent is None:
        return f"another rank was lost ({reason}): leaving so that torchrun restarts the workers"
    line = f"rank {silent[0]} silent for {silent[1]:.0f} s"
    if _world.on_lost:
        _world.on_lost(line)
    return f"liveness: {line}; leaving so that the job can go on without it"


class World:
    def __init__(self, timeout_s: float = 120.0):
        self.size = int(os.environ.get("WORLD_SIZE", "1"))
        self.on_lost = None  # called with the reason before a liveness failure ends the process
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cpu")
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            log.warning("torchrun shares its rendezvous store with the workers: restarted workers may fail "
                        "to connect (torch 2.13); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see launch/)")
        self._heard: dict[int, float] = {}  # rank -> when the heartbeats last heard from it (monotonic)
        if self.size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s), device_id=(
                                        self.device if self.device.type == "cuda" else None))
            self._bound, self._counts = timeout_s, {r: -1 for r in range(self.size) if r != self.rank}
            self._heard.update(dict.fromkeys(self._counts, time.monotonic()))
            self._watchdog = Watchdog("liveness", self._heartbeat, max(0.5, timeout_s / 10), self._lost).start()
            global _world
            _world = self

    def _heartbeat(self) -> str | None:
        """One round of heartbeats through the process group's store: a rank that sees another rank silent for the
        collective timeout (frozen, or cut off), or cannot reach the store (the silent rank's, maybe), leaves: its
        agent restarts the workers and the new rendezvous goes on without the silent node. Commits are atomic, so
        leaving is always safe."""
        store = dist.distributed_c10d._get_default_store()
        store.add(f"elastic_oneshot/alive/{self.rank}", 1)
        now = time.monotonic()
        for other, count in self._counts.items():
            current = store.add(f"elastic_oneshot/alive/{other}", 0)
            if current != count:
                self._counts[other], self._heard[other] = current, now
            elif now - self._heard[other] > self._bound:
                return f"rank {other} silent for {now - self._heard[other]:.0f} s"
            metrics.silence(other, now - self._heard[other])
        return None

    def _lost(self, reason: str):
        report(f"liveness: {reason}; leaving so that the job can go on without it", after_bar=True)
        try:
            if self.on_lost:
                self.on_lost(reason)
        finally:
            exit_now(1)

    def silent(self) -> tuple[int, float] | None:
        """The rank the heartbeats have not heard from the longest, and for how many seconds, if over half the
        liveness bound; None otherwise."""
        now = time.monotonic()
        quiet = [(now - heard, rank) for rank, heard in self._heard.items()]
        seconds, rank = max(quiet, default=(0.0, None))
        return (rank, seconds) if rank is not None and seconds > self._bound / 2 else None

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def free_memory(self) -> int:
        """Bytes free on this rank's device now: the GPU's, or the host's available memory."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return _host_available()

    def memory_for_a_layer(self) -> list[tuple[str, int]]:
        """(where, bytes) this rank can hold a layer in now: its share of the host's available memory (every
        local rank loads the same layer at once), and on a GPU the device's free memory."""
        local = local_ranks()
        out = [(f"rank {self.rank}'s host" + (f" (its share: {local} ranks load a layer there)" if local > 1 else ""),
                host_share())]
        if self.device.type == "cuda":
            out.append((f"rank {self.rank}'s {torch.cuda.get_device_name(self.device)}", self.free_memory()))
        return out

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` on every rank (small JSON-like values only)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def agree(self, what: str, value):
        """Fail fast, on every rank, if ranks disagree on `value` (e.g. the job's fingerprint)."""
        values = self.gather_objects(value)
        if any(v != values[0] for v in values):
            bad = [r for r, v in enumerate(values) if v != values[0]]
            raise UsageError(f"ranks disagree on {what}: rank 0 has {values[0]!r}, ranks {bad} differ; "
                             "start every rank with the same arguments")

    def broadcast_object(self, obj, src: int = 0):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce_to(self, tensor: torch.Tensor, dst: int):
        """Async sum of `tensor` onto rank `dst`."""
        return dist.reduce(self._dev(tensor), dst=dst, op=dist.ReduceOp.SUM, async_op=True) \
            if self.distributed else None

    def all_reduce(self, tensor: torch.Tensor):
        """Async sum of `tensor` onto every rank (bitwise the same everywhere)."""
        return dist.all_reduce(self._dev(tensor), op=dist.ReduceOp.SUM, async_op=True) if self.distributed else None

    def broadcast(self, tensor: torch.Tensor, src: int):
        return dist.broadcast(self._dev(tensor), src=src, async_op=True) if self.distributed else None

    def _dev(self, tensor):
        if self.device.type == "cuda" and tensor.device != self.device:
            raise ValueError("collective tensors must live on the rank's device")
        if not tensor.is_contiguous():  # gloo would send the raw storage in another order
            raise ValueError("collective tensors must be contiguous")
        return tensor

    def close(self):
        """Leave together: nobody is mistaken for a silent rank while the others finish."""
        if self.distributed and dist.is_initialized():
            dist.barrier()
            self._watchdog.stop()
            dist.destroy_process_group()


def local_ranks() -> int:
    """The ranks on this host (torchrun's LOCAL_WORLD_SIZE): they work on the same layer at once, so each may use
    a share of its memory and of its disk."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def host_share() -> int:
    """This rank's share of the host's available memory now."""
    return _host_available() // local_ranks()


def disk_share(path: str) -> int:
    """This rank's share of the free space now on the file system that holds `path`."""
    return shutil.disk_usage(path).free // local_ranks()


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
