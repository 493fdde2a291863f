"""`plan --fleet`: the model's pieces on hand-computed cases, the Monte Carlo's edges (no preemption, certain
preemption), the command line on configs of a tiny dense model and a tiny Qwen3-MoE, and `--calibrate` on a tiny
model's weights."""

import dataclasses
import json
import math
import os
import re

import pytest

from elastic_oneshot.quantization.recipe import Recipe
from elastic_oneshot.surface import fleet as F
from elastic_oneshot.surface import preemption as P
from elastic_oneshot.surface.cli import main
from elastic_oneshot.testing.runs import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = F.ACCELERATORS["H100"]
TOKENS = 8 * 1000  # samples x seq_len: one chunk, on one rank
# Per token flops that take round seconds on one H100 at the model's efficiencies: 1 s calibrating, 1 s of
# Hessians, 0.5 s propagating; 1 GB of weights loads in 1 s at 1 GB/s.
LAYER = F.LayerWork(calibrate_flops=H100.bf16_tflops * 1e12 * F.FORWARD_EFFICIENCY / TOKENS,
                    propagate_flops=H100.bf16_tflops * 1e12 * F.FORWARD_EFFICIENCY / TOKENS / 2,
                    hessian_flops=H100.fp32_tflops * 1e12 * F.FP_EFFICIENCY / TOKENS,
                    expert_calls=0, weight_bytes=10**9, compressed_bytes=5e8)
FLEET = F.Fleet(samples=8, seq_len=1000, nodes=(1, 1), gpus_per_node=1, mtbp_hours=1.0, trials=50)
REPLACEMENT_S = FLEET.replacement_minutes * 60


def model(layers: int = 10, layer: F.LayerWork = LAYER) -> F.ModelWork:
    return F.ModelWork("hand", hidden=1000, itemsize=2, layers=[layer] * layers)


def test_a_layers_seconds_by_hand():
    s = F.layer_seconds(LAYER, FLEET, 1)
    assert s == pytest.approx({"load": 1.0, "calibrate": 1.0, "hessian": 1.0, "gptq": 0.0, "propagate": 0.5,
                               "commit": 0.5})
    # Twice the ranks: the busiest rank still holds the one chunk; twice the nodes write the commit.
    assert F.layer_seconds(LAYER, FLEET, 2) == pytest.approx({**s, "commit": 0.25})


def test_no_preemption_is_the_plain_sum_of_the_layers_plus_start_up():
    tl = F.timeline(model(), F.Fleet(**{**FLEET.__dict__, "mtbp_hours": math.inf}), 1)
    plain = F.STARTUP_S + 10 * 3.5 + 0.5 + 2 * 10 * 5e8 / 1e9  # start-up, layers, the last commit, the export
    assert P.uninterrupted(tl) == pytest.approx(plain, rel=1e-12)
    wall, paid = P.trial({1: tl}, 1, 1, REPLACEMENT_S, _drawn())
    assert (wall, paid) == (pytest.approx(plain, rel=1e-12), pytest.approx(plain, rel=1e-12))


def test_a_commit_slower_than_the_next_layer_delays_it():
    tl = F.timeline(model(3, F.LayerWork(**{**LAYER.__dict__, "compressed_bytes": 5e9})), FLEET, 1)
    assert tl.cum == pytest.approx([0.0, 3.5, 3.5 + 5.0, 3.5 + 10.0])  # each commit 5 s, behind a 3.5 s layer


def test_a_rate_of_zero_has_no_spread():
    never = F.Fleet(**{**FLEET.__dict__, "mtbp_hours": math.inf, "nodes": (1, 3)})
    r = F.report(model(), never)
    for row in r["rows"]:
        assert row["finishes"] and row["p10_s"] == row["p90_s"] == pytest.approx(row["uninterrupted_s"], rel=1e-12)
        assert row["expected_s"] == pytest.approx(row["p10_s"], rel=1e-12)
        assert row["from_scratch"]["p10_s"] == row["from_scratch"]["p90_s"]
    assert r["fleet"]["mtbp_hours"] is None and json.dumps(r, allow_nan=False)  # plain JSON, no Infinity


