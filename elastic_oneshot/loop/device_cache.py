"""What a step caches for the length of a layer (AWQ's recorded calls of each parent and its reference outputs):
on the device up to an allowance of bytes, past it on the host, each host copy brought back as it is used. Such a
cache grows with the samples (on a GPU, every sample's inputs of every mapping's parent), and the run's budget
(`--max-memory`) bounds it; the copies are exact, so where a tensor is held changes no bits, only time."""

import torch
from torch.utils._pytree import tree_leaves, tree_map


class DeviceCache:
    """Tensors kept on `device` while `allowance` bytes last, then copied to the host (pinned on CUDA, so that each
    copy back is a plain DMA). `spilled`: the bytes copied to the host."""

    def __init__(self, device, allowance: float):
        self.device, self.left, self.spilled = torch.device(device), allowance, 0

    def keep(self, obj, shared: frozenset = frozenset()):
        """`obj` (tensors nested in tuples, lists, dicts), each tensor on the device while the allowance lasts and
        on the host past it; tensors whose id is in `shared` (held anyway: a layer's keyword arguments) as they are."""
        return tree_map(lambda t: self._keep(t, shared) if isinstance(t, torch.Tensor) else t, obj)

    def _keep(self, t: torch.Tensor, shared: frozenset):
        if id(t) in shared:
            return t
        nbytes = t.numel() * t.element_size()
        if nbytes <= self.left:
            self.left -= nbytes
            return t
        self.spilled += nbytes
        host = torch.empty_like(t, device="cpu", pin_memory=self.device.type == "cuda")
        return _Spilled(host.copy_(t, non_blocking=host.is_pinned()))  # in stream order before any copy back

    def use(self, obj):
        """`obj` with the host copies `keep` made back on the device (the others as they are)."""
        return tree_map(lambda x: x.host.to(self.device, non_blocking=x.host.is_pinned())
                        if isinstance(x, _Spilled) else x, obj)


class _Spilled:
    """A host copy `keep` made, which `use` brings back (a tensor the step was given on the host stays there)."""

    def __init__(self, host: torch.Tensor):
        self.host = host


def tensor_ids(obj) -> frozenset:
    """The ids of the tensors nested in `obj`."""
    return frozenset(id(t) for t in tree_leaves(obj) if isinstance(t, torch.Tensor))
