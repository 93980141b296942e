"""Tier (a): the layout planner's pieces against the formulas they reuse, and its command line.

Pure arithmetic: no process is started except in the one --verify run at the end
(2 ranks under mpiexec, marked mpi).  The published-table test is test_plan_published.py.
"""
import json
import math
import os
import sys
from dataclasses import replace

import pytest
from conftest import check_ok, mpi_env, run

from experiments import plan as plan_cli
from experiments.costmodel import (Machine, cluster_collective_time, cluster_allreduce_time,
                                   pipeline_step_time)
from experiments.planner.cluster import Cluster, preset
from experiments.planner.figure import plan_frontier
from experiments.planner.search import Space, layouts, pareto, plan
from experiments.planner.stages import chunk_share, held_layers, max_chunks, stage_chunks
from experiments.planner.step import (BUCKET_BYTES, PARTS, Layout, bucketed, compute_seconds,
                                     ends_worth, exchanges, group_time, memory_of,
                                     placement, predict, rank_parameters)
from experiments.planner.transformer import (GPT, layer_activation_bytes, parameters,
                                             step_flops)
from strategies.parallel.bubble import bubble_fraction
from strategies.runtime.memory import zero_memory

SMALL = GPT(layers=8, d_model=512, heads=8, seq_len=256, vocab=1024, global_batch=32)
# a flat rate (--efficiency): these tests check the communication and memory, whose
# arithmetic the kernel model of compute (test_plan_kernels.py) would only blur
TWO_NODES = Cluster("test", nodes=2, gpus_per_node=4, gpu_mem_gib=16, gpu_tflops=100,
                    intra_gbps=800, inter_gbps=200, efficiency=0.48)


# ------------------------------------------------------------------- the formulas
def test_flops_are_narayanans_formula():
    B, s, l, h, V = 8, 2048, 24, 2304, 51200
    gpt = GPT(l, h, 24, s, V, B)
    full = 96 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (16 * l * h))
    none = 72 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert step_flops(gpt, "full") == pytest.approx(full)
    assert step_flops(gpt, "none") == pytest.approx(none)
    assert step_flops(gpt, "none") < step_flops(gpt, "selective") < step_flops(gpt, "full")


def test_parameters_are_narayanans_count():
    l, h, V, s = 24, 2304, 51200, 2048
    expected = 12 * l * h ** 2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    assert parameters(GPT(l, h, 24, s, V, 1)) == pytest.approx(expected)


def test_activations_are_korthikantis_table_2():
    g, b, t = SMALL, 2, 4
    s, h, a = g.seq_len, g.d_model, g.heads
    sbh = s * b * h
    assert layer_activation_bytes(g, b) == pytest.approx(sbh * (34 + 5 * a * s / h))
    scores = 5 * a * s / (h * t)
    assert layer_activation_bytes(g, b, t) == pytest.approx(sbh * (10 + 24 / t + scores))
    assert layer_activation_bytes(g, b, t, True) == pytest.approx(sbh * (34 / t + scores))
    assert layer_activation_bytes(g, b, t, True, "selective") == pytest.approx(sbh * 34 / t)
    assert layer_activation_bytes(g, b, t, False, "full") == pytest.approx(2 * sbh)
    assert layer_activation_bytes(g, b, t, False, "full", 4) == pytest.approx(4 * sbh)
    # without dropout no masks: the 10's two (1 + 1) and the scores' mask and output (1 + 2)
    bare = replace(g, dropout=False)
    assert layer_activation_bytes(bare, b, t) == pytest.approx(
        sbh * (8 + 24 / t + 2 * a * s / (h * t)))
    assert layer_activation_bytes(bare, b, t, True, "selective") == pytest.approx(sbh * 32 / t)
    assert layer_activation_bytes(bare, b, t, False, "full") == pytest.approx(2 * sbh)


def test_collectives_on_a_cluster():
    intra, link = Machine(1e-6, 1e-10), Machine(5e-6, 4e-10)
    n = 64 << 20
    ring = cluster_allreduce_time("ring", n, 2, 4, intra, link)
    assert cluster_collective_time("allreduce", n, 2, 4, intra, link) == ring
    assert cluster_collective_time("reduce_scatter", n, 2, 4, intra, link) == ring / 2
    assert cluster_collective_time("allreduce", n, 1, 1, intra) == 0.0
    # all-to-all, 2 hosts of 4: half of each rank's n leaves its host, 4 ranks share the link
    t = cluster_collective_time("alltoall", n, 2, 4, intra, link)
    assert t >= 4 * n / 2 * link.beta
    assert t == pytest.approx(4 * n / 2 * link.beta + 7 * link.alpha, rel=0.2)


# --------------------------------------------------------- layouts and their model
def test_every_layout_uses_every_gpu_and_keeps_tp_inside_a_node():
    found = list(layouts(SMALL, TWO_NODES, Space()))
    assert found and all(lo.world == TWO_NODES.world for lo in found)
    assert {lo.tp for lo in found} == {1, 2, 4}
    for lo in found:
        assert SMALL.layers % lo.pp == 0
        assert lo.dp * lo.micro_batches * lo.micro_batch_size == SMALL.global_batch
        if lo.schedule == "interleaved":
            assert lo.pp > 1 and lo.micro_batches % lo.pp == 0
            assert lo.virtual_stages <= max_chunks(lo.stages)   # a layer a chunk at least


def test_the_space_limits_the_choices():
    found = list(layouts(SMALL, TWO_NODES, Space(zero=(1,), recompute=("full",),
                                                 schedules=("1f1b",), micro_batch_sizes=(2,))))
    assert {(lo.zero, lo.recompute, lo.schedule, lo.micro_batch_size) for lo in found} == \
        {(1, "full", "1f1b", 2)}


def test_groups_are_placed_as_the_grid_lays_ranks_out():
    assert placement(4, 1, 8) == (1, 4, 1)        # a tp group inside a node
    assert placement(4, 4, 8) == (2, 2, 4)        # dp stride 4: 2 a node, 4 groups a link
    assert placement(8, 8, 8) == (8, 1, 8)        # one a node, all 8 ranks cross
    assert placement(1, 8, 8) == (1, 1, 1)


