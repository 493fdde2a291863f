"""GPTQ (Frantar et al., 2022) with LLM Compressor's semantics. Pure math: no I/O, no processes.

Matches llmcompressor 0.14's GPTQModifier: Hessian 2/n * sum x x^T over the n calibration sequences,
scales from the original weight's min/max by every strategy compressed-tensors has (tensor, channel, group,
tensor group with a global scale shared by fused modules, block), fixed during the solve; static activation ordering,
dead columns zeroed, damping 0.01 * mean(diag H). Three differences, all deliberate: a Cholesky
failure retries with more damping before falling back to round-to-nearest; modules that share
an input (and so a Hessian) are solved together as one matrix, their rows stacked; and for Hessians
wider than cholesky.SHARED_INVERSE_COLS the inverse factor comes from a blocked fp64 Cholesky and a
triangular inverse, both in fixed pieces that ranks share (cholesky.py; closer to exact than the peer's
three fp32 steps).
"""

import dataclasses
import itertools
import logging
import math
from typing import NamedTuple

import torch
from compressed_tensors.quantization import QuantizationArgs, fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from elastic_oneshot.quantization import schemes
from elastic_oneshot.quantization.cholesky import (
    assemble,
    blocked_cholesky,
    cholesky_panels,
    inverse_pieces,
    inverse_rows,
    one_thread,
    reversed_columns,
)

log = logging.getLogger(__name__)
DAMPING_RETRIES = 3  # each retry multiplies the damping fraction by 10
SOLVE_ELEMENTS = 2**27  # weights per pass of `solve` on the host (a pass's fp32 copies, 512 MB each at most)
DEVICE_SOLVE_ELEMENTS = 2**29  # and on an accelerator, where each pass is ~10 launches per column (2 GB copies)


HESSIAN_BLOCK = 192  # rows per block of the lower triangle on the host
DEVICE_STRIP = 1024  # rows per strip of a Lower on an accelerator, where launches, not FLOPs, bound the strips


