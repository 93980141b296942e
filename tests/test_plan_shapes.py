"""Tier (a): the planner's uneven pipeline stages, today's model shapes and its compute model,
each against the formula or the rule it implements (pure arithmetic, no process)."""
import itertools
import json
import math
from dataclasses import replace

import pytest

from experiments import plan as plan_cli
from experiments.planner import kernels
from experiments.planner.cluster import Cluster, preset
from experiments.planner.search import Space, distinct, divisors, layouts, plan
from experiments.planner.step import Layout, memory_of, predict
from experiments.planner.transformer import (GPT, layer_activation_bytes, layer_forward_flops,
                                             parameters, step_flops)
from experiments.planner.verify import runnable
from strategies.parallel.stages import stage_layers

SMALL = GPT(layers=8, d_model=512, heads=8, seq_len=256, vocab=1024, global_batch=32)
NODE = Cluster("test", nodes=1, gpus_per_node=8, gpu_mem_gib=16, gpu_tflops=100,
               intra_gbps=800, inter_gbps=200)


# ------------------------------------------------------------------ stage_layers
def test_the_published_splits():
    assert stage_layers(70, 12, first=1, last=1) == [5] + [6] * 10 + [5]         # BLOOM
    assert stage_layers(126, 16, first=1, last=1) == [7] + [8] * 14 + [7]        # Llama 3
    assert stage_layers(96, 8) == [12] * 8                                       # even
    assert stage_layers(80, 8, last=0.35) == [10] * 8     # a light head moves nothing


def brute_force(layers, pp, first, last):
    """The least heaviest stage over every split (small cases only)."""
    best = math.inf
    for cut in itertools.combinations(range(1, layers), pp - 1):
        counts = [b - a for a, b in zip((0,) + cut, cut + (layers,))]
        extras = [first if i == 0 else 0 for i in range(pp)]
        extras[-1] += last
        best = min(best, max(n + e for n, e in zip(counts, extras)))
    return best


@pytest.mark.parametrize("layers, pp", [(1, 1), (5, 5), (7, 3), (10, 4), (11, 6), (9, 2)])
@pytest.mark.parametrize("first, last", [(0, 0), (1, 1), (0.3, 2.6), (4, 0)])
def test_the_balanced_split_is_the_least_heaviest_stage(layers, pp, first, last):
    counts = stage_layers(layers, pp, first, last)
    assert len(counts) == pp and sum(counts) == layers and min(counts) >= 1
    extras = [first if i == 0 else 0 for i in range(pp)]
    extras[-1] += last
    heaviest = max(n + e for n, e in zip(counts, extras))
    assert heaviest == pytest.approx(brute_force(layers, pp, first, last))


def test_a_split_by_hand_is_checked_and_kept():
    assert stage_layers(8, 3, given=(2, 3, 3)) == [2, 3, 3]
    for given in ((2, 3), (0, 4, 4), (3, 3, 3)):
        with pytest.raises(ValueError, match="--pp-layers"):
            stage_layers(8, 3, given=given)
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layers(3, 4)
    assert len(stage_layers(10 ** 9, 7, 0.5, 2)) == 7          # bisection, no counting


# ------------------------------------------------------- every pp, uneven stages
def test_every_pp_up_to_the_layers_is_searched_and_the_slowest_stage_paces():
    gpt = replace(SMALL, layers=7, global_batch=8)
    found = list(layouts(gpt, NODE, Space(tp_sizes=(1,))))
    assert {lo.pp for lo in found} == {1, 2, 4}                # pp 8 > 7 layers: none
    for lo in found:
        assert sum(lo.stages) == 7 and len(lo.stages) == lo.pp
    even = Layout(dp=2, pp=2, micro_batches=4, micro_batch_size=1, stages=(4, 4))
    lopsided = replace(even, stages=(7, 1))
    slow, fast = (predict(SMALL, NODE, lo) for lo in (lopsided, even))
    assert slow.step_s > fast.step_s
    assert memory_of(SMALL, lopsided, 0)["activations"] > memory_of(SMALL, even, 0)["activations"]
    assert slow.mem_bytes > fast.mem_bytes