def test_model_states_are_zero_memory_of_the_ranks_parameters():
    for zero in range(4):
        lo = Layout(dp=2, pp=2, tp=2, zero=zero, micro_batches=4, micro_batch_size=4)
        first, _ = rank_parameters(SMALL, lo, stage=0)
        expected = zero_memory(first, 2, zero, "bf16")
        got = memory_of(SMALL, lo, stage=0)
        assert {k: got[k] for k in expected} == pytest.approx(expected)
        # fp8 holds what the trainer holds: bf16's buffers, fp32 masters, bf16 activations
        assert memory_of(SMALL, replace(lo, precision="fp8"), stage=0) == pytest.approx(got)
    # the whole model over pp x tp, its embeddings once more on the last stage
    (first, _), (last, _) = (rank_parameters(SMALL, Layout(pp=2, tp=2), s) for s in (0, 1))
    h = SMALL.d_model
    assert 2 * (first + last) == pytest.approx(parameters(SMALL) + SMALL.vocab * h)


def test_the_bubble_is_bubble_py_and_the_split_adds_up():
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        lo = Layout(dp=1, pp=4, tp=2, micro_batches=8, micro_batch_size=4,
                    schedule=schedule, virtual_stages=v)
        p = predict(SMALL, TWO_NODES, lo)
        assert set(p.split) == set(PARTS)
        assert sum(p.split.values()) == pytest.approx(p.step_s)
        t = (p.split["compute"] + p.split["tp"] + p.split["ep"] + p.split["dp"]) / 8
        # (v m + p - 1) slots of the heaviest chunk: the last stage's 2 layers cut in
        # v = 2, the head's work on the second (chunk_share); 1F1B: the whole stage
        slot = t * chunk_share(lo.stages or [2] * 4, 3, v, ends_worth(
            SMALL, lo, TWO_NODES, compute_seconds(SMALL, lo, TWO_NODES)))
        assert slot >= t / v
        busy = slot * (v * 8 + 4 - 1)
        assert p.split["bubble"] == pytest.approx(bubble_fraction(4, 8, v) * busy +
                                                  v * 8 * slot - 8 * t)
        assert p.split["pp"] > 0


def test_uneven_chunks_are_paced_by_the_heaviest():
    """Llama 3 405B's stages (7, 8 x 14, 7) cut in 4 chunks: 2, 2, 2, 2 on a middle stage,
    2, 2, 2, 1 on the ends, so the heaviest chunk is a quarter of a middle stage, as
    with an even cut; the ends' work weighs on the chunk it sits on."""
    stages = [7] + [8] * 14 + [7]
    assert chunk_share(stages, 1, 4) == 1 / 4
    assert chunk_share(stages, 0, 4) == 2 / 7                  # 2 of its 7 layers
    assert chunk_share(stages, 15, 4, ends=(0.0, 0.5)) == 2 / 7.5   # 1 + 0.5 < 2
    assert chunk_share(stages, 15, 4, ends=(0.0, 1.5)) == 2.5 / 8.5
    assert chunk_share([4, 4], 1, 2, ends=(0.0, 1.0)) == 3 / 5      # even: the head's on top
    # activations of a rank: Megatron-LM's order, p micro-batches a chunk in turn
    assert held_layers([2, 2, 2, 1], 64, 16) == 16 * 7             # all 4 chunks of 16
    assert held_layers([2, 2, 2, 1], 20, 16) == 16 * 2 + 4 * 2
    assert held_layers([2, 2], 6, 2) == 6 * 2
    # a pipeline of uneven chunks is the cost model's with the heaviest chunk's share
    lo = Layout(pp=2, micro_batches=4, micro_batch_size=4, schedule="interleaved",
                virtual_stages=3, stages=(4, 4))
    p = predict(SMALL, TWO_NODES, lo)
    even = predict(SMALL, TWO_NODES, replace(lo, virtual_stages=2))
    assert p.split["bubble"] > 0 and sum(p.split.values()) == pytest.approx(p.step_s)
    assert p.step_s > even.step_s * 0.9     # chunks of 2, 1, 1 layers pace as 2 of 4


def test_the_ends_may_take_a_chunk_of_their_own():
    """Llama 3 405B's cut (section 3.3.2): 8 chunks a rank on 7, 8 x 14, 7 layers, the
    first rank's first chunk the embedding alone, the last rank's last the head and the
    loss alone; a middle stage holds a layer a chunk at least."""
    stages = [7] + [8] * 14 + [7]
    assert max_chunks(stages) == 8 and max_chunks([4, 4]) == 5 and max_chunks([4] * 3) == 4
    assert stage_chunks(stages, 0, 8) == [0] + [1] * 7
    assert stage_chunks(stages, 15, 8) == [1] * 7 + [0]
    assert stage_chunks(stages, 1, 8) == [1] * 8
    # a light head's chunk paces no slot: a layer does, an eighth of a middle stage
    assert chunk_share(stages, 15, 8, ends=(0.0, 0.5)) == 1 / 7.5
    assert chunk_share(stages, 0, 8, ends=(0.25, 0.0)) == 1 / 7.25
    # the embedding's chunk holds no layer's activations: 15 chunk-forwards, 2 of its
    assert held_layers([0] + [1] * 7, 18, 16) == 2      # layers (Megatron-LM's order)
    found = {(lo.stages, lo.virtual_stages) for lo in layouts(
        SMALL, TWO_NODES, Space(pp_layers=(3, 5)))}
    assert ((3, 5), 4) in found and ((3, 5), 5) not in found     # the first stage: 3 + 1


def test_measured_ends_replace_the_heads_flops():
    """Where the model's ends were timed here (Cluster.measured_ends), the last stage's
    head is that time, a third forward, at the nearest micro-batch size measured;
    elsewhere the logit layer's FLOPs at the block's rate."""
    lo = Layout(pp=2, micro_batches=2, micro_batch_size=4)
    flat = compute_seconds(SMALL, lo, TWO_NODES)["head"]
    measured = replace(TWO_NODES, measured_ends=((1, 0.9), (4, 0.03)))
    assert compute_seconds(SMALL, lo, measured)["head"] == pytest.approx((0.01, 0.02))
    assert compute_seconds(SMALL, replace(lo, micro_batch_size=2), measured)["head"] == \
        pytest.approx((0.3, 0.6))                    # 1 is nearer 2 than 4 is
    assert flat[0] == pytest.approx(6 * 4 * 256 * 512 * 1024 / 3 / 48e12)
    assert predict(SMALL, measured, lo).step_s > predict(SMALL, TWO_NODES, lo).step_s


