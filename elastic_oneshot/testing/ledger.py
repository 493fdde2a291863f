"""A GPU on paper: torch operations on tensors that have shapes and no data, on a fake accelerator, each one
accounted for. testing/accountant.py runs one decoder layer of ours or of the peer's on it; bench/gpu.py --device cpu
prints what it counts:

    memory   the bytes of the accelerator's live storages (a storage counts once, however many views share it, from
             its allocation to its release), peak by phase: what a caching allocator would hold at least
    ops      the operations that would launch a kernel (views and metadata excluded), their FLOPs (matrix products
             and factorizations) and the bytes they read and write on the accelerator; a CUDA graph's replay
             (`Ledger.replay`) is one launch, and its kernels are counted apart

A paper tensor is a meta tensor that says it lives on the accelerator, `gpu` (torch's PrivateUse1 backend: CUDA's
name is taken by a CPU build, whose CUDA tensors cannot be indexed): code that asks `is_cuda` takes its CPU branch,
code that asks whether a tensor is on the host takes its device branch. Output shapes come from the meta kernels,
cached by the inputs' shapes, strides and dtypes (a meta kernel can cost a millisecond; a layer runs millions).

Values exist where control flow needs them (`Ledger.value`): integer and boolean tensors carry real values, computed on
the host beside them, wherever their inputs have values (routing: argsort, bincount, one_hot, nonzero). Where they
would come from float data, the layer is assumed to take its ordinary path: a router sends token t to experts t*k ..
t*k+k-1 (mod E), so each expert gets the mean share; Cholesky factorizations succeed; no value is NaN or infinite;
comparisons of floats are false (no dead columns); a float read on the host (a loss to log) reads 0, and its line is
reported. An integer value needed anywhere else stops the run with the caller's line.
"""

import contextlib
import math
import sys
import weakref
from collections import Counter
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

DEVICE = "gpu"
HOST = torch.device("cpu")
VALUE_LIMIT = 2**22  # elements: integer tensors up to this size carry values
SITE_BYTES = 2**20  # allocations this large remember where they were made
aten = torch.ops.aten
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.lift_fresh.default,
             aten.detach.default, aten.alias.default, aten.is_nonzero.default}
FALSE_WHERE_UNKNOWN = {aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.isnan, aten.isinf,
                       aten.isposinf, aten.isneginf}
TRUE_WHERE_UNKNOWN = {aten.isfinite}
EMPTY = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty}
ABSOLUTE = {aten.as_strided.default, aten.as_strided_.default}  # views whose storage offset is an argument
LINALG = {aten.linalg_cholesky_ex, aten.cholesky, aten.cholesky_inverse, aten.linalg_solve_triangular}
PRODUCTS = {aten.mm: 0, aten.bmm: 0, aten.matmul: 0, aten.linear: 0, aten.addmm: 1, aten.baddbmm: 1}  # -> the
# argument whose last dimension is the inner one (linear and matmul are composites, seen whole here)
_SITES = ("elastic_oneshot", "llmcompressor", "compressed_tensors", "transformers")
_ACTIVE: list = []  # the ledgers inside `paper`, innermost last


def accelerator() -> torch.device:
    """The fake accelerator's device (registered once per process)."""
    if torch._C._get_privateuse1_backend_name() != DEVICE:
        torch.utils.backend_registration._setup_privateuseone_for_python_backend(DEVICE)
    return torch.device(DEVICE, 0)  # with its index, as CUDA's are: `to` copies between "gpu" and "gpu:0"


