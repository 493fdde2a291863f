"""The weight-parallel plan: complete, dependency-ordered, and better than the peer's packing."""

import pytest

from elastic_oneshot.errors import UsageError
from elastic_oneshot.quantization.cholesky import cholesky_panels, inverse_pieces
from elastic_oneshot.quantization.plan import (
    HESSIAN_BYTES,
    SOLVING_BYTES,
    Group,
    StepKind,
    make_plan,
    memory_batches,
    parse_bytes,
    peer_plan,
)

LLAMA_3_8B = [Group((("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024)), 4096), Group((("o_proj", 4096),), 4096),
              Group((("gate_proj", 14336), ("up_proj", 14336)), 4096), Group((("down_proj", 4096),), 14336)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_plan_covers_every_row_and_piece_once_after_its_inputs(world):
    plan = make_plan(LLAMA_3_8B, world)
    assert plan == make_plan(LLAMA_3_8B, world)  # a pure function of the shapes: every rank agrees
    end = {}
    for s in plan.steps:
        end.setdefault((s.group.name, s.kind), []).append(s.begin + s.cost)
    for g in LLAMA_3_8B:
        mine = [s for s in plan.steps if s.group is g]
        rows = sorted((s.start, s.end) for s in mine if s.kind in (StepKind.WHOLE, StepKind.SOLVE))
        assert rows[0][0] == 0 and rows[-1][1] == g.rows and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
        if plan.shared(g):
            pieces = sorted((s.start, s.end) for s in mine if s.kind == StepKind.INVERT)
            assert pieces == inverse_pieces(g.cols)
            panels = {(s.start, s.end): s for s in mine if s.kind == StepKind.PANEL}
            if panels:  # spread: every panel once, after every update of its column, which follows its panel
                assert sorted(panels) == cholesky_panels(g.cols)
                for u in (s for s in mine if s.kind == StepKind.UPDATE):
                    source, target = panels[next(k for k in panels if k[0] == u.panel)], panels[(u.start, u.end)]
                    assert source.begin + source.cost <= u.begin and u.begin + u.cost <= target.begin
                    assert u.rank == target.rank
                factored = {s.end: s.begin + s.cost for s in panels.values()}
                assert all(s.begin >= max(t for e, t in factored.items() if e - 1 < s.end)
                           for s in mine if s.kind == StepKind.INVERT)
            else:
                factored = max(end[(g.name, StepKind.FACTOR)])
                assert all(s.begin >= factored for s in mine if s.kind == StepKind.INVERT)
            inverted = max(end.get((g.name, StepKind.INVERT), [0.0]))
            assert all(s.begin >= inverted for s in mine if s.kind == StepKind.SOLVE)
    for rank in range(world):  # a rank's steps run back to back in plan order
        mine = [s for s in plan.steps if s.rank == rank]
        assert all(a.begin + a.cost <= b.begin + 1e-9 for a, b in zip(mine, mine[1:]))
    assert plan.steps == sorted(plan.steps, key=lambda s: s.begin)


def test_sharing_the_wide_inverse_beats_the_peers_packing():
    serial, peer_serial = make_plan(LLAMA_3_8B, 1).makespan, peer_plan(LLAMA_3_8B, 1).makespan
    ours, peer = serial / make_plan(LLAMA_3_8B, 4).makespan, peer_serial / peer_plan(LLAMA_3_8B, 4).makespan
    print(f"\nLlama-3-8B layer at W=4, modeled: ours {ours:.2f}x, peer's packing {peer:.2f}x")
    assert ours > 1.5 * peer
    assert {s.kind for s in make_plan(LLAMA_3_8B, 4).steps} >= {StepKind.WHOLE, StepKind.PANEL, StepKind.UPDATE,
                                                                StepKind.INVERT, StepKind.SOLVE}


def test_the_plan_of_identical_layers_is_printed_once(tmp_path):
    """`elastic-oneshot plan` on a config alone (Llama-3-8B's shapes, 32 layers): one plan for layers 0-31."""
    import transformers

    from elastic_oneshot.surface.api import plan

    transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256).save_pretrained(tmp_path)
    lines = plan(str(tmp_path / "config.json"), 4)
    print("\n" + "\n".join(lines))
    assert "AMD EPYC" in lines[0] and lines[1] == "layers 0-31:" and len(lines) == 2 + 4 + 1
    assert not any(line.startswith("layer ") for line in lines)


def test_memory_batches_keep_each_batch_within_the_budget():
    groups = [Group(((f"experts.{i}.down_proj", 64),), 100) for i in range(5)]
    one = HESSIAN_BYTES * 100**2
    assert memory_batches(groups, 5 * one) == [groups]
    assert memory_batches(groups, 2 * one + 1) == [groups[0:2], groups[2:4], groups[4:]]
    assert memory_batches(groups, 1) == [[g] for g in groups]  # a group larger than the budget goes alone
    assert memory_batches([], 1) == [[]]
    streamed = one + (2 + SOLVING_BYTES) * 64 * 100  # bf16 weights read with their batch, solved in fp32
    assert memory_batches(groups, 2 * streamed - 1, itemsize=2) == [[g] for g in groups]
    assert memory_batches(groups, 2 * streamed, itemsize=2) == [groups[0:2], groups[2:4], groups[4:]]


def test_max_memory_is_a_size_or_one_line():
    assert parse_bytes("24GB") == 24 * 10**9 and parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes(4096) == 4096
    for bad in ("lots", "0", "-1GB", "3 furlongs", "GB"):
        with pytest.raises(UsageError, match=r"--max-memory .* is not a size in bytes"):
            parse_bytes(bad)