def test_layers_by_hand_fix_the_pipeline(capsys):
    fits = [e for e in plan(SMALL, NODE, Space(pp_layers=(3, 5))) if e.fits]
    assert fits and {e.prediction.layout.stages for e in fits} == {(3, 5)}
    assert {e.prediction.layout.pp for e in fits} == {2}
    argv = ["--layers", "8", "--d-model", "512", "--heads", "8", "--seq-len", "256", "--vocab",
            "1024", "--global-batch", "32", "--preset", "dgx-a100-80gb", "--pp-layers", "3,5"]
    assert plan_cli.main(argv) == 0
    assert "pp2:3-5" in capsys.readouterr().out


def test_divisors_count_to_the_square_root():
    for n in (1, 2, 12, 36, 97, 360):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert len(divisors(2 ** 40)) == 41


# ------------------------------------------------------------ today's model shapes
def test_gqa_the_mlps_width_and_gating_in_flops_and_parameters():
    b, s, h, a, kv, f = 2, 256, 512, 8, 2, 1536
    gpt = GPT(4, h, a, s, 1024, 8, kv_heads=kv, ffn_hidden=f, gated_mlp=True)
    h_kv = kv * h // a
    per_layer = 2 * b * s * h * (h + 2 * h_kv) + 2 * b * s * h * h + 3 * 2 * b * s * h * f \
        + 4 * b * s * s * h
    assert layer_forward_flops(gpt, b) == per_layer
    weights = h * (h + 2 * h_kv) + h * h + 3 * h * f
    biases_norms = (h + 2 * h_kv) + h + 4 * h + 2 * f + h
    assert parameters(gpt) == 4 * (weights + biases_norms) + (1024 + s) * h
    # GPT-3's shape is the default: the same model spelled out
    assert parameters(SMALL) == parameters(replace(SMALL, kv_heads=8, ffn_hidden=2048))
    assert step_flops(replace(gpt, gated_mlp=False)) < step_flops(gpt)


def test_activations_of_gqa_a_width_and_gating_follow_korthikantis_sum():
    b, t, s, h = 2, 4, 256, 512
    gpt = GPT(4, h, 8, s, 1024, 8, kv_heads=2, ffn_hidden=1536, gated_mlp=True)
    sb, h_kv, f = s * b, 128, 1536
    split = 4 * h + 4 * h_kv + 6 * f
    scores = sb * 5 * 8 * s / t
    assert layer_activation_bytes(gpt, b, t) == pytest.approx(sb * (10 * h + split / t) + scores)
    assert layer_activation_bytes(gpt, b, t, True) == pytest.approx(sb * (10 * h + split) / t
                                                                    + scores)
    flash = replace(gpt, flash_attention=True)
    assert layer_activation_bytes(flash, b, t) == pytest.approx(sb * (10 * h + split / t))


def test_tp_divides_the_key_value_heads():
    gpt = replace(SMALL, kv_heads=2)
    assert {lo.tp for lo in layouts(gpt, NODE, Space())} == {1, 2}
    with pytest.raises(ValueError, match=r"--tp-sizes 4 \(of tp 1,2\); tp 4 is out once "
                                         r"tp divides the heads \(8\) and the key-value "
                                         r"heads \(2\)"):
        plan(gpt, NODE, Space(tp_sizes=(4,)))
    with pytest.raises(ValueError, match="--kv-heads"):
        replace(SMALL, kv_heads=3)


def test_verify_offers_the_trainer_only_what_it_builds():
    """strategies.train builds GQA, the MLP's width and SwiGLU, and any split of the
    layers over 1f1b's stages; not fused attention, nor uneven interleaved chunks."""
    even = Layout(dp=2, pp=2, micro_batches=4, stages=(4, 4))
    assert runnable(SMALL, even) == ""
    assert runnable(SMALL, replace(even, stages=(3, 5))) == ""
    assert "evenly" in runnable(SMALL, replace(even, stages=(3, 5), schedule="interleaved",
                                               virtual_stages=2))
    for shape in (dict(kv_heads=2), dict(ffn_hidden=1024), dict(gated_mlp=True)):
        assert runnable(replace(SMALL, **shape), even) == ""
    assert "fused attention" in runnable(replace(SMALL, flash_attention=True), even)