def test_the_pipeline_part_is_the_cost_models():
    lo = Layout(dp=2, pp=4, tp=1, micro_batches=4, micro_batch_size=4)
    p = predict(SMALL, TWO_NODES, lo)
    per_mb = (p.split["compute"] + p.split["tp"]) / 4
    assert p.split["tp"] == 0
    # the forward's FLOPs are a third of the forward and backward's
    t_f, t_b = per_mb / 3, 2 * per_mb / 3
    # the 4 stages are ranks 0-3, one node: their sends go over its links
    expected = pipeline_step_time(4, 4, t_f, t_b, 4 * 256 * 512 * 2, TWO_NODES.intra())
    assert p.step_s - p.split["dp"] - p.split["update"] == pytest.approx(expected)


def test_the_update_streams_the_ranks_parameters_once_a_step():
    """The optimizer's update: kernels.update_bytes a parameter at the memory's bandwidth
    (STREAM_SHARE of it), on all of a rank's parameters under ZeRO 0 and a 1/dp shard
    under ZeRO 1-3; twice the bandwidth, half the time; the same for every micro-batch."""
    from experiments.planner.kernels import STREAM_SHARE, update_bytes
    assert (update_bytes("fp32", "sgd"), update_bytes("fp32", "momentum"),
            update_bytes("fp32", "adam"), update_bytes("bf16", "adam")) == (12, 20, 28, 28)
    assert update_bytes("bf16", "adam", grad_bytes=4) == 30      # an fp32 main gradient
    lo = Layout(dp=4, tp=2, micro_batches=2, micro_batch_size=2, optimizer="sgd",
                precision="fp32")
    updated = predict(SMALL, TWO_NODES, lo).split["update"]
    assert updated == pytest.approx(sum(rank_parameters(SMALL, lo)) * 12 /
                                    (TWO_NODES.hbm_bytes_per_s * STREAM_SHARE))
    for zero in (1, 2, 3):
        assert predict(SMALL, TWO_NODES, replace(lo, zero=zero)).split["update"] == \
            pytest.approx(updated / 4)
    faster = replace(TWO_NODES, hbm_gbps=2 * TWO_NODES.hbm_bytes_per_s / 1e9)
    assert predict(SMALL, faster, lo).split["update"] == pytest.approx(updated / 2)
    assert predict(SMALL, TWO_NODES, replace(lo, micro_batches=4, micro_batch_size=1)
                   ).split["update"] == pytest.approx(updated)
    assert predict(SMALL, TWO_NODES, replace(lo, optimizer="adam")).split["update"] == \
        pytest.approx(updated * 28 / 12)


def test_the_update_streams_at_the_copy_rate_a_rank_gets():
    """The machine at hand: the calibration's np.copyto rate (2 bytes moved a byte copied),
    a rank's share of its core where ranks outnumber cores."""
    from experiments.planner import verify
    from experiments.planner.kernels import STREAM_SHARE
    assert verify.memory_gbps({"memcpy_gbps": 10.0}, world=4, cores=2) * STREAM_SHARE == \
        pytest.approx(10.0)
    assert verify.memory_gbps({"memcpy_gbps": 10.0}, world=2, cores=2) * STREAM_SHARE == \
        pytest.approx(20.0)
    assert verify.memory_gbps({}, world=4, cores=2) is None


def test_zero_1_and_2_gather_after_the_update_waiting_on_shared_cores_only():
    """ZeRO 1/2's all-gather of the updated shards, once a step: on shared cores each of
    its dp - 1 exchanges waits as ZeRO-3's gathers do (Cluster.cross_wait); a GPU
    cluster (no waits measured) prices its link time alone."""
    shared = replace(TWO_NODES, core_waits=((1, 2e-3),), cross_waits=((2, 1, 1e-3),))
    for zero in (1, 2):
        lo = Layout(dp=4, tp=2, zero=zero, micro_batches=8, micro_batch_size=1)
        waited = predict(SMALL, shared, lo).split["dp"]
        assert waited - predict(SMALL, replace(shared, cross_waits=None), lo).split["dp"] == \
            pytest.approx(exchanges("allgather", 4) * (1e-3 - 2e-3 / 2))
        gpu = predict(SMALL, TWO_NODES, lo).split["dp"]
        assert waited - gpu == pytest.approx(3 * 2e-3 + 3 * 1e-3)  # the reduce's, the gather's
    lo = Layout(dp=4, tp=2, zero=0, micro_batches=8, micro_batch_size=1)     # no gather
    assert predict(SMALL, shared, lo).split["dp"] - predict(SMALL, TWO_NODES, lo).split["dp"] \
        == pytest.approx(3 * 2e-3)


def test_zero_shards_memory_and_tp_adds_communication():
    base = dict(dp=8, micro_batches=2, micro_batch_size=2)
    memory = [predict(SMALL, TWO_NODES, Layout(**base, zero=z)).mem_bytes for z in range(4)]
    assert memory == sorted(memory, reverse=True)
    assert predict(SMALL, TWO_NODES, Layout(dp=2, tp=4, micro_batches=4,
                                            micro_batch_size=4)).split["tp"] > 0


def test_cpu_ranks_expose_their_own_share_of_the_data_parallel_collectives():
    """Cluster.overlaps=False (ranks on CPU cores, verify.py): what the dp group would
    cost inside one node is exposed in full; only the wire between nodes overlaps."""
    cpu = replace(TWO_NODES, overlaps=False)
    for zero in (0, 2, 3):
        layout = Layout(dp=8, zero=zero, micro_batches=2, micro_batch_size=2)
        assert predict(SMALL, cpu, layout).split["dp"] >= predict(SMALL, TWO_NODES,
                                                                  layout).split["dp"]
    one_node = replace(cpu, nodes=1, gpus_per_node=8)
    layout = Layout(dp=8, micro_batches=1, micro_batch_size=4)
    grads = rank_parameters(SMALL, layout)[0] * 2            # bf16 gradients
    assert predict(SMALL, one_node, layout).split["dp"] == pytest.approx(
        group_time("allreduce", grads, 8, 1, one_node))
    gpu = replace(one_node, overlaps=True)             # hides all but the last bucket
    buckets = math.ceil(grads / BUCKET_BYTES)
    assert predict(SMALL, gpu, layout).split["dp"] == pytest.approx(
        group_time("allreduce", grads, 8, 1, gpu) / buckets)


