"""The GPTQ math against llmcompressor's own solver and observer, on random problems."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from elastic_oneshot.quantization import cholesky, gptq


def problem(rows=48, cols=256, dead=(3, 77), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    x = torch.randn(512, cols, generator=g) * torch.linspace(0.1, 3, cols)
    x[:, list(dead)] = 0
    h = 2 * x.t() @ x / 8
    return w, h


def peer(w, h, args, block_size=128, damp=0.01):
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.observers import Observer

    obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    obs(w)
    qp = obs.get_qparams()
    q, _, fallback = quantize_weight(w.clone().unsqueeze(0), h.clone().unsqueeze(0), qp["scale"].unsqueeze(0),
                                     qp["zero_point"].unsqueeze(0), None, args, block_size, damp)
    return q[0], qp["scale"], qp["zero_point"], bool(fallback[0])


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("actorder", ["static", None])
@pytest.mark.parametrize("group_size", [64, None])
def test_matches_llmcompressor(symmetric, actorder, group_size):
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group" if group_size else "channel",
                            group_size=group_size, actorder=actorder, observer="memoryless_minmax")
    w, h = problem()
    ours, qp, prep = gptq.quantize(w, h, args, block_size=128, dampening_frac=0.01)
    q, scale, zp, fallback = peer(w, h, args)
    assert not fallback and prep.damping == [0.01]
    assert torch.equal(qp.scale, scale) and torch.equal(qp.zero_point, zp)
    same = (ours == q).float().mean().item()
    print(f"identical weights {same:.4%}")
    assert same > 0.999
    assert torch.all(ours[:, [3, 77]] == 0)  # dead columns


def test_shared_hessian_rows_stack():
    """Modules sharing a Hessian give the same bits solved together as solved apart, and as rows sliced across
    owners (rows are independent given the Hessian's factor: what makes every world size give the same bits)."""
    args = QuantizationArgs(num_bits=4, group_size=64, actorder="static", observer="memoryless_minmax")
    w, h = problem(rows=64)
    together, _, prep = gptq.quantize(w, h, args)
    apart = torch.cat([gptq.quantize(w[:40], h, args)[0], gptq.quantize(w[40:], h, args)[0]])
    assert torch.equal(together, apart)
    shared = gptq.Prepared.unpack(*prep.pack())  # as a slice owner receives it
    sliced = torch.cat([gptq.solve(w[None, :32], shared, args)[0],
                        gptq.solve(w[None, 32:], shared, args)[0]])
    assert torch.equal(together, sliced)


def test_indefinite_hessian_retries_damping_then_falls_back():
    args = QuantizationArgs(num_bits=4, group_size=64, observer="memoryless_minmax")
    w, h = problem(dead=())
    h -= torch.eye(h.shape[0]) * torch.diag(h).mean() * 0.05  # indefinite at damping 0.01
    _, _, prep = gptq.quantize(w, h, args, dampening_frac=0.01)
    assert prep.damping[0] is not None and prep.damping[0] > 0.01
    h_bad = -torch.eye(h.shape[0]) + torch.diag(torch.full((h.shape[0],), 0.5))
    r, _, prep = gptq.quantize(w, h_bad, args)
    assert prep.damping == [None]  # round-to-nearest, reported by the caller
    rtn = gptq.quantize(w, torch.eye(h.shape[0]), args)[0]
    assert torch.equal(r, rtn)


def test_batched_equals_one_at_a_time():
    """Equal-shape matrices (MoE experts) solved as one batch give what they give one by one."""
    args = QuantizationArgs(num_bits=4, group_size=64, actorder="static", observer="memoryless_minmax")
    problems = [problem(rows=32, cols=128, seed=s) for s in range(4)]
    w, h = torch.stack([p[0] for p in problems]), torch.stack([p[1] for p in problems])
    batched = gptq.solve(w, gptq.prepare(h, "static"), args)
    single = torch.stack([gptq.quantize(pw, ph, args)[0] for pw, ph in problems])
    assert torch.equal(batched, single)
    untouched = gptq.prepare(torch.zeros(1, 128, 128), "static")  # an expert no token reached
    assert untouched.damping == [None] and not untouched.dead.any()


@pytest.mark.parametrize("symmetric", [True, False])
def test_rows_solved_in_passes_equal_one_pass(symmetric, monkeypatch):
    """A group of many experts' rows is solved a pass of SOLVE_ELEMENTS weights at a time: the same bits as one
    pass (rows are independent given the Hessian's factor)."""
    args = QuantizationArgs(num_bits=4, group_size=64, actorder="static", symmetric=symmetric,
                            observer="memoryless_minmax")
    w, h = problem(rows=300, cols=256)
    prep = gptq.prepare(h[None], "static")
    whole = gptq.solve(w[None], prep, args)
    monkeypatch.setattr(gptq, "SOLVE_ELEMENTS", 64 * 256)
    assert torch.equal(gptq.solve(w[None], prep, args), whole)


@pytest.mark.slow
def test_wide_hessian_inverse_in_pieces(monkeypatch):
    """Above SHARED_INVERSE_COLS the inverse comes from one (fp64) Cholesky and pieces of a triangular
    inverse that ranks can share: its codes equal an fp64 reference's. The threshold is lowered to 2048 columns
    (10 Cholesky panels, 5 inverse pieces): the pieces are the same code at any width, and at the product's 8704
    columns the fp64 reference alone took minutes (there the peer's fp32 steps drift: 98.4 % of its codes agree,
    at one thread)."""
    monkeypatch.setattr(cholesky, "SHARED_INVERSE_COLS", 2048)
    args = QuantizationArgs(num_bits=4, group_size=128, actorder="static", observer="memoryless_minmax")
    cols = cholesky.SHARED_INVERSE_COLS + 512
    w, h = problem(rows=16, cols=cols, dead=(5,))
    ours, _, prep = gptq.quantize(w, h, args)
    assert len(cholesky.inverse_pieces(cols)) == cols // cholesky.INVERSE_PIECE and prep.damping == [0.01]
    p = prep.perm[0]
    H = h[p][:, p].double()
    H.diagonal()[prep.dead[0]] = 1
    H.diagonal().add_(0.01 * H.diagonal().mean())
    exact = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    reference = gptq.solve(w[None], gptq.Prepared(exact[None], prep.perm, prep.dead, prep.damping), args)[0]
    q = peer(w, h, args)[0]
    same, peer_same = ((ours == reference).float().mean().item(), (q == reference).float().mean().item())
    print(f"wide Hessian ({cols} columns), weights identical to an fp64 inverse's: ours {same:.4%}, "
          f"llmcompressor's {peer_same:.4%}")
    assert same == 1.0
    assert (ours == q).float().mean() > 0.99


@pytest.mark.parametrize("cols", [576, 1000])
def test_hessian_triangle_equals_full_product(cols):
    """The Hessian built from its lower triangle by row blocks is the peer's full per-sequence product,
    bit for bit (what keeps parity while saving a third of the FLOPs)."""
    x = torch.randn(3, 512, cols, generator=torch.Generator().manual_seed(cols))
    full = torch.zeros(cols, cols)
    for seq in x:
        inp = 2 ** 0.5 * seq.t()
        full += inp.matmul(inp.t())
    lower = torch.zeros(cols, cols)
    gptq.hessian_add(lower, x, 512)
    assert torch.equal(gptq.symmetric(lower), full)
    total = torch.randn(cols, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = total + gptq.symmetric(lower)
    gptq.fold(total, lower)  # the chunk's sums into the fp64 total by row blocks, in place: the same bits
    assert torch.equal(total, expected)
