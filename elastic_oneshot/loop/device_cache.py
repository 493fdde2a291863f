"""What a step caches for the length of a layer (AWQ's recorded calls of each parent and its reference outputs):
on the device up to an allowance of bytes, past it in host memory up to another, past that in a file in the
temporary directory ($TMPDIR), each copy brought back as it is used. Such a cache grows with the samples (every
sample's inputs of every mapping's parent: on a large MoE, hundreds of GB a layer), and the run's budget
(`--max-memory`) and the host's memory bound what it holds, and the file's room (`file_room`) what it may hold at
all; the copies are exact, so where a tensor is held changes no bits, only time."""

import errno
import os
import re
import tempfile

import torch
from torch.utils._pytree import tree_leaves, tree_map

from elastic_oneshot.distributed.world import disk_share

MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # their files' pages are the host's memory


class DeviceCache:
    """Tensors kept on `device` while `allowance` bytes last, then copied to the host while `host_allowance` lasts
    (pinned on CUDA, so that each copy back is a plain DMA), then written to a file. On the CPU the device is the
    host: its allowance is the host's, and `host_allowance` 0. `on_host`, `on_disk`: the bytes copied out."""

    def __init__(self, device, allowance: float, host_allowance: float = 0):
        self.device, self.left, self.host_left = torch.device(device), allowance, host_allowance
        self.kept = self.on_host = self.on_disk = 0
        self._file = None

    @property
    def spilled(self) -> int:
        return self.on_host + self.on_disk

    def rest(self) -> "DeviceCache":
        """Another cache, within what this one's allowances have left."""
        return DeviceCache(self.device, self.left, self.host_left)

    def keep(self, obj, shared: frozenset = frozenset()):
        """`obj` (tensors nested in tuples, lists, dicts), each tensor on the device while the allowance lasts and
        out of it past it; tensors whose id is in `shared` (held anyway: a layer's keyword arguments) as they are."""
        return tree_map(lambda t: self._keep(t, shared) if isinstance(t, torch.Tensor) else t, obj)

    def _keep(self, t: torch.Tensor, shared: frozenset):
        if id(t) in shared:
            return t
        nbytes = t.numel() * t.element_size()
        self.kept += nbytes
        if nbytes <= self.left:
            self.left -= nbytes
            return t
        if nbytes <= self.host_left:
            self.host_left -= nbytes
            self.on_host += nbytes
            host = torch.empty_like(t, device="cpu", pin_memory=self.device.type == "cuda")
            return _Spilled(host.copy_(t, non_blocking=host.is_pinned()))  # in stream order before any copy back
        self.on_disk += nbytes
        return self._write(t)

    def _write(self, t: torch.Tensor) -> "_OnDisk":
        if self._file is None:  # unlinked: the space goes back when the cache does, or the process dies
            self._file = tempfile.TemporaryFile(prefix="elastic-oneshot-cache-")
        at = os.lseek(self._file.fileno(), 0, os.SEEK_END)
        data = memoryview(_bytes(t.detach().to("cpu")).numpy())
        done = 0
        try:
            while done < len(data):
                done += os.pwrite(self._file.fileno(), data[done:], at + done)
        except OSError as e:  # the file has no name: the directory it is in
            raise OSError(e.errno, e.strerror, tempfile.gettempdir()) from None
        return _OnDisk(self._file, at, t.shape, t.dtype)

    def use(self, obj):
        """`obj` with the copies `keep` made back on the device (the others as they are)."""
        return tree_map(lambda x: x.back(self.device) if isinstance(x, _Spilled | _OnDisk) else x, obj)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, as a flat uint8 tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class _Spilled:
    """A host copy `keep` made, which `use` brings back (a tensor the step was given on the host stays there)."""

    def __init__(self, host: torch.Tensor):
        self.host = host

    def back(self, device: torch.device) -> torch.Tensor:
        return self.host.to(device, non_blocking=self.host.is_pinned())


class _OnDisk:
    """A tensor `keep` wrote at offset `at` of `file`, which `use` reads back."""

    def __init__(self, file, at: int, shape: torch.Size, dtype: torch.dtype):
        self.file, self.at, self.shape, self.dtype = file, at, shape, dtype

    def back(self, device: torch.device) -> torch.Tensor:
        nbytes = self.shape.numel() * self.dtype.itemsize
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        view, done = memoryview(buffer.numpy()), 0
        while done < nbytes:
            got = os.preadv(self.file.fileno(), [view[done:]], self.at + done)
            if not got:  # the file is this process's alone, and unlinked: never, unless the disk fails
                raise OSError(errno.EIO, f"AWQ's cache file ends {nbytes - done} bytes short", tempfile.gettempdir())
            done += got
        return buffer.view(self.dtype).reshape(self.shape).to(device, non_blocking=buffer.is_pinned())


def file_room() -> tuple[str, int, bool]:
    """Where the caches' files go ($TMPDIR), this rank's share of the room there, and whether that directory is
    held in memory (tmpfs, ramfs: as on hosts whose TMPDIR is /dev/shm), where it has none: what a file there
    holds is taken from the host memory that the allowances already count."""
    tmp = tempfile.gettempdir()
    memory = in_memory(tmp)
    return tmp, 0 if memory else disk_share(tmp), memory


def in_memory(path: str) -> bool:
    """Whether `path` is on a file system held in memory: the type of the last mount over the longest mount point
    above it (/proc/self/mountinfo); False where that cannot be read."""
    path, best, kind = os.path.realpath(path), -1, None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields, _, rest = line.partition(" - ")
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields.split()[4])
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= best:
                    best, kind = len(point), rest.split()[0]
    except (OSError, IndexError):
        return False
    return kind in MEMORY_FILE_SYSTEMS


def tensor_ids(obj) -> frozenset:
    """The ids of the tensors nested in `obj`."""
    return frozenset(id(t) for t in tree_leaves(obj) if isinstance(t, torch.Tensor))