def test_verify_offers_a_mixture_of_experts_on_every_split_the_planner_prices_as_run():
    """strategies.train runs the experts with pipelines, micro-batches, ZeRO and
    recomputation (docs/compatibility.md refuses none of them), and GQA; not another MLP
    than GPT-2's, nor experts split over tp (it keeps them whole on every tp rank, the
    planner splits them as the dense MLP).  A causal ring is offered where the trainer
    can balance it as the planner prices it (zig-zag: T a multiple of 2 cp)."""
    moe = replace(SMALL, experts=4)
    for layout in (Layout(dp=2, pp=2, micro_batches=4, stages=(3, 5), ep=2),
                   Layout(dp=4, ep=2, zero=3, micro_batches=2, micro_batch_size=4),
                   Layout(dp=4, ep=4, zero=1, recompute="full")):
        assert runnable(moe, layout) == "", layout
    assert runnable(replace(moe, kv_heads=2), Layout(dp=4, ep=2)) == ""
    assert "GPT-2's" in runnable(replace(moe, gated_mlp=True), Layout(dp=4, ep=2))
    assert "whole on every tp rank" in runnable(moe, Layout(dp=2, tp=2, ep=2))
    assert runnable(SMALL, Layout(dp=2, cp=2)) == ""                     # 256 % 4 = 0
    odd = replace(SMALL, seq_len=12)                                      # 12 % 8 = 4
    assert "multiple of 2 cp (8)" in runnable(odd, Layout(dp=1, cp=4))
    assert runnable(odd, Layout(dp=1, cp=4, cp_kind="ulysses")) == ""


def test_verify_runs_the_experts_split_and_the_ring_as_planned():
    """layout_args of a mixture of experts: the layout's every degree, micro-batches,
    ZeRO and stages, GQA, capacity factor 1 (the planner counts each token's k copies,
    no padding); a ring of cp ranks in zig-zag order, as the planner prices it."""
    from experiments.planner.verify import layout_args
    from strategies.config.settings import check_world, parse_args
    moe = replace(SMALL, experts=4, kv_heads=2)
    layout = Layout(dp=2, pp=2, ep=2, zero=1, micro_batches=4, stages=(3, 5))
    cfg = parse_args(layout_args(moe, layout, 3))
    assert (cfg.model, cfg.experts, cfg.ep, cfg.kv_heads, cfg.capacity_factor) == \
        ("moe", 4, 2, 2, 1.0)
    assert (cfg.pp, cfg.zero, cfg.micro_batches, cfg.stage_split) == (2, 1, 4, (3, 5))
    assert check_world(cfg, 4) == 2
    ring = parse_args(layout_args(SMALL, Layout(dp=2, cp=2), 3))
    assert (ring.cp, ring.cp_kind, ring.cp_order) == (2, "ring", "zigzag")
    ulysses = parse_args(layout_args(SMALL, Layout(dp=2, cp=2, cp_kind="ulysses"), 3))
    assert ulysses.cp_order == "contiguous"


def test_the_machine_at_hand_plans_the_trainers_gpt_without_dropout(tmp_path, monkeypatch):
    """With --calibration the model planned is strategies.train's, which has no dropout:
    no masks in its memory (--no-dropout implied); without it, GPT-3's dropout stays."""
    (tmp_path / "calibration.json").write_text(
        '{"alpha_s": 2e-5, "beta_s_per_byte": 2e-10, "gamma_s_per_byte": 1e-10}')
    timed = []

    def machine(gpt, *args, **kwargs):            # the figures, without timing this host
        timed.append(gpt)
        return replace(NODE, gpus_per_node=1, efficiency=1.0)
    monkeypatch.setattr(plan_cli, "this_machine", machine)
    model = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "16",
             "--vocab", "32", "--global-batch", "4"]
    for flags, dropout in ((["--calibration", str(tmp_path)], False),
                           (["--gpus-per-node", "1", "--gpu-mem-gib", "16", "--gpu-tflops",
                             "100", "--intra-gbps", "800", "--inter-gbps", "200"], True)):
        out = tmp_path / f"plan{dropout}.jsonl"
        assert plan_cli.main(model + flags + ["--jsonl", str(out)]) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert records and all(r["model"]["dropout"] is dropout for r in records)
    assert [g.dropout for g in timed] == [False]