def test_one_preemption_by_hand():
    """One node, preempted 40 s after it started, 10 s into its layers: layer 2 is in flight (3 s into it, so layer
    1's commit is written): layers 0 and 1 are kept. The replacement comes 300 s after; after rendezvous and
    start-up the replay from the embeddings through layers 0 and 1 (1 s load + 0.5 s propagation each) precedes
    layer 2."""
    tl = F.timeline(model(), FLEET, 1)
    # A boundary is every token's hidden state: samples x seq_len x hidden x itemsize bytes at the storage's rate;
    # boundaries every Young and Daly's interval: sqrt(2 x write x mean time between preemptions) / the layer's 3.5 s
    write_s = FLEET.samples * FLEET.seq_len * 1000 * 2 / (FLEET.storage_gbps * 1e9)
    interval = round(math.sqrt(2 * write_s * FLEET.mtbp_hours * 3600) / 3.5)
    assert tl.write_s == pytest.approx(write_s) and tl.interval[0] == interval == 3  # none durable but the embeddings'
    wall, paid = P.trial({1: tl}, 1, 1, REPLACEMENT_S, _drawn(40.0, 1e12))
    resumed = 40 + 300 + P.RENDEZVOUS_S + F.STARTUP_S + 2 * 1.5
    assert wall == pytest.approx(resumed + 8 * 3.5 + 10.5)
    assert paid == pytest.approx(wall - 300)  # no node was paid while the replacement came


def test_a_restore_replays_each_chunk_as_its_boundary_arrives():
    """From a boundary, the download and the replay are a pipeline over the rank's chunks; from the embeddings,
    the replay alone."""
    tl = F.timeline(model(), FLEET, 1)
    assert P.restore(tl, 0, 2) == pytest.approx(2 * 1.5)
    slow = dataclasses.replace(tl, write_s=12.0)
    assert P.restore(slow, 3, 5) == pytest.approx(12.0 + 2 * 1.5 / tl.chunks)
    assert P.restore(slow, 1, 10) == pytest.approx(9 * 1.5 + 12.0 / tl.chunks)


def test_a_loss_while_the_previous_commit_is_written_loses_that_layer_too():
    tl = F.timeline(model(), FLEET, 1)
    assert P._resumed(tl, 0, 0.0, 3.5 + 0.4, 0, True, lost=True) == (0, 0)  # layer 0's commit not yet written
    assert P._resumed(tl, 0, 0.0, 3.5 + 0.6, 0, True, lost=True) == (1, 0)
    assert P._resumed(tl, 0, 0.0, 3 * 3.5 + 0.6, 0, True, lost=True) == (3, 3)  # layer 3's inputs were written
    assert P._resumed(tl, 0, 0.0, 3 * 3.5 + 0.6, 0, False, lost=True) == (0, 0)  # without resume: from scratch


def test_losing_a_node_goes_on_with_the_others():
    """Two nodes, MIN 1: the one left resumes at once and the replacement joins at the end of a layer; from
    scratch the job waits for it and starts over."""
    tls = {n: F.timeline(model(), FLEET, n) for n in (1, 2)}
    wall, _ = P.trial(tls, 2, 1, REPLACEMENT_S, _drawn(40.0, 1e12, 1e12))
    assert P.trial(tls, 2, 1, REPLACEMENT_S, P.Recorded([40.0]))[0] == wall  # that history replayed from its kill time
    waited, _ = P.trial({2: F.timeline(model(), FLEET, 2, resume=False)}, 2, 2, REPLACEMENT_S,
                        _drawn(40.0, 1e12, 1e12))
    assert P.uninterrupted(tls[2]) < wall < waited


