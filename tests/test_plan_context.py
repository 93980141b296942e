"""Tier (a): the planner's cp axis (experiments/planner/step.py's cp_layer, search.py's
enumeration): the traffic priced by hand, the memory and compute a cp-th, the gradients
over dp x cp, and at a long sequence the layout that fits is one with cp > 1."""
from dataclasses import replace

import pytest

from experiments import plan as plan_cli
from experiments.costmodel import cluster_collective_time
from experiments.planner.cluster import Cluster
from experiments.planner.search import Space, layouts, plan
from experiments.planner.step import (Layout, compute_seconds, cp_layer, memory_of, predict,
                                      rank_parameters)
from experiments.planner.transformer import GPT, layer_activation_bytes
from strategies.runtime.memory import zero_memory

# 8 heads, 2 key-value heads: the ring's blocks are h_kv = 128 wide
GQA = GPT(layers=4, d_model=512, heads=8, seq_len=1024, vocab=1024, global_batch=16,
          kv_heads=2)
ONE_NODE = Cluster("test", nodes=1, gpus_per_node=8, gpu_mem_gib=16, gpu_tflops=100,
                   intra_gbps=800, inter_gbps=200, efficiency=0.5)


def test_the_rings_exposed_traffic_by_hand():
    """cp 4 in one node, b 2, bf16: a block is 2 x 1024/4 positions x 128 x 2 bytes =
    131,072 bytes.  With no attention to hide behind, the forward is 3 steps of one
    message of 2 blocks, the backward 3 steps of 2 messages of 4 blocks and the
    accumulator's last send home (1 message, 2 blocks)."""
    lo = Layout(dp=2, cp=4, micro_batch_size=2)
    link = ONE_NODE.intra()
    block = 2 * 256 * 128 * 2
    assert block == 131072
    forward, backward = cp_layer(GQA, lo, 2, 2, ONE_NODE, (0.0, 0.0))
    assert forward == pytest.approx(3 * (link.alpha + 2 * block * link.beta))
    assert backward == pytest.approx(3 * (2 * link.alpha + 4 * block * link.beta) +
                                     link.alpha + 2 * block * link.beta)
    # a step's send outlasted by a cp-th of the core hides; the last send home does not
    forward, backward = cp_layer(GQA, lo, 2, 2, ONE_NODE, (1.0, 2.0))
    assert forward == 0.0 and backward == pytest.approx(link.alpha + 2 * block * link.beta)
    assert cp_layer(GQA, replace(lo, cp=1, dp=8), 2, 2, ONE_NODE, (0.0, 0.0)) == (0.0, 0.0)


def test_ulysses_is_two_exposed_all_to_alls_each_way():
    """q, k, v (h + 2 h_kv wide: 2 key-value heads divide by cp 2) and the output (h)."""
    lo = Layout(dp=4, cp=2, cp_kind="ulysses", micro_batch_size=1)
    tokens = 1024 // 2
    one = sum(cluster_collective_time("alltoall", tokens * width * 2, 1, 2, ONE_NODE.intra())
              for width in (512 + 2 * 128, 512))
    assert cp_layer(GQA, lo, 1, 2, ONE_NODE, (5.0, 10.0)) == pytest.approx((one, one))
    # cp 4 does not divide the 2 key-value heads: they travel repeated to h, as the trainer's
    wide = replace(lo, cp=4, dp=2)
    one = sum(cluster_collective_time("alltoall", 256 * width * 2, 1, 4, ONE_NODE.intra())
              for width in (3 * 512, 512))
    assert cp_layer(GQA, wide, 1, 2, ONE_NODE, (0.0, 0.0)) == pytest.approx((one, one))
    # ranks sharing cores: each all-to-all comes right after compute, and each of its
    # cp - 1 exchanges waits what a tp exchange of a group of cp waits (Cluster.tp_wait)
    shared = replace(ONE_NODE, tp_waits=((4, 1, 1e-3),))
    waited, plain = cp_layer(GQA, wide, 1, 2, shared, (0.0, 0.0)), cp_layer(GQA, wide, 1, 2,
                                                                            ONE_NODE, (0.0, 0.0))
    assert waited == pytest.approx(tuple(s + 2 * 3 * 1e-3 for s in plain))


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_activations_and_compute_are_a_cp_th(kind):
    for recompute in ("none", "selective", "full"):
        assert layer_activation_bytes(GQA, 2, 2, True, recompute, 2, cp=4) == pytest.approx(
            layer_activation_bytes(GQA, 2, 2, True, recompute, 2) / 4)
    whole = Layout(dp=8, micro_batch_size=2)
    split = Layout(dp=2, cp=4, cp_kind=kind, micro_batch_size=2)
    assert memory_of(GQA, split, 0)["activations"] == pytest.approx(
        memory_of(GQA, whole, 0)["activations"] / 4)
    # a flat rate: the FLOPs of s / cp positions (and of a cp-th of the scores)
    a, b = compute_seconds(GQA, whole, ONE_NODE), compute_seconds(GQA, split, ONE_NODE)
    assert b["layer"] == pytest.approx(tuple(t / 4 for t in a["layer"]))
    assert b["core"] == pytest.approx(tuple(t / 4 for t in a["core"]))


