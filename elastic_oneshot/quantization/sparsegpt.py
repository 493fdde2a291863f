"""SparseGPT (Frantar and Alistarh, 2023) as llmcompressor 0.14's SparseGPTModifier runs it. Pure math: no I/O, no
processes.

It shares GPTQ's first half: the Hessian of a module's inputs (gptq.hessian_add, summed then divided by the
number of samples, where the peer keeps a running average: the same matrix up to rounding) and its inverse's upper
Cholesky factor (gptq.prepare without activation order: dead columns, damping, the retries on failure). Its column
loop is its own: instead of rounding a column, it zeroes the weights of a mask and spreads their error over the
later columns as GPTQ does. Unstructured masks are chosen per block of columns over all rows (a threshold on
w^2 / d^2 at the sparsity's quantile), so a module is solved whole on one rank; N:M masks per row (the N least of
each M columns, chosen as the loop reaches them), so rows may be split across ranks as GPTQ's are.
"""

import torch

from elastic_oneshot.quantization import gptq
from elastic_oneshot.quantization.gptq import Prepared


@torch.no_grad()
def sparsify(weight: torch.Tensor, prep: Prepared, sparsity: float, n: int = 0, m: int = 0, block_size: int = 128
             ) -> torch.Tensor:
    """The pruned weight [rows, cols] (in the weight's dtype): `prep` from gptq.prepare(H[None], None, damping)
    (one matrix, identity order); `n`, `m` 0 for an unstructured mask of `sparsity`, else N of every M pruned.
    Dead columns are zeroed. The steps are the peer's, in fp32, so that on the same inverse factor the result is
    its bit for bit: every element sees the same operations in the same order. The weight is held transposed, so
    that the loop's per-column steps each touch one contiguous line (the peer's strided columns cost more)."""
    hinv, dead = prep.hinv[0], prep.dead[0]
    W = weight.to(torch.float32, copy=True)
    W[:, dead] = 0
    rows, cols = W.shape
    Wt = W.t().contiguous()
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        h1 = hinv[i1:i2, i1:i2]
        w1 = Wt[i1:i2].clone()
        kept = torch.empty_like(w1)
        # in the peer's layout: the block's update is its matmul, same bits
        errors = torch.empty(rows, i2 - i1, device=W.device)
        diag = torch.diag(h1).reshape(1, -1)
        if n == 0:
            score = w1.t() ** 2 / diag**2
            threshold = torch.sort(score.flatten())[0][int(score.numel() * sparsity)]
            mask = score <= threshold
        else:
            mask = torch.zeros(rows, i2 - i1, dtype=torch.bool, device=W.device)
        for i in range(i2 - i1):
            if n and i % m == 0:
                score = w1[i:i + m].t() ** 2 / diag[:, i:i + m] ** 2
                mask.scatter_(1, i + torch.topk(score, n, dim=1, largest=False)[1], True)
            w = w1[i]
            q = w.masked_fill(mask[:, i], 0)
            kept[i] = q
            err = (w - q) / h1[i, i]
            w1[i:] -= h1[i, i:].unsqueeze(1) * err
            errors[:, i] = err
        Wt[i1:i2] = kept
        Wt[i2:] -= errors.matmul(hinv[i1:i2, i2:]).t()
    return Wt.t().contiguous().to(weight.dtype)  # in the weight's layout: a forward's matmul bits depend on it


def sparsify_group(weights: dict[str, torch.Tensor], hessian: torch.Tensor, sparsity: float, n: int, m: int,
                   block_size: int, dampening_frac: float) -> dict[str, torch.Tensor]:
    """The pruned weights of modules sharing `hessian` (by name), its inverse factored once. N:M masks are chosen
    per row, so the modules' rows go through one column loop; an unstructured mask's threshold is each module's own."""
    prep = gptq.prepare(hessian[None], None, dampening_frac)
    if not n:
        return {name: sparsify(w, prep, sparsity, 0, 0, block_size) for name, w in weights.items()}
    stacked = sparsify(torch.cat(list(weights.values())), prep, sparsity, n, m, block_size)
    parts = stacked.split([w.shape[0] for w in weights.values()])
    return {name: part.clone() for name, part in zip(weights, parts)}  # tensors of their own: the files share none