def test_a_certain_preemption_every_layer_never_finishes():
    certain = F.Fleet(**{**FLEET.__dict__, "mtbp_hours": 1e-9, "nodes": (1, 2)})  # every 3.6 us per node
    r = F.report(model(), certain)
    assert not any(row["finishes"] or row["from_scratch"]["finishes"] for row in r["rows"])
    assert r["recommendation"]["nnodes"] is None and "no node count in 1..2 finishes" in F.render(r)
    assert "never finishes" in F.render(r)


def test_restart_constants_are_the_launchers():
    """NOTICE_S and RENDEZVOUS_S are what launch/env.sh gives torchrun."""
    with open(os.path.join(ROOT, "launch", "env.sh")) as f:
        conf = dict(re.findall(r"(\w+)=(\d+)", re.search(r'RDZV_CONF:-([^}"]+)', f.read()).group(1)))
    assert P.NOTICE_S == int(conf["keep_alive_interval"]) * int(conf["keep_alive_max_attempt"])
    assert P.RENDEZVOUS_S == int(conf["last_call_timeout"])


def test_a_tiny_moe_layers_work_by_hand(tiny_moe):
    """Qwen3-MoE (tiny_moe's config): flops per token of each Linear (2 x in x out), calibrated on every token or on
    the routed share (top_k of the experts); Hessians of cols^2 per group of modules that read one input; int4
    codes and one bf16 scale per row and group of 128 columns. The router is no Linear."""
    import transformers

    c = transformers.AutoConfig.from_pretrained(tiny_moe)
    hidden, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.moe_intermediate_size
    experts, routed = c.num_experts, c.num_experts_per_tok / c.num_experts
    attention = 2 * hidden * (q + 2 * kv) + 2 * q * hidden  # q, k, v; o
    gate_up, down = 2 * 2 * hidden * inter, 2 * inter * hidden  # one expert's
    hessians = hidden**2 + q**2  # q, k and v share one; o its own
    every = (attention + experts * (gate_up + routed * down),  # every expert's gate and up see every token:
             hessians + hidden**2 + experts * inter**2)  # one Hessian for all of them, and one per down_proj
    only_routed = (attention + experts * routed * (gate_up + down),
                   hessians + experts * routed * (hidden**2 + inter**2))

    def packed(cols, rows):
        return rows * cols // 2 + rows * math.ceil(cols / 128) * 2

    for all_experts, (calibrate, hessian) in ((True, every), (False, only_routed)):
        work = F.model_work(tiny_moe, Recipe(ignore=("lm_head",)), all_experts)
        w = work.layers[0]
        assert work.layers[0] is work.layers[2] and (work.hidden, work.itemsize) == (hidden, 4)
        assert w.propagate_flops == only_routed[0]
        assert (w.calibrate_flops, w.hessian_flops, w.expert_calls) == (calibrate, hessian, experts)
        assert w.compressed_bytes == packed(hidden, q) + 2 * packed(hidden, kv) + packed(q, hidden) + \
            experts * (2 * packed(hidden, inter) + packed(inter, hidden))