def test_the_last_gradient_bucket_never_hides():
    """bucketed(): buckets filled evenly through the backward, each reduced once full
    and after the one before it."""
    assert bucketed(3.0, 10.0, 1) == 3.0               # one bucket: ready at the very end
    assert bucketed(3.0, 10.0, 4) == pytest.approx(0.75)        # keeps up: the last one
    assert bucketed(8.0, 2.0, 4) == pytest.approx(8.0 - 1.5)    # lags: all it lags by
    assert bucketed(4.0, 4.0, 4) == pytest.approx(1.0)          # the two meet
    # a model whose gradients fit one bucket exposes its whole all-reduce, overlap or not
    from dataclasses import replace
    tiny = GPT(layers=2, d_model=64, heads=2, seq_len=32, vocab=128, global_batch=32)
    node = replace(TWO_NODES, nodes=1, gpus_per_node=8)
    p = predict(tiny, node, Layout(dp=8, micro_batches=1, micro_batch_size=4))
    grads = rank_parameters(tiny, Layout(dp=8))[0] * 2
    assert grads < BUCKET_BYTES
    assert p.split["dp"] == pytest.approx(group_time("allreduce", grads, 8, 1, node))


def test_layouts_that_do_not_fit_say_why_and_rank_last():
    small_gpus = Cluster("tiny", 1, 4, gpu_mem_gib=0.05, gpu_tflops=100, intra_gbps=800,
                         inter_gbps=200)
    entries = plan(SMALL, small_gpus)
    out = [e for e in entries if not e.fits]
    assert out and all("GiB a rank" in e.why_out and "usable" in e.why_out for e in out)
    fits = [e.fits for e in entries]
    assert fits == sorted(fits, reverse=True)
    steps = [e.prediction.step_s for e in entries if e.fits]
    assert steps == sorted(steps)


def test_pareto_front():
    points = [(e.prediction.step_s, e.prediction.mem_bytes) for e in plan(SMALL, TWO_NODES)
              if e.fits]
    front = [(e.prediction.step_s, e.prediction.mem_bytes) for e in pareto(
        [e for e in plan(SMALL, TWO_NODES) if e.fits])]
    # no layout beats a front point in both; every layout is matched by a front point
    assert not any(t < ft and m < fm for ft, fm in front for t, m in points)
    assert all(any(ft <= t and fm <= m for ft, fm in front) for t, m in points)
    assert [m for _, m in front] == sorted((m for _, m in front), reverse=True)


def test_presets_and_their_figures():
    dgx = preset("dgx-a100-80gb", nodes=4)
    assert (dgx.world, dgx.gpu_mem_gib, dgx.gpu_tflops) == (32, 80, 312)
    assert dgx.link(8).beta == pytest.approx(8 * dgx.link().beta)
    with pytest.raises(ValueError, match="--preset"):
        preset("nope")


# -------------------------------------------------------------- the command line
MODEL = ["--layers", "8", "--d-model", "512", "--heads", "8", "--seq-len", "256",
         "--vocab", "1024", "--global-batch", "32"]
CLUSTER = ["--nodes", "2", "--gpus-per-node", "4", "--gpu-mem-gib", "16", "--gpu-tflops",
           "100", "--intra-gbps", "800", "--inter-gbps", "200"]
RECORD_KEYS = {"dp", "pp", "tp", "ep", "zero", "micro_batches", "schedule", "recompute",
               "precision", "fits", "mem_bytes", "step_s", "tflops_per_gpu", "compute_s",
               "tp_s", "pp_s", "dp_s", "ep_s", "bubble_s", "update_s", "why_out", "rank"}


def test_jsonl_records_and_the_figure(tmp_path, capsys):
    out = tmp_path / "plan.jsonl"
    assert plan_cli.main(MODEL + CLUSTER + ["--jsonl", str(out), "--top", "3",
                                            "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "layouts fit" in printed and len([ln for ln in printed.splitlines()
                                             if ln.strip().startswith(("1 ", "2 ", "3 "))]) == 3
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and all(RECORD_KEYS <= set(r) and r["kind"] == "plan" for r in records)
    assert [r["rank"] for r in records] == list(range(1, len(records) + 1))
    for r in records:
        assert r["step_s"] == pytest.approx(sum(r[f"{p}_s"] for p in PARTS))
    drawn = json.load(open(tmp_path / "plan_frontier.json"))
    assert drawn and os.path.exists(tmp_path / "plan_frontier.png")
    assert plan_frontier([], str(tmp_path)) is None