class Lower:
    """A symmetric [d, d] matrix held as its lower triangle: row strips [start:end, :end], each with its diagonal
    block whole, packed in one buffer (`packed`). About half the memory of the whole matrix, and one contiguous
    tensor for collectives and elementwise work: a chunk's partial sums (fp32) fold into the total (fp64) of the
    same strips with one add. Strips of HESSIAN_BLOCK rows on the host (hessian_add's row blocks), DEVICE_STRIP on
    an accelerator."""

    def __init__(self, d: int, dtype: torch.dtype, device, packed: torch.Tensor | None = None):
        """`packed`: the buffer to use (`size` elements, zeros), a view of a larger one, say; else a new one."""
        rows = HESSIAN_BLOCK if torch.device(device).type == "cpu" else DEVICE_STRIP
        self.d = d
        self.spans = [(r, min(r + rows, d)) for r in range(0, d, rows)]
        self.offsets = list(itertools.accumulate(((e - r) * e for r, e in self.spans), initial=0))
        self.packed = torch.zeros(self.offsets[-1], dtype=dtype, device=device) if packed is None else packed

    @staticmethod
    def size(d: int, device) -> int:
        """The elements of a Lower of d columns on `device`."""
        rows = HESSIAN_BLOCK if torch.device(device).type == "cpu" else DEVICE_STRIP
        return sum((min(r + rows, d) - r) * min(r + rows, d) for r in range(0, d, rows))

    def strip(self, i: int) -> torch.Tensor:
        """Rows spans[i] of the matrix, columns up to the strip's end: a view of `packed`."""
        r, e = self.spans[i]
        return self.packed[self.offsets[i]:self.offsets[i + 1]].view(e - r, e)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole symmetric matrix in `dtype`: each strip cast into place, every entry above the diagonal
        (in the diagonal blocks too) the one below it, mirrored."""
        out = self.packed.new_empty(self.d, self.d, dtype=dtype)
        for i, (r, e) in enumerate(self.spans):
            out[r:e, :e] = self.strip(i)
            block = out[r:e, r:e]
            block.copy_(symmetric(block))
        for r, e in self.spans:
            out[r:e, e:] = out[e:, r:e].mT
        return out


def packed(hessian: "Lower | torch.Tensor") -> torch.Tensor:
    """The tensor that holds a Hessian's entries (for collectives and normalizing): a Lower's buffer, or the
    whole matrix."""
    return hessian.packed if isinstance(hessian, Lower) else hessian


def dense(hessian: "Lower | torch.Tensor") -> torch.Tensor:
    """A Hessian, whole or as its Lower, as a new whole fp32 matrix."""
    return hessian.dense(torch.float32) if isinstance(hessian, Lower) else hessian.to(torch.float32, copy=True)


def hessian_add(acc: "Lower | torch.Tensor", x: torch.Tensor, seq_len: int):
    """acc (fp32) += sum over the sequences in `x` of 2 X^T X (normalized later by the sample count), in its
    lower triangle: a Lower's strips, or a whole matrix's row blocks (above the diagonal blocks nothing is
    written: `symmetric` completes it). `x` is [batch, tokens, features], or [tokens, features] from modules
    that see tokens flattened (MoE experts): then whole sequences of `seq_len` tokens when it holds whole
    sequences, else one set.

    The terms are computed and summed as the peer does (fp32, scaled by sqrt 2, same operand layout, one
    sequence after another): GPTQ's rounding decisions are chaotic in the Hessian's last bits. Computing
    the triangle by row blocks takes 0.56-0.67x the FLOPs of the full product, and on MKL its entries
    equal the full product's bit for bit (the full product is exactly symmetric there). The caller sums
    these fp32 partials per chunk into an fp64 total, so that the total hardly depends on how chunks are
    split across ranks. On an accelerator see `_hessian_add_device`.
    """
    if x.device.type != "cpu":
        return _hessian_add_device(acc, x)
    if x.dim() > 2:
        x = x.reshape(-1, *x.shape[-2:])
    else:
        x = x.reshape(-1, seq_len, x.shape[-1]) if x.shape[0] % seq_len == 0 else x.unsqueeze(0)
    spans = _spans(acc, HESSIAN_BLOCK)
    for seq in x:
        inp = math.sqrt(2) * seq.t().to(torch.float32)
        for i, (r, e) in enumerate(spans):
            _rows(acc, i, r, e).add_(inp[r:e].matmul(inp[:e].t()))


def _hessian_add_device(acc: "Lower | torch.Tensor", x: torch.Tensor):
    """`hessian_add` on an accelerator, where launches, not FLOPs, bound a loop of row blocks: a Lower's strips
    of DEVICE_STRIP rows, or a whole matrix's whole product. bf16 and fp16 inputs are multiplied in their own
    type into fp32 (their products are exact in fp32, so this is the fp32 product, summed in cuBLAS's order, at
    tensor-core speed); fp32 inputs one sequence after another, scaled by sqrt 2, as the peer does."""
    spans = _spans(acc, x.shape[-1])
    if x.dtype in (torch.bfloat16, torch.float16):
        flat = x.reshape(-1, x.shape[-1])
        for i, (r, e) in enumerate(spans):
            _rows(acc, i, r, e).add_(torch.mm(flat[:, r:e].t(), flat[:, :e], out_dtype=torch.float32), alpha=2)
        return
    for seq in x.reshape(-1, *x.shape[-2:]) if x.dim() > 2 else [x]:
        inp = math.sqrt(2) * seq.t().to(torch.float32)
        for i, (r, e) in enumerate(spans):
            _rows(acc, i, r, e).add_(inp[r:e].matmul(inp[:e].t()))


def hessian_add_batch(acc: torch.Tensor, x: torch.Tensor):
    """`hessian_add` on an accelerator for a batch of modules' inputs x [B, tokens, d] (each one set of tokens), into
    acc [B, d, d] (each a whole matrix, or a Lower of one strip): one batched product for all of them."""
    if x.dtype in (torch.bfloat16, torch.float16):
        acc.add_(torch.bmm(x.mT, x, out_dtype=torch.float32), alpha=2)
        return
    inp = math.sqrt(2) * x.to(torch.float32)
    acc += torch.bmm(inp.mT, inp)


def _spans(acc: "Lower | torch.Tensor", rows: int) -> list[tuple[int, int]]:
    d = acc.d if isinstance(acc, Lower) else acc.shape[-1]
    return acc.spans if isinstance(acc, Lower) else [(r, min(r + rows, d)) for r in range(0, d, rows)]


def _rows(acc: "Lower | torch.Tensor", i: int, r: int, e: int) -> torch.Tensor:
    return acc.strip(i) if isinstance(acc, Lower) else acc[r:e, :e]


def symmetric(lower: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose lower triangle `lower` holds."""
    return lower.tril() + lower.tril(-1).mT