class Paper(torch.Tensor):
    """A tensor with a shape and no data: `meta`, a meta tensor (views share its storage), said to be on `device`."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.size(), strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=meta.dtype,
                                                device=device, requires_grad=False)
        t.meta = meta
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a paper tensor outside a Ledger")

    def __repr__(self):
        return f"Paper({tuple(self.shape)}, {self.dtype}, {self.device})"

    def tolist(self):  # torch refuses subclasses here: from the value, one copy to the host
        ledger = _ACTIVE[-1]
        ledger._count(aten._local_scalar_dense.default, [self], [], sync=True)
        value = ledger.value(self)
        if value is None:
            raise RuntimeError(f"the ledger has no value at {_site(any_frame=True)}: add a rule for it")
        return value.tolist()


def _linalg_flops(func, args) -> int:
    """FLOPs of the factorizations GPTQ uses (torch's flop counter has only products)."""
    a = args[0]
    n, batch = a.shape[-1], math.prod(a.shape[:-2])
    if func in (aten.linalg_cholesky_ex, aten.cholesky):
        return batch * n**3 // 3
    if func == aten.cholesky_inverse:
        return batch * n**3
    b = args[1]  # linalg_solve_triangular
    return math.prod(b.shape[:-2]) * n * n * (b.shape[-1] if args[0].shape[-1] == b.shape[-2] else b.shape[-2])


class Ledger(TorchDispatchMode):
    """Runs and counts what runs inside it (see `paper`). `phase(name)` names the work that follows; `report()`
    gives, per phase, the peak of live accelerator bytes and the operations, FLOPs and bytes moved. `sites`: where
    the storages live at the overall peak were allocated (costs a frame walk per large allocation)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.live, self.peak, self.phases = 0, 0, ["setup"]
        self.peaks: dict[str, int] = {}
        self.ops, self.flops, self.moved, self.syncs = Counter(), Counter(), Counter(), Counter()
        self.graphed: Counter = Counter()  # kernels replayed in CUDA graphs (`replay`), by phase
        self._replaying = False
        self.by_op: Counter = Counter()
        self.sites = sites
        self._storages: dict[int, tuple[int, str | None]] = {}  # id of a live storage -> (bytes, site)
        self._events: list = []  # (id, bytes, site) at a large allocation, (id,) at its release: `peak_sites`
        self._peak_event = 0
        self._shapes: dict = {}  # (op, inputs' specs) -> how to make its outputs
        self.assumed: Counter = Counter()  # where a float without a value was read (as 0)

    # -- phases -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        self.phases.append(name)
        self.peaks[name] = max(self.peaks.get(name, 0), self.live)
        try:
            yield
        finally:
            self.phases.pop()

    @contextlib.contextmanager
    def replay(self):
        """Inside: the kernels of one CUDA graph's replay: one launch; the kernels' bytes and FLOPs count, and they
        are counted as kernels in graphs (`graphed`), not as launches."""
        self.ops[self.phases[-1]] += 1
        self.by_op["CUDA graph replay"] += 1
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def report(self) -> dict:
        """{"phases": {phase: {"peak", "ops", "graphed", "flops", "bytes", "syncs"}} in order of first appearance,
        "peak": the overall peak, "at_peak": `peak_sites()`}."""
        names = [n for n in dict.fromkeys([*self.peaks, *self.ops]) if n != "setup"]
        out = {n: {"peak": self.peaks.get(n, 0), "ops": self.ops[n], "graphed": self.graphed[n],
                   "flops": self.flops[n], "bytes": self.moved[n], "syncs": self.syncs[n]} for n in names}
        return {"phases": out, "peak": self.peak, "at_peak": self.peak_sites(), "assumed": dict(self.assumed)}

    # -- storages ---------------------------------------------------------------------------------------------
    def _allocated(self, t: torch.Tensor):
        storage = t.meta.untyped_storage()
        key = id(storage)
        if key in self._storages:
            return
        size = storage.nbytes()
        site = _site() if self.sites and size >= SITE_BYTES else None
        self._storages[key] = (size, site)
        weakref.finalize(storage, self._release, key)
        self.live += size
        if site is not None:
            self._events.append((key, size, site))
        if self.live > self.peaks.get(self.phases[-1], 0):
            for p in self.phases:
                self.peaks[p] = max(self.peaks.get(p, 0), self.live)
        if self.live > self.peak:
            self.peak, self._peak_event = self.live, len(self._events)

    def _release(self, key: int):
        size, site = self._storages.pop(key)
        self.live -= size
        if site is not None:
            self._events.append((key,))

    def peak_sites(self, top: int = 8) -> list[tuple[str, int]]:
        """The storages of at least SITE_BYTES live at the overall peak, summed by where they were made."""
        live: dict[int, tuple[int, str]] = {}
        for event in self._events[:self._peak_event]:
            if len(event) == 3:
                live[event[0]] = event[1:]
            else:
                live.pop(event[0], None)
        by_site: Counter = Counter()
        for size, site in live.values():
            by_site[site] += size
        return by_site.most_common(top)

    # -- operations -------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten._local_scalar_dense:
            self._count(func, [args[0]], [], sync=True)
            value = self.value(args[0])
            if value is not None:
                return value.item()
            if args[0].is_floating_point():  # a loss to log, say: read as 0, and listed
                self.assumed[_site(any_frame=True)] += 1
                return 0.0
            raise RuntimeError(f"the ledger has no value at {_site(any_frame=True)}: add a rule for it")
        if packet is aten.to:  # reaches here whole under inference mode, and its meta kernel cannot see devices
            return self._to(func, types, args, kwargs)
        tensors = []
        key = (func, _key(args, tensors), _key(kwargs, tensors))
        if func in ABSOLUTE:
            key += tuple(t.storage_offset() for t in tensors)
        papers = [t for t in tensors if type(t) is Paper]
        device = kwargs_device(kwargs)
        if not papers and tensors and (device is None or device.type != DEVICE):
            return func(*args, **kwargs)  # real tensors only, staying where they are: real work
        device = device or next((p.device for p in papers if p.device.type == DEVICE),
                                papers[0].device if papers else HOST)
        made = self._shapes.get(key)
        if made is None:
            try:
                made = self._shape(func, args, kwargs, tensors)
            except (NotImplementedError, RuntimeError) as e:  # its output depends on values
                if packet in (aten.index, aten.index_put, aten.index_put_) and self._masks_known(args[1]):
                    return self.__torch_dispatch__(func, types, (args[0], self._positions(args[1]), *args[2:]),
                                                   kwargs)
                out = self._from_values(func, args, kwargs, device, e)
                return self._after(func, packet, args, kwargs, papers, out)
            self._shapes[key] = made
        out = _build(made, tensors, device)
        return self._after(func, packet, args, kwargs, papers, out)

    def _to(self, func, types, args, kwargs):
        """Tensor.to: the tensor itself where nothing changes, else a copy (`_to_copy`)."""
        bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        x, other = bound["self"], bound.get("other")
        dtype = other.dtype if other is not None else bound.get("dtype") or x.dtype
        device = other.device if other is not None else kwargs_device(bound) or x.device
        if dtype == x.dtype and device == x.device and not bound.get("copy"):
            return x
        more = {"memory_format": bound["memory_format"]} if bound.get("memory_format") is not None else {}
        return self.__torch_dispatch__(aten._to_copy.default, types, (x,), {"dtype": dtype, "device": device, **more})

    def _after(self, func, packet, args, kwargs, papers, out):
        outputs = [out] if isinstance(out, Paper) else [t for t in out if isinstance(t, Paper)] \
            if isinstance(out, (tuple, list)) else []
        if any(not t.is_floating_point() for t in outputs):
            self._values(func, packet, args, kwargs, outputs)
        for t in outputs:
            if t.device.type == DEVICE:
                self._allocated(t)
        if not func.is_view and func not in NO_KERNEL and func.namespace == "aten":
            self._count(func, papers, outputs, args=args, kwargs=kwargs, out=out)
        return out

    @staticmethod
    def _shape(func, args, kwargs, tensors):
        """How to make `func`'s outputs, from its meta kernel."""
        metas = [t.meta if type(t) is Paper else t.to("meta") for t in tensors]
        it = iter(metas)
        margs = tuple(_meta(a, it) for a in args)
        mkwargs = {k: _meta(v, it) for k, v in kwargs.items()}
        return _recipe(func(*margs, **mkwargs), metas, absolute=func in ABSOLUTE)

    def _count(self, func, papers, outputs, args=(), kwargs=None, out=None, sync=False):
        read = {id(t): t for t in papers if t.device.type == DEVICE}
        written = [t for t in outputs if t.device.type == DEVICE]
        if not read and not written:
            return
        phase = self.phases[-1]
        packet = func.overloadpacket
        if self._replaying:
            self.graphed[phase] += 1
        else:
            self.ops[phase] += 1
            self.by_op[packet.__name__] += 1
        self.syncs[phase] += sync
        self.moved[phase] += sum(t.numel() * t.element_size() for t in (*read.values(), *written))
        if packet in LINALG:
            self.flops[phase] += _linalg_flops(packet, args)
        elif packet in PRODUCTS:  # 2 x each output x the inner dimension (out_dtype overloads included)
            self.flops[phase] += 2 * outputs[0].numel() * args[PRODUCTS[packet]].shape[-1]
        elif packet in flop_registry:
            self.flops[phase] += flop_registry[packet](*args, **(kwargs or {}), out_val=out)

    # -- values -----------------------------------------------------------------------------------------------
    @staticmethod
    def value(t):
        """A paper tensor's value where it has one (a real host tensor); a real tensor itself; else None."""
        if isinstance(t, Paper):
            return getattr(t, "_ledger_value", None)
        return t

    def _real(self, func, args, kwargs):
        """`func` on the values of its arguments, on the host; None where an argument has none."""
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if any(self.value(x) is None for x in leaves):
            return None
        with _disable_current_modes():
            real_args, real_kwargs = tree_map(
                lambda x: HOST if isinstance(x, torch.device) else self.value(x), (args, kwargs))
            try:
                return func(*real_args, **real_kwargs)
            except RuntimeError:  # an expanded value written in place, say: no value
                return None

    def _from_values(self, func, args, kwargs, device, error):
        """Outputs whose shapes depend on values (nonzero, bincount, indexing by masks), made from the values."""
        real = self._real(func, args, kwargs)
        if real is None:
            raise RuntimeError(f"{func} needs values the ledger lacks at {_site(any_frame=True)} "
                               f"({type(error).__name__}: {str(error).splitlines()[0][:100]}): add a rule for it")
        return tree_map(lambda r: self.paper(r, device, value=True) if isinstance(r, torch.Tensor) else r, real)

    def _masks_known(self, indices) -> bool:
        return all(i is None or i.dtype != torch.bool or self.value(i) is not None for i in indices)

    def _positions(self, indices) -> list:
        """Boolean masks among `indices` as the positions they select (they have values), as indexing takes them."""
        out = []
        for i in indices:
            if i is None or i.dtype != torch.bool:
                out.append(i)
            else:
                with _disable_current_modes():
                    where = self.value(i).nonzero().unbind(1)
                out += [self.paper(w, i.device, value=True) for w in where]
        return out

    def paper(self, real: torch.Tensor, device, value: bool = False) -> Paper:
        """A paper tensor of `real`'s shape on `device` (counted there); with `value`, `real` is its value."""
        with _disable_current_modes():  # called from outside the mode too
            meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
        out = Paper(meta, kwargs_device({"device": device}))
        if value:
            out._ledger_value = real
        if out.device.type == DEVICE:
            self._allocated(out)
        return out

    def _values(self, func, packet, args, kwargs, tensors):
        """Give the outputs values: computed from the inputs' where they all have one, else by the rules."""
        if not tensors or all(getattr(t, "_ledger_value", None) is not None for t in tensors):
            return
        mutated = func._schema.is_mutable
        small = all(not t.is_floating_point() and not t.is_complex() and t.numel() <= VALUE_LIMIT for t in tensors)
        real = self._real(func, args, kwargs) if (small or mutated) and packet not in EMPTY else None
        if mutated:  # in place (values written in place too), or `out=`: keep what is known
            if real is None:
                for t in tensors:
                    if hasattr(t, "_ledger_value"):
                        del t._ledger_value
            if packet == aten.linalg_cholesky_ex:
                _assume(tensors[1], 0)
            return
        if packet in EMPTY:  # no garbage where values are needed
            _assume(tensors[0], 0)
        elif real is not None:
            for t, r in zip(tensors, tree_flatten(real)[0]):
                t._ledger_value = r
        elif packet == aten.topk:
            _assume_routing(tensors[1], args)
        elif packet == aten.linalg_cholesky_ex:
            _assume(tensors[1], 0)
        elif packet in FALSE_WHERE_UNKNOWN:
            _assume(tensors[0], False)
        elif packet in TRUE_WHERE_UNKNOWN:
            _assume(tensors[0], True)


def kwargs_device(kwargs: dict) -> torch.device | None:
    device = kwargs.get("device")
    if device is None:
        return None
    device = torch.device(device)
    return torch.device(DEVICE, 0) if device.type == DEVICE else device


def _key(obj, tensors: list):
    """A hashable description of an op's arguments (tensors by dtype, shape and strides: their storage offsets
    matter only to ops in ABSOLUTE), collecting the tensors in order."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return obj.dtype, obj.shape, obj.stride()
    if isinstance(obj, (list, tuple)):
        return type(obj), *(_key(o, tensors) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _key(v, tensors)) for k, v in obj.items())
    return obj


def _meta(x, metas):
    """An argument with its tensors replaced by the next of `metas` (in `_key`'s order), devices by meta."""
    if isinstance(x, torch.Tensor):
        return next(metas)
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(o, metas) for o in x)
    return x


def _recipe(result, metas, absolute: bool = False):
    """How to make an op's outputs again from its meta result and inputs: the same argument (written in place),
    a view of an argument (its storage offset relative to the argument's, unless `absolute`), a new tensor, or a
    constant; tuples and lists as such."""
    if isinstance(result, (tuple, list)):
        return type(result), [_recipe(r, metas, absolute) for r in result]
    if not isinstance(result, torch.Tensor):
        return "const", result
    for i, m in enumerate(metas):
        if m is result:
            return "same", i
    storage = result.untyped_storage()
    for i, m in enumerate(metas):
        if m.untyped_storage() is storage:
            offset = result.storage_offset() - (0 if absolute else m.storage_offset())
            return "view", i, result.shape, result.stride(), offset, absolute
    return "new", result.shape, result.stride(), result.dtype


def _build(made, tensors: list, device):
    kind = made[0]
    if kind == "same":
        return tensors[made[1]]
    if kind == "view":
        _, i, shape, stride, offset, absolute = made
        base = tensors[i]
        meta = base.meta if type(base) is Paper else base
        return Paper(meta.as_strided(shape, stride, offset + (0 if absolute else meta.storage_offset())), base.device)
    if kind == "new":
        return Paper(torch.empty_strided(made[1], made[2], dtype=made[3], device="meta"), device)
    if kind == "const":
        return made[1]
    return made[0](_build(m, tensors, device) for m in made[1])


def _assume(t: torch.Tensor, value):
    """`t`'s value: all `value` (expanded, where too large to be written in place)."""
    with _disable_current_modes():
        shape = t.shape if t.numel() <= VALUE_LIMIT else ()
        t._ledger_value = torch.full(shape, value, dtype=t.dtype).expand(t.shape)


def _assume_routing(indices: torch.Tensor, args):
    """topk over experts with no values: token t to experts t*k .. t*k+k-1 (mod E), the mean share each."""
    experts, k = args[0].shape[-1], indices.shape[-1]
    with _disable_current_modes():
        tokens = math.prod(indices.shape[:-1])
        routed = (torch.arange(tokens)[:, None] * k + torch.arange(k)) % experts
        indices._ledger_value = routed.reshape(indices.shape).to(indices.dtype)


def _site(any_frame: bool = False) -> str:
    """The innermost caller in ours, the peer's or a library it runs (else, with `any_frame`, outside torch)."""
    frame, fallback = sys._getframe(2), None
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__:
            if any(f"/{s}/" in path for s in _SITES):
                tail = path.rsplit("site-packages/", 1)[-1]
                return f"{tail[tail.find('elastic_oneshot/'):] if 'elastic_oneshot/' in tail else tail}:" \
                       f"{frame.f_lineno} {frame.f_code.co_name}"
            if fallback is None and "/torch/" not in path:
                fallback = f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return (fallback if any_frame else None) or "?"


@contextlib.contextmanager
def paper(ledger: Ledger):
    """Inside, every operation goes through `ledger`, and factory functions make paper tensors (on the host
    unless told otherwise)."""
    accelerator()
    made = torch.tensor

    def tensor(data, *args, device=None, **kwargs):  # made on the host, then moved (no `gpu` kernel exists)
        if device is None or torch.device(device).type != DEVICE:
            return made(data, *args, device=device, **kwargs)
        with _disable_current_modes():
            real = made(data, *args, **kwargs)
        return ledger.paper(real, device, value=True)

    with ledger, mock.patch.object(torch, "tensor", tensor):
        _ACTIVE.append(ledger)
        try:
            yield ledger
        finally:
            _ACTIVE.pop()