@pytest.mark.parametrize("argv, says", [
    (CLUSTER, "--layers"),
    (MODEL, "CLUSTER"),
    (MODEL + ["--preset", "dgx-z"], "--preset"),
    (MODEL + CLUSTER + ["--zero", "5"], "--zero"),
    (MODEL + CLUSTER + ["--recompute", "some"], "--recompute"),
    (MODEL + CLUSTER + ["--top", "0"], "--top"),
    (MODEL + CLUSTER + ["--verify", "2"], "--calibration"),
    (MODEL + CLUSTER + ["--cluster"], "--cluster"),
    (MODEL + CLUSTER + ["--micro-batch-sizes", "x"], "--micro-batch-sizes"),
    (MODEL[:4] + ["--heads", "7"] + MODEL[6:] + CLUSTER, "--heads"),
    (MODEL + CLUSTER[:-1] + ["0"], "--inter-gbps"),
    (MODEL + ["--preset", "dgx-h100", "--calibration", "x"], "not both"),
    (MODEL + ["--calibration", "nowhere"], "nowhere"),
    (MODEL + CLUSTER + ["--device", "cuda"], "--calibration"),
    (MODEL + CLUSTER + ["--tp-sizes", "0"], "--tp-sizes"),
    (["--layers", "1", "--d-model", "64", "--heads", "3", "--seq-len", "8", "--vocab", "8",
      "--global-batch", "3"] + CLUSTER, "--heads"),
])
def test_errors_are_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_the_machine_at_hand_on_a_gpu_needs_one(tmp_path, capsys):
    """--device cuda where torch sees no GPU: one line, exit 2, before any timing."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/test_plan_gpu.py runs the plan on it")
    (tmp_path / "calibration.json").write_text(json.dumps(
        {"alpha_s": 2e-5, "beta_s_per_byte": 2e-10, "gamma_s_per_byte": 1e-10}))
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(MODEL + ["--calibration", str(tmp_path), "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "torch sees no GPU" in err and len(err.splitlines()) == 1


def test_the_split_sizes_can_be_fixed_one_axis_at_a_time():
    """--tp-sizes / --pp-sizes: a layout for each axis alone (dp only: both 1)."""
    cluster = preset("dgx-a100-80gb", nodes=1)
    gpt = GPT(4, 256, 8, 128, 512, 64)
    every = list(layouts(gpt, cluster, Space()))
    alone = {(lo.tp, lo.pp) for lo in layouts(gpt, cluster, Space(tp_sizes=(1,),
                                                                  pp_sizes=(1,)))}
    assert alone == {(1, 1)} and len({(lo.tp, lo.pp) for lo in every}) > 1
    assert {lo.tp for lo in layouts(gpt, cluster, Space(tp_sizes=(2,)))} == {2}
    assert {lo.pp for lo in layouts(gpt, cluster, Space(pp_sizes=(4,)))} == {4}


def test_a_layouts_run_computes_where_the_machine_at_hand_does():
    from experiments.planner.verify import layout_args
    gpt = GPT(2, 32, 2, 16, 64, 8)
    layout = Layout(dp=2, micro_batches=1, micro_batch_size=4)
    for device in ("cpu", "cuda"):
        args = layout_args(gpt, layout, 3, device)
        assert args[args.index("--device") + 1] == device


def test_a_model_with_no_layout_is_an_error(capsys):
    odd = ["--layers", "3", "--d-model", "64", "--heads", "4", "--seq-len", "8", "--vocab",
           "8", "--global-batch", "3", "--nodes", "1", "--gpus-per-node", "7"] + CLUSTER[4:]
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(odd)
    assert stop.value.code == 2 and "no layout" in capsys.readouterr().err


def test_a_verified_run_lasts_long_enough_to_span_the_machines_drift():
    """verify.steps_for: at least --steps, and enough after the warm-up to time
    --measure-s seconds by the prediction, never more than MAX_STEPS."""
    from experiments.planner.verify import MAX_STEPS, WARM_UP_STEPS, steps_for
    assert steps_for(4.0, 6, 20.0) == 7                  # 5 timed steps of 4 s
    assert steps_for(0.1, 6, 20.0) == WARM_UP_STEPS + 200
    assert steps_for(0.1, 6, 0.0) == 6 and steps_for(10.0, 6, 20.0) == 6
    assert steps_for(1e-6, 6, 20.0) == MAX_STEPS


def verify_on_two_ranks(tmp_path, flags, timeout=180):
    """`experiments.plan --verify 1` of a tiny GPT on 2 ranks with a made-up calibration:
    (its stdout, its records).  Each verified layout has a measured step beside its
    prediction (the figures are the machine's: only their presence is checked)."""
    (tmp_path / "calibration.json").write_text(json.dumps(
        {"alpha_s": 2e-5, "beta_s_per_byte": 2e-10, "gamma_s_per_byte": 1e-10}))
    out = tmp_path / "plan.jsonl"
    result = check_ok(run([sys.executable, "-m", "experiments.plan", "--heads", "2",
                           "--layers", "2", "--global-batch", "8", "--calibration", tmp_path,
                           "--gpus-per-node", "2", "--zero", "0,1", "--micro-batch-sizes",
                           "4", "--verify", "1", "--measure-s", "0", "--jsonl", out,
                           *flags], timeout,
                          mpi_env()))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    checked = [r for r in rows if r["kind"] == "plan_verify"]
    assert len(checked) == 2 and all(r["measured_s"] > 0 and r["predicted_s"] > 0
                                     for r in checked), checked
    assert checked[0]["rank"] < checked[1]["rank"]
    return result.stdout, rows


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_verify_runs_the_best_and_the_worst_on_two_ranks(tmp_path):
    """--verify 1 on 2 ranks: the best layout and the worst run with strategies.train."""
    stdout, _ = verify_on_two_ranks(tmp_path, ["--d-model", "32", "--seq-len", "16",
                                               "--vocab", "32", "--steps", "3"])
    assert "measured" in stdout, stdout


def test_ranks_on_shared_cores_add_their_wait_to_every_tp_all_reduce():
    """Cluster.core_waits (shared_cores.py, the machine at hand): each exchange of a tp
    collective waits half a pair all-reduce's wait (2 (tp - 1) exchanges an all-reduce,
    tp - 1 an all-gather or a reduce-scatter), at the micro-batch size nearest b, and the
    data-parallel exchange after the backward (dp - 1) once a step; nothing else changes."""
    from dataclasses import replace
    shared = replace(TWO_NODES, core_waits=((1, 1e-3), (8, 4e-3)))
    assert shared.core_wait(2) == 1e-3 and shared.core_wait(6) == 4e-3
    assert TWO_NODES.core_wait(4) == 0.0
    # a layer and micro-batch, in exchanges of tp = 4 ranks (3 a gather or scatter, 6 an
    # all-reduce): Megatron's 2 + 2 all-reduces, 24; with sequence parallelism 4 forward,
    # 6 backward (the column layers' inputs gathered again) and 6 replicated gradients'
    # all-reduces, 12 + 18 + 36 = 66 (strategies/parallel/sequence_parallel.py)
    for sequence_parallel, count in ((False, 24), (True, 66)):
        layout = Layout(dp=2, tp=4, micro_batches=4, micro_batch_size=2,
                        sequence_parallel=sequence_parallel)
        plain, waiting = predict(SMALL, TWO_NODES, layout), predict(SMALL, shared, layout)
        per_micro_batch = SMALL.layers * count * 1e-3 / 2
        assert waiting.split["tp"] - plain.split["tp"] == pytest.approx(4 * per_micro_batch)
    assert waiting.split["dp"] - plain.split["dp"] == pytest.approx(1 * 1e-3)
    assert {k: v for k, v in waiting.split.items() if k not in ("tp", "dp", "bubble")} == \
        pytest.approx({k: v for k, v in plain.split.items() if k not in ("tp", "dp", "bubble")})
    no_tp = Layout(dp=8, micro_batches=2, micro_batch_size=2)
    assert predict(SMALL, shared, no_tp).step_s - predict(SMALL, TWO_NODES, no_tp).step_s == \
        pytest.approx(7 * 1e-3)
    one_replica = Layout(dp=1, tp=8, micro_batches=8, micro_batch_size=2)
    assert predict(SMALL, shared, one_replica).split["dp"] == \
        predict(SMALL, TWO_NODES, one_replica).split["dp"]


def test_sequence_parallelism_sends_what_the_worker_sends_on_tp():
    """On a link without latency the forward's tp time is tensor parallelism's (an
    all-reduce is a reduce-scatter and an all-gather), and the backward's is 1.5 times
    it (the column layers' inputs gathered again) plus the replicated gradients' sums."""
    from dataclasses import replace

    from experiments.planner.step import group_time, tp_layer
    cluster = replace(TWO_NODES, intra_latency_us=0.0)
    b, e = 2, 2
    tp, sp = (tp_layer(SMALL, Layout(tp=4, sequence_parallel=on), b, e, cluster)
              for on in (False, True))
    assert sp[0] == pytest.approx(tp[0])
    sums = 6 * group_time("allreduce", SMALL.d_model * e, 4, 1, cluster)
    assert sp[1] == pytest.approx(1.5 * tp[1] + sums)
    assert tp_layer(SMALL, Layout(dp=4), b, e, cluster) == (0.0, 0.0)


def test_the_workers_whole_head_costs_its_logits_and_its_collectives_on_every_tp_rank():
    """Layout.whole_head (strategies.train's head, on every tp rank; with --calibration):
    the logit layer's FLOPs and logits whole rather than a tp-th, and with sequence
    parallelism the head's all-gather, the embedding's and ln_f's two gradients'
    all-reduces (sequence_parallel.edge_collectives: 3 + 3 + 2 x 6 = 18 exchanges a
    micro-batch at tp = 4, on top of the layers' 66); Megatron's split head otherwise."""
    from dataclasses import replace

    from experiments.planner.transformer import logit_flops, logits_bytes
    from strategies.parallel.sequence_parallel import edge_collectives
    shared = replace(TWO_NODES, core_waits=((2, 1e-3),))
    split = Layout(tp=4, micro_batches=2, micro_batch_size=2, precision="fp32")
    whole = replace(split, whole_head=True)
    a, b = predict(SMALL, shared, split), predict(SMALL, shared, whole)
    head = logit_flops(SMALL, 2) / shared.flops_per_s(2)       # forward and backward
    assert b.split["compute"] - a.split["compute"] == pytest.approx(2 * head * 3 / 4)
    assert b.memory["activations"] - a.memory["activations"] == \
        pytest.approx(logits_bytes(SMALL, 2) * 3 / 4)
    forward, backward = edge_collectives(True, True, True)
    assert sum(exchanges(c, 4) for c, _ in forward + backward) == 18
    wire = sum(group_time(c, {"activation": 2 * SMALL.seq_len * SMALL.d_model * 4,
                              "replicated": SMALL.d_model * 4}[v], 4, 1, shared)
               for c, v in forward + backward)
    assert b.split["tp"] - a.split["tp"] == pytest.approx(2 * (wire + 18 * 1e-3 / 2))
    assert edge_collectives(False, True, True) == ([], [])   # the head whole: nothing to gather
    # Space.whole_head gives it to every tp layout it enumerates, never to tp = 1
    found = list(layouts(SMALL, TWO_NODES, Space(whole_head=True, tp_sizes=(1, 4))))
    assert {lo.whole_head for lo in found if lo.tp == 4} == {True}
    assert {lo.whole_head for lo in found if lo.tp == 1} == {False}


def test_a_tp_block_measured_here_sets_its_rate_and_its_waits():
    """Cluster.tp_rates and tp_waits (shared_cores.SizeProbe, verify.tp_waits): a layer
    split over t ranks computes at its measured rate, and each exchange of its
    collectives waits what was measured for t at the nearest b; elsewhere the whole
    block's rate and half a pair all-reduce's wait."""
    from dataclasses import replace

    from experiments.planner import verify
    from experiments.planner.shared_cores import Shared, TpBlock
    from experiments.planner.step import tp_layer
    shared = replace(TWO_NODES, core_waits=((1, 2e-3),), measured_rates=((1, 1e9),))
    assert shared.flops_per_s(1, t=4) == 1e9 and shared.tp_wait(4, 1) == 1e-3
    # one block at t = 4, b = 1: 10 ms over the ring, 4 ms local, 66 exchanges
    found = {1: Shared(0.01, 2e-3, (TpBlock(4, 0.010, 0.004),))}
    waits, replay_waits = verify.tp_waits(SMALL, shared, found)
    no_waits = replace(shared, core_waits=None)
    link = sum(tp_layer(SMALL, Layout(tp=4, precision="fp32"), 1, 4, no_waits))
    assert waits == ((4, 1, pytest.approx((0.006 - link) / 66)),) and replay_waits == ()
    measured = replace(shared, tp_waits=((4, 1, 5e-5), (4, 8, 9e-5)), tp_rates=((4, 1, 2e8),))
    assert measured.tp_wait(4, 2) == 5e-5 and measured.tp_wait(4, 6) == 9e-5
    assert measured.tp_wait(2, 1) == 1e-3                  # no t = 2 measured: the pair's
    assert measured.flops_per_s(1, t=4) == 2e8 and measured.flops_per_s(1, t=2) == 1e9
    layout = Layout(tp=4, micro_batches=1, micro_batch_size=1, precision="fp32")
    slow, fast = predict(SMALL, measured, layout), predict(SMALL, shared, layout)
    assert slow.split["compute"] > fast.split["compute"]    # a t-th of the FLOPs at 1/5 the rate
    plain = predict(SMALL, shared, Layout(dp=4, micro_batch_size=1, precision="fp32"))
    assert predict(SMALL, measured, Layout(dp=4, micro_batch_size=1,
                                           precision="fp32")).step_s == plain.step_s


def test_the_tp_probe_takes_each_difference_within_a_slice_and_cuts_outlier_slices():
    """shared_cores.SizeProbe.tp_result: what the ring adds to the block, and to its
    replay, is a difference within each slice (the kinds take turns), averaged over
    the middle half of the slices: a slice where other work took the cores from
    one kind, or a machine that slows from slice to slice, moves no figure."""
    from types import SimpleNamespace

    from experiments.planner.shared_cores import SizeProbe, TpBlock
    ms = 1e-3
    drift = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]        # the machine slows: + 0.1 ms a slice
    local = [3 * ms + d * ms for d in drift]
    ring = [x + 6 * ms for x in local]
    local_replayed = [x + 3 * ms for x in local]
    ring_replayed = [x + 6 * ms + 3 * ms + 2 * ms for x in local]
    ring_replayed[5] += 40 * ms                            # one slice given to other work
    kinds = [("local", False), ("ring", False), ("local", True), ("ring", True)]
    probe = SimpleNamespace(tp_kinds=kinds, times={
        ("local", False, 4): local, ("ring", False, 4): ring,
        ("local", True, 4): local_replayed, ("ring", True, 4): ring_replayed})
    block = SizeProbe.tp_result(probe, 4, slowest=lambda value: value)
    base = (local[3] + local[4] + local[2] + local[5]) / 4  # the middle half of the local slices
    assert block == pytest.approx(TpBlock(4, base + 6 * ms, base, base + 11 * ms, base + 3 * ms))
    # the replay's exchanges: 2 ms, as in every slice but the outlier
    assert (block.ring_replayed_s - block.ring_s) - (block.local_replayed_s - block.local_s) \
        == pytest.approx(2 * ms)
    probe.tp_kinds, probe.times = kinds[:2], {k: v for k, v in probe.times.items() if not k[1]}
    assert SizeProbe.tp_result(probe, 4, slowest=lambda value: value) == \
        pytest.approx(TpBlock(4, base + 6 * ms, base))