def test_gradients_and_zero_span_dp_times_cp():
    """A context group holds the same parameters: ZeRO shards them over dp x cp."""
    for zero in (0, 1, 2, 3):
        lo = Layout(dp=2, cp=4, zero=zero)
        dense, _ = rank_parameters(GQA, lo)
        states = {k: v for k, v in memory_of(GQA, lo, 0).items() if k != "activations"}
        assert states == pytest.approx(zero_memory(dense, 8, zero, "bf16"))
    split = predict(GQA, ONE_NODE, Layout(dp=2, cp=4, micro_batches=8, micro_batch_size=1))
    assert split.split["dp"] == pytest.approx(
        predict(GQA, ONE_NODE, Layout(dp=8, micro_batches=2, micro_batch_size=1)).split["dp"])
    assert split.split["cp"] > 0 and split.layout.world == 8


def test_cp_divides_the_sequence_and_ulysses_the_heads():
    odd = replace(GQA, seq_len=1000)                     # 1000 = 2^3 x 125
    assert {lo.cp for lo in layouts(odd, ONE_NODE, Space())} == {1, 2, 4, 8}
    kinds = {(lo.cp, lo.tp, lo.cp_kind) for lo in layouts(GQA, ONE_NODE, Space())}
    assert (8, 1, "ulysses") in kinds and (4, 2, "ulysses") in kinds
    assert (8, 2, "ring") not in kinds                    # 8 x 2 is beyond 8 GPUs
    four = {(lo.cp, lo.tp, lo.cp_kind) for lo in layouts(replace(GQA, heads=4), ONE_NODE,
                                                         Space())}
    assert (4, 2, "ulysses") not in four and (4, 2, "ring") in four   # 4 heads / tp 2 = 2
    only = {lo.cp for lo in layouts(GQA, ONE_NODE, Space(cp_sizes=(1, 4)))}
    assert only == {1, 4}


def test_a_long_sequence_makes_cp_pay():
    """GPT-3 1.3B's shape with 2 key-value heads (tp at most 2) at 32,768 tokens on 8 GPUs
    of 16 GiB: without cp only full recomputation fits, a third slower than the best
    layout, which has cp > 1; at 2,048 tokens the best layout needs none."""
    long = GPT(layers=24, d_model=2048, heads=16, kv_heads=2, seq_len=32768, vocab=51200,
               global_batch=8, flash_attention=True)
    best = next(e for e in plan(long, ONE_NODE) if e.fits).prediction
    without = next(e for e in plan(long, ONE_NODE, Space(cp_sizes=(1,))) if e.fits).prediction
    assert best.layout.cp > 1 and without.step_s > 1.25 * best.step_s
    kept = Space(recompute=("none",))
    assert not any(e.fits for e in plan(long, ONE_NODE, replace(kept, cp_sizes=(1,))))
    assert any(e.fits for e in plan(long, ONE_NODE, kept))
    short = next(e for e in plan(replace(long, seq_len=2048), ONE_NODE) if e.fits)
    assert short.prediction.layout.cp == 1


def test_the_table_shows_cp(capsys):
    argv = ["--layers", "24", "--d-model", "2048", "--heads", "16", "--kv-heads", "2",
            "--seq-len", "32768",
            "--vocab", "51200", "--global-batch", "8", "--flash-attention", "--nodes", "1",
            "--gpus-per-node", "8", "--gpu-mem-gib", "16", "--gpu-tflops", "100",
            "--intra-gbps", "800", "--inter-gbps", "200", "--top", "3", "--cp-kinds", "ring"]
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "cp" in out.splitlines()[2] and "-ring" in out and "-ulysses" not in out
