"""The inverse factor of a wide Hessian, in fixed pieces that ranks can share. Pure math: no I/O, no processes.

GPTQ needs U, the upper Cholesky factor of H^-1. For Hessians wider than SHARED_INVERSE_COLS it comes from
one fp64 Cholesky of H with rows and columns reversed (L, by column panels, right-looking) and a triangular
inverse of L (by row pieces): reversing L^-1 gives U. The pieces are fixed by the width alone, so the bits
never depend on how many ranks compute them (plan.py deals them out; gptq.py does them all on one rank).
"""

import contextlib

import torch

SHARED_INVERSE_COLS = 8192  # wider Hessians get their Cholesky and inverse in pieces that ranks can share
CHOLESKY_PANEL = 256  # columns per panel of the Cholesky factor, and
INVERSE_PIECE = 512  # rows per piece of its inverse: fixed, so results never depend on the world size


@contextlib.contextmanager
def one_thread():
    """LAPACK's Cholesky, Cholesky inverse and triangular solves give other bits at other thread counts (plain
    GEMMs do not): run inside on one thread, so that a job gives the same bits at any thread count per rank,
    and a replay on another machine shape reproduces them. Usable as a decorator."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pieces(cols: int, size: int) -> list[tuple[int, int]]:
    return [] if cols <= SHARED_INVERSE_COLS else [(j, min(j + size, cols)) for j in range(0, cols, size)]


def cholesky_panels(cols: int) -> list[tuple[int, int]]:
    """Column pieces of a wide Hessian's Cholesky factor; none for the others, whose inverse gptq.factor
    computes whole with the peer's very steps (so their codes stay bit-identical to the peer's)."""
    return _pieces(cols, CHOLESKY_PANEL)


def inverse_pieces(cols: int) -> list[tuple[int, int]]:
    """Row pieces of a wide Hessian's triangular inverse; none for the others."""
    return _pieces(cols, INVERSE_PIECE)


def reversed_columns(damped: torch.Tensor) -> list[torch.Tensor]:
    """The damped Hessian with rows and columns reversed, in fp64, as the lower parts of its column pieces
    (piece j: rows start_j and below): what the blocked Cholesky works on, one piece per owner. Each piece is
    cut from `damped` before it is flipped and widened, so no whole fp64 copy is ever held."""
    cols = damped.shape[-1]
    return [damped[:cols - s, cols - e:cols - s].flip(0, 1).double() for s, e in cholesky_panels(cols)]


@one_thread()
def cholesky_panel(column: torch.Tensor) -> torch.Tensor:
    """Piece k of L from its column, with every earlier panel's update applied; NaN if not positive definite."""
    width = column.shape[-1]
    top, info = torch.linalg.cholesky_ex(column[:width])
    if info != 0:
        return torch.full_like(column, float("nan"))
    below = torch.linalg.solve_triangular(top.mT, column[width:], upper=True, left=False)
    return torch.cat([top, below]).contiguous()


def cholesky_update(column: torch.Tensor, panel: torch.Tensor, offset: int):
    """Column piece j -= panel k's rows at and below j times its rows of piece j (offset: j's start minus k's)."""
    column -= panel[offset:] @ panel[offset:offset + column.shape[-1]].mT


def blocked_cholesky(columns: list[torch.Tensor]) -> torch.Tensor | None:
    """The lower Cholesky factor (fp32) from `reversed_columns` (consumed), right-looking by pieces: the very
    steps that ranks share, on one rank. None if not positive definite."""
    spans, panels = cholesky_panels(sum(c.shape[-1] for c in columns)), []
    for k, (start, _) in enumerate(spans):
        panels.append(cholesky_panel(columns[k]))
        columns[k] = None  # done with: the panels replace the columns as they go
        for j in range(k + 1, len(spans)):
            cholesky_update(columns[j], panels[k], spans[j][0] - start)
    return lower_factor(panels)


def lower_factor(panels: list[torch.Tensor]) -> torch.Tensor | None:
    cols = panels[0].shape[0]
    if any(p.isnan().any() for p in panels):
        return None
    chol = torch.zeros(cols, cols, dtype=torch.float32, device=panels[0].device)
    for (start, end), panel in zip(cholesky_panels(cols), panels):
        chol[start:, start:end] = panel
    return chol


@one_thread()
def inverse_rows(chol: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of L^-1, columns up to `end` (those after are 0): they need only L[:end, :end],
    the panels up to `end`, so they can start while the Cholesky still runs; pieces are independent."""
    eye = torch.zeros(end - start, end, device=chol.device, dtype=chol.dtype)
    eye[:, start:].fill_diagonal_(1)
    return torch.linalg.solve_triangular(chol[:end, :end], eye, upper=False, left=False).contiguous()


def assemble(pieces: list[torch.Tensor], cols: int) -> torch.Tensor:
    """The upper Cholesky factor of H^-1 from the pieces of L^-1 (L from the reversed H): reversing
    rows and columns of L^-1 gives U with U^T U = H^-1. One factorization and one triangular inverse,
    where the peer does three O(d^3) steps; equal up to rounding. Each piece goes reversed into its place
    (`pieces` may be a generator: one piece is held at a time)."""
    upper = None
    for (start, end), piece in zip(inverse_pieces(cols), pieces):
        if upper is None:
            upper = piece.new_zeros(cols, cols)
        upper[cols - end:cols - start, cols - end:] = piece.flip(0, 1)
    return upper