def test_a_recomputed_tp_block_measured_here_sets_its_replays_rate_and_waits():
    """Cluster.tp_replay_rates and tp_replay_waits (the probe's tp blocks recomputed,
    verify.tp_waits): a layout with full recomputation replays each layer's forward
    at the replay's measured rate, and its forward collectives wait what a replayed
    exchange was measured to wait; without them, as the block's own figures."""
    from dataclasses import replace

    from experiments.planner import verify
    from experiments.planner.shared_cores import Shared, TpBlock
    from experiments.planner.step import tp_layer
    shared = replace(TWO_NODES, core_waits=((1, 2e-3),), measured_rates=((1, 1e9),))
    # recomputed: 3 ms more locally, 5 ms more over the ring; 12 forward exchanges
    found = {1: Shared(0.01, 2e-3, (TpBlock(4, 0.010, 0.004, 0.015, 0.007),))}
    waits, replay_waits = verify.tp_waits(SMALL, shared, found)
    no_waits = replace(shared, core_waits=None)
    link_f, _ = tp_layer(SMALL, Layout(tp=4, precision="fp32"), 1, 4, no_waits)
    assert replay_waits == ((4, 1, pytest.approx((0.002 - link_f) / 12)),)
    measured = replace(shared, tp_waits=waits, tp_replay_waits=((4, 1, 1e-3),),
                       tp_rates=((4, 1, 2e8),), tp_replay_rates=((4, 1, 5e7),))
    assert measured.tp_wait(4, 1, replay=True) == 1e-3
    assert measured.tp_wait(4, 1) == waits[0][2]
    assert measured.flops_per_s(1, t=4, replay=True) == 5e7
    assert measured.flops_per_s(1, t=2, replay=True) == 1e9     # not measured: the block's
    full = Layout(tp=4, micro_batch_size=1, recompute="full", precision="fp32")
    plain = replace(measured, tp_replay_waits=None, tp_replay_rates=None)
    slow, fast = predict(SMALL, measured, full), predict(SMALL, plain, full)
    assert slow.split["compute"] > fast.split["compute"] and slow.split["tp"] > fast.split["tp"]
    none = replace(full, recompute="none")                       # no replay: no change
    assert predict(SMALL, measured, none).step_s == predict(SMALL, plain, none).step_s