def test_plan_fleet_on_the_command_line(tmp_path, tiny_moe, capsys):
    import transformers

    transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1024).save_pretrained(tmp_path)
    out = run_cli("plan", "--fleet", "--model", tmp_path / "config.json", "--nodes", "1:3", "--trials", 100,
                  "--samples", 64, "--seq-len", 256).stdout
    print("\n" + out)
    assert re.search(r"^1:3 +24 ", out, re.M) and "on demand, 1 node (8 GPUs)" in out
    assert re.search(r"^recommend --nnodes 1:\d \(run --mtbf \d+\): expected", out, re.M)
    capsys.readouterr()
    assert main(["plan", "--fleet", "--model", tiny_moe, "--json", "--nodes", "2:2", "--trials", "10"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == "qwen3_moe" and [row["nodes"] for row in r["rows"]] == [2] and r["rows"][0]["finishes"]


@pytest.mark.parametrize("args, line", [
    (["--nodes", "3:1"], "--nodes 3:1: expected MIN:MAX, whole numbers with 1 <= MIN <= MAX"),
    (["--mtbp-hours", "0"], "--mtbp-hours 0: expected a number above 0"),
    (["--spot-price", "-1"], "--spot-price -1: expected a number of 0 or more"),
    (["--world-size", "4"], "--world-size: plan without --fleet only"),
    (["--calibrate", "--accelerator", "H100"], "--accelerator: datasheet figures, which --calibrate replaces by this "
     "machine's"),
])
def test_bad_fleet_input_is_one_line_and_exit_2(tiny_moe, capsys, args, line):
    assert main(["plan", "--fleet", "--model", tiny_moe, *args]) == 2
    assert capsys.readouterr().err == f"elastic-oneshot: error: {line}\n"


def test_fleet_options_need_fleet_and_the_plan_a_world_size(tiny_moe, capsys):
    assert main(["plan", "--model", tiny_moe, "--nodes", "1:2", "--json"]) == 2
    assert capsys.readouterr().err.endswith("error: --nodes, --json: plan --fleet only\n")
    assert main(["plan", "--model", tiny_moe]) == 2
    assert "plan needs --world-size W" in capsys.readouterr().err


def test_calibrate_measures_one_layer_here_and_the_table_uses_it(tmp_path):
    """--calibrate's figures are positive and replace the datasheet's: forwards and Hessians scale with the samples
    (load and GPTQ do not), ranks past this machine's cores share them, and the header says so."""
    from elastic_oneshot.testing.tiny import make_model

    path = make_model(str(tmp_path / "llama"), "llama", num_hidden_layers=2)
    work = F.model_work(path, Recipe(group_size=64, ignore=("lm_head",)))
    fleet = F.Fleet(samples=8, seq_len=64, nodes=(1, 2), gpus_per_node=1, mtbp_hours=math.inf, trials=10)
    m = F.measure(path, Recipe(group_size=64, ignore=("lm_head",)), fleet, work)
    assert m.samples == 8 and all(v > 0 for v in dataclasses.astuple(m)[2:])
    fleet = dataclasses.replace(fleet, measured=m)
    one = F.layer_seconds(work.layers[0], fleet, 1)
    twice = F.layer_seconds(work.layers[0], dataclasses.replace(fleet, samples=16), 1)
    assert one != F.layer_seconds(work.layers[0], dataclasses.replace(fleet, measured=None), 1)
    for phase in ("calibrate", "hessian", "propagate"):
        assert twice[phase] == pytest.approx(2 * one[phase])
    assert (twice["load"], twice["gptq"]) == (one["load"], one["gptq"])
    crowded = dataclasses.replace(fleet, samples=16, measured=dataclasses.replace(m, cores=1))
    assert F.layer_seconds(work.layers[0], crowded, 2)["calibrate"] == pytest.approx(one["calibrate"] * 2)
    r = F.report(work, fleet, "W4A16")
    assert r["rows"][0]["uninterrupted_s"] > m.startup_s
    assert "calibrated on this machine: layer 0 on 8 samples" in F.render(r)
    assert "(mean, calibrated)" in F.render(r)


def test_calibrate_needs_the_weights(tiny_moe, capsys):
    assert main(["plan", "--fleet", "--calibrate", "--model", tiny_moe]) == 2
    assert re.fullmatch(r"elastic-oneshot: error: --calibrate runs one layer of the real model, which needs its "
                        r"weights: \S+ has no \.safetensors weights\n", capsys.readouterr().err)


@pytest.fixture
def tiny_moe(tmp_path) -> str:
    import transformers

    transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=16,
        num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[], num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_hidden_layers=3, tie_word_embeddings=False).save_pretrained(tmp_path / "moe")
    return str(tmp_path / "moe" / "config.json")


def _drawn(*delays: float) -> P.Drawn:
    """Preemptions that come after the given delays (then never)."""
    return P.Drawn(FLEET.mtbp_s, _Draws(*delays))


class _Draws:
    """A stand-in for random.Random whose preemptions come after the given delays (then never)."""

    def __init__(self, *delays: float):
        self.delays = list(delays)

    def expovariate(self, rate: float) -> float:
        return self.delays.pop(0) if self.delays else math.inf
