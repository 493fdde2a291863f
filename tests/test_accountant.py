"""The accountant of GPU memory and operations on paper (testing/ledger.py, testing/accountant.py, bench/gpu.py
--device cpu), and the memory cuts it measured (gptq.Lower): they keep the bits."""

import os
import subprocess
import sys

import pytest
import torch

from elastic_oneshot.quantization import gptq
from elastic_oneshot.testing.gpu import peer_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def run_paper(code: str) -> str:
    """`code` in a process of its own (the fake accelerator is registered once per process), its stdout."""
    proc = subprocess.run([sys.executable, "-c", "import torch\nfrom elastic_oneshot.testing.ledger import *\n" + code],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_storage_counts_once_from_its_allocation_to_its_release():
    out = run_paper("""
ledger = Ledger()
with paper(ledger), torch.inference_mode():
    gpu = accelerator()
    a = torch.empty(1024, 1024, device=gpu)            # 4 MiB
    views = [a[1:], a.t(), a.view(-1)]                  # no more memory
    b = (a * 2).to(torch.bfloat16)                      # 4 MiB, then 2 MiB once the fp32 product is gone
    host = torch.empty(1024, 1024)                      # on the host: not counted
    with ledger.phase("inner"):
        c = torch.zeros(2048, 1024, device=gpu)         # 8 MiB: the peak, 14 MiB
        del c
    del a
    print(ledger.live, views[0].device, b.device, host.device)
    del views
    print(ledger.live)
report = ledger.report()
print(report["peak"], report["phases"]["inner"]["peak"], report["phases"]["inner"]["ops"])
print(sorted(ledger.by_op.items()))
""").split("\n")
    MB = MiB
    assert out[0] == f"{6 * MB} gpu:0 gpu:0 cpu"  # a's storage is still held by its views
    assert out[1] == str(2 * MB)
    assert out[2] == f"{14 * MB} {14 * MB} 1"
    assert out[3] == "[('_to_copy', 1), ('mul', 1), ('zeros', 1)]"  # views and allocations launch nothing


def test_values_where_control_flow_needs_them_and_a_loud_stop_elsewhere():
    out = run_paper("""
ledger = Ledger()
with paper(ledger):
    gpu = accelerator()
    index = torch.tensor([3, 1, 3, 0], device=gpu)              # known
    print(torch.bincount(index, minlength=5).tolist(), index.argsort(stable=True).tolist())
    print(torch.ones(6, 4, device=gpu)[index > 1].shape)        # a mask with values selects its rows
    scores = torch.empty(4, 8, device=gpu)                      # no values: a router's
    print(scores.topk(2).indices.tolist())                      # tokens to experts in turn
    info = torch.linalg.cholesky_ex(torch.empty(3, 3, device=gpu)).info
    print(bool(info == 0), bool(torch.isnan(scores).any()))     # the ordinary path
    print(int((scores > 0).long().sum()))                      # comparisons of floats are false
    try:
        int(scores.argmax())                                    # a value from float data: not assumed
    except RuntimeError as e:
        print(str(e).split(" at ")[0])
""").split("\n")
    assert out[0] == "[1, 1, 0, 2, 0] [3, 1, 0, 2]"
    assert out[1] == "torch.Size([2, 4])"
    assert out[2] == "[[0, 1], [2, 3], [4, 5], [6, 7]]"
    assert out[3] == "True False"
    assert out[4] == "0"
    assert out[5] == "the ledger has no value"


@pytest.mark.parametrize("cols", [576, 1000])
@pytest.mark.parametrize("chunks", [1, 3])
def test_lower_triangles_give_the_whole_matrices_bits(cols, chunks):
    """Calibration's Hessians kept as lower triangles (a chunk's fp32 sums, the fp64 total) give, normalized and
    made whole, the whole matrices' bits: what keeps every checkpoint's bytes while halving their memory."""
    g = torch.Generator().manual_seed(cols)
    total, whole = gptq.Lower(cols, torch.float64, "cpu"), torch.zeros(cols, cols, dtype=torch.float64)
    for _ in range(chunks):
        x = torch.randn(2, 512, cols, generator=g)
        partial, lower = gptq.Lower(cols, torch.float32, "cpu"), torch.zeros(cols, cols)
        gptq.hessian_add(partial, x, 512)
        gptq.hessian_add(lower, x, 512)
        gptq.fold(total, partial)
        gptq.fold(whole, lower)
    assert total.packed.numel() < 0.7 * cols * cols  # 192-row strips: (1 + 192 / cols) / 2 of the whole
    gptq.packed(total).div_(7)
    assert torch.equal(gptq.dense(total), whole.div_(7).to(torch.float32))


def test_factor_of_handed_over_hessians_equals_the_copying_one():
    h = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    h = h.t() @ h
    kept = gptq.factor(h[None], "static")
    handed = [h.clone()]
    assert torch.equal(gptq.factor(handed, "static").hinv, kept.hinv) and not handed


def paper_bench(*args) -> str:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_bench_on_paper_prints_both_sides_by_phase_and_the_modeled_seconds(tmp_path):
    """bench/gpu.py --device cpu, tiny shapes: what it prints at full size (about a minute)."""
    out = paper_bench("--memory", "--ops", "--tiny", "--samples", "2", "--seq-len", "128", "--workdir", str(tmp_path))
    print(out)
    for name in ("llama3-8b", "qwen3-30b-a3b"):
        assert f"{name}: one layer (tiny), 2 x 128 tokens: peak GPU memory (GB) by phase" in out
        line = next(x for x in out.splitlines() if x.startswith(f"memory {name}: ours "))
        if peer_available():
            assert ", peer " in line and ", ratio " in line
    for phase in ("calibrate", "Hessians", "GPTQ", "propagate"):
        assert f"  {phase}" in out
    assert "modeled qwen3-30b-a3b: " in out and " s per layer on an H100 (" in out and " TFLOP, " in out