def test_an_exchange_across_tp_groups_waits_what_the_crossed_block_measured():
    """Cluster.cross_waits (shared_cores.crossed, verify.cross_waits): the ring's tp block
    with an all-to-all with the ranks t apart at the start of its forward and the end of
    its backward; what they add, less their link, over their exchanges, is the wait of
    an exchange between ranks of two tp groups.  Ulysses' all-to-alls beside tp and
    ZeRO-3's in-line gathers wait it; Ulysses at tp = 1 (a context group of consecutive
    ranks) waits as a tp group of cp does, and where nothing was crossed, so does all."""
    from experiments.planner import verify
    from experiments.planner.shared_cores import Shared, TpBlock
    from experiments.planner.step import cp_layer
    shared = replace(TWO_NODES, core_waits=((1, 2e-3),), measured_rates=((1, 1e9),))
    # t = 4 of 8 ranks: crossed with the 2 ranks 4 apart, 4 ms more than over the ring
    found = {1: Shared(0.01, 2e-3, (TpBlock(4, 0.010, 0.004, crossed_s=0.014),)),
             2: Shared(0.02, 2e-3, (TpBlock(4, 0.020, 0.008),))}     # not crossed
    no_waits = replace(shared, core_waits=None)
    link = group_time("alltoall", SMALL.seq_len // 4 * SMALL.d_model * 4, 2, 4, no_waits,
                      on_one_node=True)            # the probe's own machine, not TWO_NODES
    assert verify.cross_waits(SMALL, shared, found, world=8) == \
        ((4, 1, pytest.approx((0.004 - 2 * link) / 2)),)
    # each wait its own figure, so that every branch below shows which one it took
    measured = replace(shared, tp_waits=((4, 1, 1e-4), (2, 1, 3e-4)),
                       cross_waits=((4, 1, 1e-3), (4, 8, 3e-3)))
    assert measured.cross_wait(4, 2) == 1e-3 and measured.cross_wait(4, 6) == 3e-3
    assert measured.cross_wait(2, 1) == measured.tp_wait(2, 1) == 3e-4     # tp's own
    assert measured.cross_wait(8, 1) == measured.core_wait(1) / 2 == 1e-3  # the pair's
    assert shared.cross_wait(4, 1) == shared.tp_wait(4, 1)
    # Ulysses beside tp: its cp - 1 exchanges an all-to-all wait across the groups
    lo = Layout(dp=2, tp=4, cp=2, cp_kind="ulysses", micro_batch_size=1)
    waited, plain = (cp_layer(SMALL, lo, 1, 2, c, (0.0, 0.0)) for c in (measured, no_waits))
    assert waited == pytest.approx(tuple(s + 2 * 1e-3 for s in plain))
    alone = replace(lo, tp=1, dp=8)                        # consecutive ranks: a tp group's
    waited, plain = (cp_layer(SMALL, alone, 1, 2, c, (0.0, 0.0)) for c in (measured, no_waits))
    assert waited == pytest.approx(tuple(s + 2 * 3e-4 for s in plain))
    # ZeRO-3 gathers a unit (8 layers, the embedding, the head of one stage) forward and
    # backward, every micro-batch, each of its replicas - 1 exchanges waiting
    z3 = Layout(dp=2, tp=4, zero=3, micro_batches=16, micro_batch_size=1, precision="fp32")
    gathers = 16 * 2 * (SMALL.layers + 2) * exchanges("allgather", 2)
    assert predict(SMALL, measured, z3).split["dp"] - \
        predict(SMALL, replace(measured, cross_waits=None, tp_waits=None, core_waits=None),
                z3).split["dp"] == pytest.approx(gathers * 1e-3 + 1 * 2e-3)
    z2 = replace(z3, zero=2)              # gathers nothing in line: once, after the update
    assert predict(SMALL, measured, z2).step_s - \
        predict(SMALL, replace(measured, cross_waits=None), z2).step_s == \
        pytest.approx(exchanges("allgather", 2) * (1e-3 - 1e-4))