def fold(total: "Lower | torch.Tensor", lower: "Lower | torch.Tensor"):
    """total (fp64) += a chunk's fp32 `hessian_add` sums, in place: two Lowers' buffers added, or whole matrices
    by row blocks with `symmetric(lower)`, no temporary the size of either (an attention output's Hessian of
    16384 inputs is 1 GiB in fp32; `lower` is made symmetric in place: above its diagonal it held nothing the
    total needs)."""
    if isinstance(total, Lower):
        total.packed += lower.packed
        return
    d = lower.shape[-1]
    for r in range(0, d, HESSIAN_BLOCK):
        e = min(r + HESSIAN_BLOCK, d)
        block = lower[r:e, r:e]
        block.copy_(symmetric(block))
        lower[r:e, e:] = lower[e:, r:e].mT  # rows below are still lower-triangular here
        total[r:e] += lower[r:e]


class QParams(NamedTuple):
    """A module's quantization parameters, from its whole original weight, fixed during the solve."""

    scale: torch.Tensor  # [1] tensor, [rows, 1] channel, [rows, groups] group, [row blocks, column blocks] block
    zero_point: torch.Tensor
    global_scale: torch.Tensor | None = None  # tensor group: [1] fp32, shared across the fusion group


@torch.no_grad()  # compressed-tensors caches its range tensors: inference tensors, if first made in inference mode
def qparams(weight: torch.Tensor, args: QuantizationArgs, global_scale: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point from the weight's min and max per qparam (the peer's memoryless_minmax)."""
    w = schemes.observed(weight, args)
    return calculate_qparams(w.amin(-1), w.amax(-1), args, global_scale)


def global_scale(weights: list[torch.Tensor], args: QuantizationArgs) -> torch.Tensor | None:
    """Tensor group's global scale from the absolute maximum over a fusion group's weights; else None."""
    if not schemes.has_global_scale(args):
        return None
    absmax = torch.stack([torch.maximum(w.amax(), -w.amin()) for w in weights]).amax().reshape(1)
    return generate_gparam(-absmax, absmax)


def module_qparams(modules: dict[str, torch.nn.Module], args: dict[str, QuantizationArgs],
                   fused_scales: tuple[tuple[str, ...], ...]) -> dict[str, QParams]:
    """QParams of the modules named in `args` (names within one layer; `modules`: the layer's, with their
    original weights), the siblings of a fusion group (`fused_scales`: the family's) sharing one global scale."""
    fused = {}
    for name in args:
        parent, _, leaf = name.rpartition(".")
        siblings = next((f for f in fused_scales if leaf in f), ())
        members = [f"{parent}.{s}" if parent else s for s in siblings]
        fused[name] = members if members and all(m in modules for m in members) else [name]
    out = {}
    for name, a in args.items():
        g = global_scale([modules[m].weight for m in fused[name] if m in args], a)
        out[name] = QParams(*qparams(modules[name].weight, a, g), g)
    return out


def row_qparams(q: QParams, args: QuantizationArgs, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per output row, the effective scale (divided by the global scale) and zero point (None if symmetric)
    of each column group (`column_groups`): any slice of rows can then be solved alone."""
    scale, zp = schemes.per_row(q.scale, args, rows), schemes.per_row(q.zero_point, args, rows)
    if q.global_scale is not None:
        scale = scale / q.global_scale
    return scale.contiguous(), None if args.symmetric else zp.contiguous()


def column_groups(cols: int, args: QuantizationArgs, device=None) -> torch.Tensor:
    """[cols]: the column group of each input column (0 for tensor and channel)."""
    return torch.arange(cols, device=device) // schemes.column_width(args, cols)


@dataclasses.dataclass
class Prepared:
    """What the rows of a batch of matrices need from their Hessians; computed once, shared by every
    row slice."""

    hinv: torch.Tensor  # [B, d, d] upper Cholesky factor of the damped inverse, in the permuted order
    perm: torch.Tensor  # [B, d] column order of the solve (identity without activation ordering)
    dead: torch.Tensor  # [B, d] columns no calibration token touched
    damping: list  # per matrix: the dampening fraction that worked; None: round-to-nearest

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """As two tensors, to send to another rank."""
        return self.hinv, _pack_order(self.perm, self.dead, self.damping)

    @classmethod
    def unpack(cls, hinv: torch.Tensor, meta: torch.Tensor) -> "Prepared":
        return cls(hinv, *_unpack_order(meta, hinv.shape[-1]))


@dataclasses.dataclass
class Factored:
    """Wide Hessians (cholesky.cholesky_panels) half way to `Prepared`: their Cholesky factor, whose
    triangular inverse (in pieces that ranks can share) gives the inverse factor."""

    chol: torch.Tensor  # [B, d, d] lower Cholesky factor of the damped Hessian with rows and columns reversed
    perm: torch.Tensor  # perm, dead and damping as in Prepared
    dead: torch.Tensor
    damping: list

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chol, _pack_order(self.perm, self.dead, self.damping)

    @classmethod
    def unpack(cls, chol: torch.Tensor, meta: torch.Tensor) -> "Factored":
        return cls(chol, *_unpack_order(meta, chol.shape[-1]))


def _pack_order(perm: torch.Tensor, dead: torch.Tensor, damping: list) -> torch.Tensor:
    """[B, 2d + 1] fp64: the order, dead columns and damping in one tensor (exact: d < 2^53)."""
    damping = torch.tensor([[float("nan") if d is None else d] for d in damping], dtype=torch.float64,
                           device=perm.device)
    return torch.cat([perm.double(), dead.double(), damping], dim=1)


def _unpack_order(meta: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    damping = [None if math.isnan(v) else v for v in meta[:, 2 * d].tolist()]
    return meta[:, :d].long(), meta[:, d:2 * d].bool(), damping


def order(H: torch.Tensor, actorder):
    """Hessians [B, d, d] (fp32, changed in place) in the solve's column order, dead columns' diagonals set to 1;
    the order, the dead columns, and which Hessians no token reached."""
    batch, cols, _ = H.shape
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    if actorder:  # permuted into H itself: one copy at a time besides it
        perm = torch.argsort(diag, dim=-1, descending=True)
        columns = torch.gather(H, -1, perm.unsqueeze(-2).expand(-1, cols, -1))
        torch.gather(columns, -2, perm.unsqueeze(-1).expand(-1, -1, cols), out=H)
        del columns
    else:
        perm = torch.arange(cols, device=H.device).expand(batch, cols).contiguous()
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    dead = diag == 0
    untouched = dead.all(dim=-1)
    dead[untouched] = False
    diag.masked_fill_(dead, 1)
    return H, perm, dead, untouched


def damp(h: torch.Tensor, frac: float) -> torch.Tensor:
    damped = h.clone()
    damped.diagonal().add_(frac * torch.mean(torch.diag(h)))
    return damped


def factor(hessian: torch.Tensor | list[torch.Tensor], actorder, dampening_frac: float = 0.01
           ) -> Prepared | Factored:
    """The first O(d^3) step for a batch of Hessians [B, d, d] (or a list of [d, d] fp32 ones, handed over: the
    list is emptied and they are worked on in place, so that no copy of them outlives this): activation order,
    dead columns, and the damped inverse's upper Cholesky factor; for wide ones (cholesky.cholesky_panels) only
    the Cholesky factor, which `invert` completes. Not positive definite: retried with more damping. No token
    reached it (all zero), or no damping helped: round-to-nearest (an identity factor)."""
    H = as_batch(hessian).to(torch.float32) if isinstance(hessian, list) else hessian.to(torch.float32, copy=True)
    del hessian
    H, perm, dead, untouched = order(H, actorder)
    cols = H.shape[-1]
    wide = bool(cholesky_panels(cols))
    out, damping = [], []
    for b in range(H.shape[0]):
        f, frac = (None, None) if untouched[b] else _damped_factor(H[b], dampening_frac, wide)
        out.append(torch.eye(cols, device=H.device) if f is None else f)
        damping.append(None if f is None else frac)
    return (Factored if wide else Prepared)(as_batch(out), perm, dead, damping)


@one_thread()
def _damped_factor(h: torch.Tensor, frac: float, wide: bool) -> tuple[torch.Tensor | None, float]:
    for attempt in range(DAMPING_RETRIES + 1):
        f = frac if attempt == 0 else max(frac, 0.01) * 10**attempt
        if wide:  # in fp64: fp32 rounding here lands in the inverse factor's first rows, which GPTQ uses first
            out = blocked_cholesky(reversed_columns(damp(h, f)))
            info = 0 if out is not None else 1
        else:  # the peer's steps: Cholesky, inverse, Cholesky of the inverse
            chol, info = torch.linalg.cholesky_ex(damp(h, f))
            if info == 0:
                out, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
        if info == 0:
            return out, f
    return None, frac


def invert(factored: Prepared | Factored) -> Prepared:
    """`factor`'s result made ready to solve, on one rank: for wide Hessians, the triangular inverse of
    the Cholesky factor by the pieces that ranks can share."""
    if isinstance(factored, Prepared):
        return factored
    cols = factored.chol.shape[-1]
    hinv = [assemble((inverse_rows(L, s, e) for s, e in inverse_pieces(cols)), cols) for L in factored.chol]
    return Prepared(as_batch(hinv), factored.perm, factored.dead, factored.damping)


def as_batch(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one contiguous batch (one alone: no copy if contiguous; an upper Cholesky factor is a
    transposed view, which collectives refuse), the list emptied, so that only the batch holds them."""
    out = torch.stack(tensors) if len(tensors) > 1 else tensors[0].contiguous()[None]
    tensors.clear()
    return out


def prepare(hessian: torch.Tensor, actorder, dampening_frac: float = 0.01) -> Prepared:
    """The O(d^3) part for a batch of Hessians [B, d, d]: `factor`, then `invert`."""
    return invert(factor(hessian, actorder, dampening_frac))


def solve(weight: torch.Tensor, prep: Prepared, args: QuantizationArgs, block_size: int = 128,
          scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """The O(rows * d^2) part for a batch [B, rows, d] of any rows (rows are independent given `prep`): the
    fake-quantized weight, written into `out` where given. `scale`, `zero_point`: [B, rows, column groups] from
    `row_qparams` of the rows' modules; omitted, they come from these rows alone (per-row strategies: channel,
    group). Rows go in `passes`, so that the fp32 working set of a group of many experts' rows stays bounded."""
    if scale is None:
        scale, zero_point = qparams(weight, args)
        zero_point = None if args.symmetric else zero_point
    ranges = passes(*weight.shape, weight.device)
    if out is None and len(ranges) == 1:
        return _solve_rows(weight, prep, args, block_size, scale, zero_point)
    out = torch.empty_like(weight) if out is None else out
    for lo, hi in ranges:
        part = slice(lo, hi)
        out[:, part] = _solve_rows(weight[:, part], prep, args, block_size, scale[:, part],
                                   None if zero_point is None else zero_point[:, part])
    return out


def passes(batch: int, rows: int, cols: int, device="cpu") -> list[tuple[int, int]]:
    """The row ranges `solve` takes at a time: at most SOLVE_ELEMENTS weights of the batch each on the host,
    DEVICE_SOLVE_ELEMENTS on an accelerator (rows are independent: the passes do not change the bits)."""
    limit = SOLVE_ELEMENTS if torch.device(device).type == "cpu" else DEVICE_SOLVE_ELEMENTS
    step = max(1, limit // (batch * cols))
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def _solve_rows(weight: torch.Tensor, prep: Prepared, args: QuantizationArgs, block_size: int, scale: torch.Tensor,
                zero_point: torch.Tensor | None) -> torch.Tensor:
    batch, rows, cols = weight.shape
    perm = prep.perm
    if args.actorder:  # else the order is the identity: no gathers (each a copy of the pass)
        W = torch.gather(weight.to(torch.float32), -1, perm.unsqueeze(-2).expand(-1, rows, -1))
    else:
        W = weight.to(torch.float32, copy=True)
    g_idx = column_groups(cols, args, W.device)[perm]  # [B, d]
    W.masked_fill_(prep.dead.unsqueeze(-2), 0)
    Hinv = prep.hinv

    column_args = schemes.per_column(args)
    graphed = None  # on a GPU with more than one full block: a _GraphedLoop, or False where capture failed
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        full = i2 - i1 == block_size
        window = g_idx[:, i1:i2].unsqueeze(-2).expand(-1, rows, -1)
        block = [W[:, :, i1:i2].clone(), torch.zeros(batch, rows, i2 - i1, device=W.device), Hinv[:, i1:i2, i1:i2],
                 torch.gather(scale, -1, window), None if zero_point is None else torch.gather(zero_point, -1, window)]
        if graphed is None and _graphable(W) and full and cols > block_size:
            graphed = _GraphedLoop.capture(block, column_args) or False
        W1, Err1 = graphed(block) if graphed and full else _column_loop(*block, column_args)
        W[:, :, i1:i2] = W1
        W[:, :, i2:] -= torch.bmm(Err1, Hinv[:, i1:i2, i2:])

    if args.actorder:
        W = torch.gather(W, -1, torch.argsort(perm, dim=-1).unsqueeze(-2).expand(-1, rows, -1))
    return W.to(weight.dtype)


def _graphable(W: torch.Tensor) -> bool:
    return W.is_cuda


def _column_loop(W1, Err1, Hinv1, col_scale, col_zp, column_args) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's column loop over one block, in place: each column quantized, its error (kept in Err1) spread
    over the block's later columns."""
    batch, rows, width = W1.shape
    for i in range(width):
        w = W1[:, :, i]
        q = fake_quantize(w.reshape(-1, 1), col_scale[:, :, i].reshape(-1, 1),
                          None if col_zp is None else col_zp[:, :, i].reshape(-1, 1),
                          column_args).reshape(batch, rows)
        err = (w - q) / Hinv1[:, i, i].unsqueeze(-1)
        W1[:, :, i] = q
        Err1[:, :, i] = err
        W1[:, :, i + 1:] -= err.unsqueeze(-1) * Hinv1[:, i, i + 1:].unsqueeze(-2)
    return W1, Err1


class _GraphedLoop:
    """`_column_loop` as one CUDA graph, captured on a solve's first full block and replayed on the others:
    the very kernels (so the very bits) without Python launching the ~20 tiny ones of every column, which
    bounds the eager loop on a GPU. `capture` gives None where capturing fails: the loop then runs eagerly."""

    warned = False

    def __init__(self, static: list, graph):
        self.static, self.graph = static, graph

    @classmethod
    def capture(cls, block: list, column_args) -> "_GraphedLoop | None":
        static = [None if t is None else t.clone() for t in block]
        try:
            side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _column_loop(*static, column_args)  # warm-up; a graph records addresses, and replays refill them
                # capture_begin, not torch.cuda.graph, which collects garbage and empties the cache every time;
                # thread_local: the I/O thread may copy meanwhile
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    _column_loop(*static, column_args)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
        except Exception as e:  # any failure to capture leaves the eager loop, which is correct
            if not cls.warned:
                cls.warned = True
                log.warning("GPTQ's column loop could not be captured as a CUDA graph (%s); it runs eagerly", e)
            return None
        return cls(static, graph)

    def __call__(self, block: list) -> tuple[torch.Tensor, torch.Tensor]:
        for mine, new in zip(self.static, block):
            if mine is not None:
                mine.copy_(new)
        self.graph.replay()
        return self.static[0], self.static[1]


def quantize(weight: torch.Tensor, hessian: torch.Tensor, args: QuantizationArgs, block_size: int = 128,
             dampening_frac: float = 0.01, fused_global_scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, QParams, Prepared]:
    """GPTQ one weight matrix [rows, cols] against its normalized Hessian [cols, cols]; tensor group takes its
    fusion group's global scale (default: its own)."""
    g = fused_global_scale if fused_global_scale is not None else global_scale([weight], args)
    q = QParams(*qparams(weight, args, g), g)
    prep = prepare(hessian.unsqueeze(0), args.actorder, dampening_frac)
    scale, zp = row_qparams(q, args, weight.shape[0])
    w = solve(weight.unsqueeze(0), prep, args, block_size, scale[None], None if zp is None else zp[None])
    return w[0], q, prep
