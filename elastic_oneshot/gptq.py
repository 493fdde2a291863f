"""GPTQ (Frantar et al., 2022) with LLM Compressor's semantics. Pure math: no I/O, no processes.

Matches llmcompressor 0.14's GPTQModifier: Hessian 2/n * sum x x^T over the n calibration sequences,
scales from the original weight's min/max (fixed during the solve), static activation ordering,
dead columns zeroed, damping 0.01 * mean(diag H). Two differences, both deliberate: a Cholesky
failure retries with more damping before falling back to round-to-nearest, and modules that share
an input (and so a Hessian) are solved together as one matrix, their rows stacked.
"""

import dataclasses
import math
from copy import copy

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

DAMPING_RETRIES = 3  # each retry multiplies the damping fraction by 10


def hessian_add(acc: torch.Tensor, x: torch.Tensor) -> int:
    """acc (fp64) += sum over the sequences in `x` [batch, tokens, features] of 2 X^T X; returns the
    number of sequences.

    Each sequence's product is computed exactly as the peer computes it (fp32, scaled by sqrt 2, same
    operand layout), so the terms are bitwise the peer's; GPTQ's rounding decisions are chaotic in
    the Hessian's last bits, and this keeps parity. The running sum is fp64, so the total hardly
    depends on how sequences are split across chunks and ranks.
    """
    x = x.reshape(-1, *x.shape[-2:]) if x.dim() > 2 else x.unsqueeze(0)
    for seq in x:
        inp = math.sqrt(2) * seq.t().to(torch.float32)
        acc += inp.matmul(inp.t())
    return x.shape[0]


def qparams(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point from the weight's min and max per group (the peer's memoryless_minmax)."""
    if args.strategy == QuantizationStrategy.GROUP:
        w = weight.unflatten(-1, (-1, args.group_size))
    else:
        w = weight.unsqueeze(-2)
    return calculate_qparams(w.amin(-1), w.amax(-1), args)


@dataclasses.dataclass
class Result:
    weight: torch.Tensor  # fake-quantized weight: exactly representable by (codes, scale, zero point)
    scale: torch.Tensor
    zero_point: torch.Tensor
    loss: float


@dataclasses.dataclass
class Prepared:
    """What the rows of a weight need from their Hessian; computed once, shared by every row slice."""

    hinv: torch.Tensor  # upper Cholesky factor of the damped inverse, in the permuted order
    perm: torch.Tensor  # column order of the solve (identity without activation ordering)
    dead: torch.Tensor  # columns no calibration token touched (bool)
    damping: float | None  # dampening fraction that made H positive definite; None: round-to-nearest

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """As two tensors, to send to another rank."""
        damping = float("nan") if self.damping is None else self.damping
        meta = torch.cat([self.perm.double(), self.dead.double(),
                          torch.tensor([damping], dtype=torch.float64, device=self.perm.device)])
        return self.hinv, meta

    @classmethod
    def unpack(cls, hinv: torch.Tensor, meta: torch.Tensor) -> "Prepared":
        d = hinv.shape[0]
        damping = meta[2 * d].item()
        return cls(hinv, meta[:d].long(), meta[d:2 * d].bool(), None if math.isnan(damping) else damping)


def inverse_cholesky(h: torch.Tensor, frac: float) -> tuple[torch.Tensor | None, float]:
    """Upper Cholesky factor of (H + damp*I)^-1, retrying with more damping when H is not positive definite."""
    mean_diag = torch.mean(torch.diag(h))
    for attempt in range(DAMPING_RETRIES + 1):
        f = frac if attempt == 0 else max(frac, 0.01) * 10**attempt
        damped = h.clone()
        damped.diagonal().add_(f * mean_diag)
        chol, info = torch.linalg.cholesky_ex(damped)
        if info == 0:
            inv, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
            if info == 0:
                return inv, f
    return None, frac


def prepare(hessian: torch.Tensor, actorder, dampening_frac: float = 0.01) -> Prepared:
    """The O(d^3) part: activation order, dead columns, and the damped inverse's Cholesky factor."""
    H = hessian.to(torch.float32).clone()
    cols = H.shape[0]
    perm = torch.arange(cols, device=H.device)
    if actorder:
        perm = torch.argsort(torch.diag(H), descending=True)
        H = H[perm][:, perm]
    dead = torch.diag(H) == 0
    H.diagonal()[dead] = 1
    hinv, damping = inverse_cholesky(H, dampening_frac)
    if hinv is None:
        hinv, damping = torch.eye(cols, device=H.device), None
    return Prepared(hinv, perm, dead, damping)


def solve(weight: torch.Tensor, prep: Prepared, args: QuantizationArgs, block_size: int = 128) -> Result:
    """The O(rows * d^2) part, for any subset of a matrix's rows (rows are independent given `prep`)."""
    scale, zero_point = qparams(weight, args)
    rows, cols = weight.shape
    perm = prep.perm
    W = weight.to(torch.float32)[:, perm]
    if args.strategy == QuantizationStrategy.GROUP:
        g_idx = (torch.arange(cols, device=W.device) // args.group_size)[perm]
        col_scale, col_zp = scale[:, g_idx], zero_point[:, g_idx]
    else:
        col_scale, col_zp = scale.expand(rows, cols), zero_point.expand(rows, cols)
    zp_used = None if args.symmetric else col_zp
    W[:, prep.dead] = 0
    Hinv = prep.hinv

    column_args = copy(args)
    column_args.strategy = QuantizationStrategy.CHANNEL
    loss = torch.zeros(rows, device=W.device)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            q = fake_quantize(w.unsqueeze(1), col_scale[:, i1 + i:i1 + i + 1],
                              None if zp_used is None else zp_used[:, i1 + i:i1 + i + 1],
                              column_args).squeeze(1)
            err = (w - q) / Hinv1[i, i]
            W1[:, i] = q
            Err1[:, i] = err
            loss += err.square() / 2
            W1[:, i + 1:] -= err.unsqueeze(1) * Hinv1[i, i + 1:].unsqueeze(0)
        W[:, i1:i2] = W1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    W = W[:, torch.argsort(perm)]
    return Result(W.to(weight.dtype), scale.to(weight.dtype), zero_point, float(loss.sum()))


def quantize(weight: torch.Tensor, hessian: torch.Tensor, args: QuantizationArgs,
             block_size: int = 128, dampening_frac: float = 0.01) -> tuple[Result, Prepared]:
    """GPTQ one weight matrix [rows, cols] against its normalized Hessian [cols, cols]."""
    prep = prepare(hessian, args.actorder, dampening_frac)
    return solve(weight, prep, args, block_size), prep