def test_the_crossed_tp_block_is_a_difference_within_each_slice_too():
    """SizeProbe.tp_result: the crossed block is the ring's plus what crossing added
    within each slice, over the middle half of the slices."""
    from types import SimpleNamespace

    from experiments.planner.shared_cores import SizeProbe, TpBlock
    ms = 1e-3
    local = [3 * ms + d * ms for d in (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7)]
    ring = [x + 6 * ms for x in local]
    crossed = [x + 4 * ms for x in ring]
    crossed[2] += 30 * ms                                  # one slice given to other work
    probe = SimpleNamespace(tp_kinds=[("local", False), ("ring", False)], times={
        ("local", False, 2): local, ("ring", False, 2): ring, ("crossed", False, 2): crossed})
    block = SizeProbe.tp_result(probe, 2, slowest=lambda value: value)
    base = (local[2] + local[3] + local[4] + local[5]) / 4
    assert block == pytest.approx(TpBlock(2, base + 6 * ms, base, crossed_s=base + 10 * ms))


@pytest.mark.mpi
@pytest.mark.timeout(600)       # 197 s on a quiet machine: 4 ranks, the crossed block too
def test_the_shared_cores_probe_times_every_rank_at_once_and_pairs_them():
    from experiments.planner import shared_cores
    probe = [sys.executable, "-m", "mpi4py", "-m", "experiments.planner.shared_cores",
             "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batches", "2,1"]
    from conftest import MPIEXEC
    for ranks in (2, 3):                # an odd last rank computes alone
        result = check_ok(run([MPIEXEC, "-n", str(ranks), *probe], 100, mpi_env()))
        found = json.loads(result.stdout.strip().splitlines()[-1])
        assert found["ranks"] == ranks and set(found["sizes"]) == {"1", "2"}
        assert all(s["block_s"] > 0 and s["wait_s"] >= 0 for s in found["sizes"].values())
    found = shared_cores.measure(GPT(2, 32, 2, 16, 64, 8), ranks=2, batches=(2,), threads=1)
    assert found.sizes[2].block_s > 0 and found.link is None and found.sizes[2].tp_blocks == ()
    assert found.sizes[2].ends_s > 0                # the embeddings, head and loss too
    # a tp block in groups of 2, at each size: with the ring and alone; 4 ranks make
    # two groups, so the ring's block is crossed with the other group's too
    probed = shared_cores.measure(GPT(2, 32, 2, 16, 64, 8), ranks=4, batches=(1, 2),
                                  threads=1, tp_max=2, replays=True)
    for b in (1, 2):
        block, = probed.sizes[b].tp_blocks
        assert block.t == 2 and block.ring_s > 0 and block.local_s > 0
        # and recomputed: at least the block again, with its forward once more
        assert block.ring_replayed_s > 0 and block.local_replayed_s > 0
        assert block.crossed_s >= block.ring_s
    if os.cpu_count() >= 2:             # a core for each rank: nothing to wait for
        assert found.sizes[2].wait_s == 0.0
    # the link as the trainer's ring moves tensors on the device (here the host's path)
    alpha, beta = shared_cores.measure(GPT(2, 32, 2, 16, 64, 8), ranks=2, batches=(2,),
                                       threads=1, link=True).link
    assert alpha >= 0 and 0 < beta < 1e-7            # faster than 10 MB/s


def test_the_device_link_is_the_ring_at_two_ranks_fitted_through_two_sizes():
    """t(n) = 2 alpha + n beta (costmodel's ring at P = 2, the reduction free on a GPU):
    the fit gives back the alpha and beta that made the points, and never below 0."""
    from experiments.planner.shared_cores import fit_link
    alpha, beta = 600e-6, 1 / 12e9
    points = [(n, 2 * alpha + n * beta) for n in (4096, 16 << 20)]
    assert fit_link(points) == pytest.approx((alpha, beta))
    assert fit_link([(4096, 1e-3), (16 << 20, 0.5e-3)]) == (0.5e-3, 0.0)   # noise: no negatives
    from allreduce.costs import Machine
    from experiments.costmodel import cluster_allreduce_time
    n = 1 << 20                        # the planner's ring at P = 2 over that link
    assert cluster_allreduce_time("ring", n, 1, 2, Machine(alpha, beta), None) == \
        pytest.approx(2 * alpha + n * beta)