def test_verify_runs_the_shape_and_the_split_it_planned():
    """layout_args: the planner's GPT and stages as the trainer's flags, which the
    trainer's config takes as they are (its cut is then the planner's)."""
    from experiments.planner.verify import layout_args
    from strategies.config.settings import check_world, parse_args
    gpt = replace(SMALL, kv_heads=2, ffn_hidden=1024, gated_mlp=True)
    layout = Layout(dp=2, pp=2, micro_batches=4, stages=(3, 5))
    cfg = parse_args(layout_args(gpt, layout, 3))
    assert (cfg.kv_heads, cfg.ffn_hidden, cfg.gated_mlp) == (2, 1024, True)
    assert cfg.stage_split == (3, 5) and check_world(cfg, 4) == 2


# ------------------------------------------------------------- the compute model
def test_a_gemm_reaches_more_of_the_peak_the_larger_it_is():
    a100 = preset("dgx-a100-80gb")
    rates = [2 * d ** 3 / kernels.gemm_seconds(d, d, d, a100) for d in (128, 512, 2048, 8192)]
    assert rates == sorted(rates) and rates[-1] < a100.gpu_tflops * 1e12 * a100.gemm_best
    assert kernels.gemm_efficiency(kernels.D_HALF, kernels.D_HALF, a100) == \
        pytest.approx(a100.gemm_best / 2)
    # a wide product over a short k is bound by the memory: its bytes at the bandwidth
    m = n = 8192
    k = 16
    moved = 2 * (m * k + k * n + m * n)
    assert kernels.gemm_seconds(m, n, k, a100) == pytest.approx(
        moved / (a100.hbm_bytes_per_s * kernels.STREAM_SHARE))


def test_a_layers_kernels_add_up_and_flash_attention_streams_no_scores():
    h100 = preset("dgx-h100")
    gpt = GPT(4, 4096, 32, 4096, 32000, 8)
    plain = kernels.layer_seconds(gpt, 1, 2, True, h100)
    flash = kernels.layer_seconds(replace(gpt, flash_attention=True), 1, 2, True, h100)
    assert flash["forward"] < plain["forward"] and plain["backward"] == 2 * plain["forward"]
    rate = layer_forward_flops(gpt, 1) / 2 / plain["forward"]
    assert 0.3 * h100.gpu_tflops * 1e12 < rate < h100.gemm_best * h100.gpu_tflops * 1e12
    assert plain["selective"] < plain["forward"]
    # without dropout the residual adds write no masks, nor the scores a mask and copy:
    # (3 e + 1) -> 3 e bytes a value each add, (3 e + 1) -> 2 e a score (e = 2 bytes)
    bare = kernels.layer_seconds(replace(gpt, dropout=False), 1, 2, True, h100)
    s, h, a = gpt.seq_len, gpt.d_model, gpt.heads
    saved = 2 * s * h / 2 + 3 * a * s * s / 2
    assert plain["forward"] - bare["forward"] == pytest.approx(
        kernels.stream_seconds(saved, h100))


def test_efficiency_is_a_flat_rate_and_mfu_leaves_recomputation_out():
    flat = replace(NODE, efficiency=0.5)
    lo = Layout(dp=8, micro_batches=4, micro_batch_size=1, recompute="full")
    p = predict(SMALL, flat, lo)
    hardware = step_flops(SMALL, "full") / 8          # a replica's share of the step
    assert p.split["compute"] == pytest.approx(hardware / (0.5 * 100e12), rel=1e-9)
    mfu, hfu = p.utilisation(flat)
    assert hfu / mfu == pytest.approx(step_flops(SMALL, "full") / step_flops(SMALL, "none"))
    record = p.record(flat, True)
    assert record["mfu"] == mfu and record["hardware_tflops_per_gpu"] > record["tflops_per_gpu"]
    none = predict(SMALL, flat, replace(lo, recompute="none")).utilisation(flat)
    assert none[0] == pytest.approx(none[1])


def test_near_duplicates_are_listed_once():
    entries = [e for e in plan(SMALL, NODE, Space(zero=(1, 2))) if e.fits]
    kept = distinct(entries)
    assert len(kept) < len(entries)
    keys = [(e.prediction.layout.dp, e.prediction.layout.micro_batch_size,
             e.prediction.layout.recompute, e.prediction.layout.pp, e.prediction.layout.tp,
             e.prediction.layout.virtual_stages, round(e.prediction.step_s, 9)) for e in kept]
    assert len(keys) == len(set(keys))
