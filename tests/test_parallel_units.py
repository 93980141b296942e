"""Tier (a) for the grid: mesh arithmetic, stage cuts, schedules, memory counting; no processes."""
import pytest
import torch

from strategies.config.settings import ConfigError, TrainConfig
from strategies.config.mesh import Mesh
from strategies.runtime.memory import ActivationMeter, state_bytes, storage_bytes
from strategies.model.models import GPT, MLP
from strategies.config.validate import check_world
from strategies.parallel.pipeline import Pipeline, stage_layers


@pytest.mark.timeout(30)
def test_grid_is_one_reshape():
    grid = Mesh(8, dp=2, pp=2, tp=2)
    assert grid.ranks.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert grid.coords_of(5) == (1, 0, 1)
    assert grid.stage_of(6) == 1
    assert grid.rank_of(dp=1, pp=1, tp=0) == 6
    assert grid.group_of(5, "dp") == [1, 5]
    assert grid.group_of(5, "pp") == [5, 7]
    assert grid.group_of(5, "tp") == [4, 5]
    for rank in range(8):                # every rank in exactly one group of each axis
        for axis in ("dp", "pp", "tp"):
            assert rank in grid.group_of(rank, axis)


@pytest.mark.timeout(30)
def test_grid_dp_defaults_to_what_is_left():
    assert Mesh(12, pp=2, tp=3).dp == 2
    assert Mesh(3).dp == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world, dp, pp, tp, message", [
    (6, 2, 2, 2, "dp(2) x pp(2) x tp(2) = 8 != world size 6"),
    (6, 0, 4, 1, "world size 6 is not divisible by pp(4) x tp(1) = 4"),
    (4, 0, 0, 1, "--pp must be >= 1"),
])
def test_grid_errors_name_every_factor(world, dp, pp, tp, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Mesh(world, dp, pp, tp)


def cfg(**kw):
    base = dict(model="gpt", layers=4, d_model=16, heads=4, global_batch=8, sync="ring")
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw, world, message", [
    (dict(pp=5), 5, r"--layers 4 is fewer than pp\(5\) stages"),
    (dict(model="mlp", depth=3, pp=4), 4, r"--depth 3 is fewer than pp\(4\) stages"),
    (dict(heads=2, d_model=16, tp=4), 4, r"--heads 2 is not divisible by tp\(4\)"),
    (dict(model="mlp", tp=2), 2, "tensor parallelism splits the GPT"),
    (dict(micro_batches=5), 2, r"--micro-batches 5 is more than the 4 samples"),
    (dict(global_batch=9, dp=2, tp=2), 4,
     r"--global-batch 9 is not divisible by the data-parallel size: 9 % dp\(2\) = 1 "
     r"\(dp\(2\) x pp\(1\) x tp\(2\) = 4\)"),
])
def test_grid_config_errors(kw, world, message):
    with pytest.raises(ConfigError, match=message):
        check_world(cfg(**kw), world)


@pytest.mark.timeout(30)
def test_config_errors_without_world():
    with pytest.raises(ConfigError, match="--zero 1 needs an all-reduce --sync"):
        cfg(sync="ps", zero=1)
    with pytest.raises(ConfigError, match="--zero"):
        cfg(zero=4)
    with pytest.raises(ConfigError, match="--schedule"):
        cfg(schedule="interleaved")


@pytest.mark.timeout(30)
def test_stage_cut_covers_the_model_once():
    gpt = GPT(vocab=8, seq_len=4, layers=4, d_model=8, heads=2)
    names = [[n for n, _ in stage_layers(gpt, s, 2)] for s in range(2)]
    assert names == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]
    params = [p for s in range(4) for _, m in stage_layers(gpt, s, 4) for p in m.parameters()]
    assert sorted(map(id, params)) == sorted(id(p) for p in gpt.parameters())
    mlp = MLP(4, 8, 4, 3)
    assert [n for n, _ in stage_layers(mlp, 1, 2)] == ["net.4", "net.6", "net.8"]


def schedule(kind, stage, stages, m):
    return Pipeline(None, None, None, stage, stages, m, kind, None, None, None).order()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, m", [(2, 1), (2, 4), (4, 3), (4, 8)])
def test_schedules_run_each_micro_batch_once(kind, stages, m):
    for stage in range(stages):
        ops = schedule(kind, stage, stages, m)
        assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))
        in_flight = peak = 0
        for op, _ in ops:
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        # GPipe holds all m; 1F1B at most stages - stage (Narayanan et al. 2021)
        assert peak == (m if kind == "gpipe" else min(m, stages - stage))


@pytest.mark.timeout(30)
def test_storage_bytes_counts_views_once():
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:], flat[10:20]]
    assert storage_bytes(views) == 400
    assert state_bytes(views, [torch.zeros(10)], [torch.zeros(5), None]) == \
        {"params": 400, "grads": 40, "optimizer": 20}


@pytest.mark.timeout(30)
def test_activation_meter_sees_saved_tensors_freed_by_backward():
    layer = torch.nn.Linear(16, 16)
    meter = ActivationMeter(lambda: [p.untyped_storage().data_ptr() for p in layer.parameters()])
    x = torch.randn(8, 16, requires_grad=True)
    with meter:
        y = torch.tanh(layer(x)).sum()
    # saved: x (for the weight's gradient) and tanh's output; the weight is not an activation
    assert meter.live_bytes == 2 * 8 * 16 * 4
    y.backward()
    del y
    assert meter.live_bytes == 0 and meter.peak_bytes == 2 * 8 * 16 * 4


@pytest.mark.timeout(30)
def test_mesh_carves_context_groups_out_of_the_replicas():
    """cp borrows its ranks from the replicas (mesh.py's table): groups of cp consecutive
    replicas see the same samples; the gradients are averaged over all dp x cp."""
    mesh = Mesh(4, cp=2)
    assert mesh.dp == 2 and mesh.ranks.tolist() == [[[0]], [[1]], [[2]], [[3]]]
    assert [mesh.context_coords_of(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [mesh.coords_of(r)[0] for r in range(4)] == [0, 0, 1, 1]
    assert mesh.group_of(1, "cp") == [0, 1] and mesh.group_of(1, "dp") == [1, 3]
    assert mesh.group_of(1, "dp_cp") == [0, 1, 2, 3]
    grid = Mesh(8, cp=2, tp=2)              # replicas of tp pairs: 0 1 | 2 3 | 4 5 | 6 7
    assert grid.group_of(5, "cp") == [5, 7] and grid.group_of(5, "tp") == [4, 5]
    assert grid.group_of(5, "dp") == [1, 5] and grid.group_of(5, "dp_cp") == [1, 3, 5, 7]
    assert grid.rank_of(dp=1, cp=1, tp=1) == 7
    assert grid.describe() == "dp(2) x cp(2) x pp(1) x tp(2) = 8"
    with pytest.raises(ConfigError, match=r"dp\(2\) x cp\(2\) x pp\(1\) x tp\(1\) = 4 != world"):
        Mesh(6, dp=2, cp=2)
    # the expert groups are cut out of the same dp x cp replicas, an expert's replicas
    # every ep-th one of them
    experts = Mesh(8, cp=2, ep=2)
    assert experts.group_of(5, "ep") == [4, 5]
    assert experts.group_of(5, "ep_replicas") == [1, 3, 5, 7]
    assert experts.describe() == "dp(4) x cp(2) x pp(1) x tp(1) = 8, ep(2) of dp x cp"
    with pytest.raises(ConfigError, match=r"dp\(1\) x cp\(3\) = 3, 3 % 2 = 1"):
        Mesh(3, cp=3, ep=2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw, message", [
    (dict(model="mlp", cp=2), "needs --model gpt or moe"),
    (dict(cp=3), r"--seq-len 32 is not divisible by cp\(3\)"),
    (dict(cp=2, heads=2, tp=2, cp_kind="ulysses"), r"--heads 2 / tp\(2\) = 1 is not a multiple"),
    (dict(cp=2, tp=2, sequence_parallel=True, seq_len=34),
     r"--seq-len 34 is not divisible by cp\(2\) x tp\(2\) = 4: 34 % 4 = 2"),
    (dict(cp=2, sync="local"), "--cp 2 with --sync local is not supported"),
])
def test_context_parallelism_refuses_what_it_does_not_build(kw, message):
    base = dict(model="gpt", sync="ring", seq_len=32, heads=4, d_model=16)
    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig(**{**base, **kw})
    assert e.value.field in ("cp", "heads", "sequence_parallel")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw, message", [
    # 34 divides by cp 2 (17 positions a rank) but not into 4 chunks
    (dict(cp_order="zigzag", seq_len=34),
     r"--cp-order zigzag cuts each sequence into 2 x cp\(2\) = 4 chunks: --seq-len 34 % 4 = 2"),
    (dict(cp_order="stripes", seq_len=32), "--cp-order"),
])
def test_the_zigzag_order_needs_two_equal_chunks_a_rank(kw, message):
    base = dict(model="gpt", sync="ring", heads=4, d_model=16, cp=2)
    TrainConfig(**{**base, "cp_order": "zigzag", "seq_len": 36})     # 2 chunks of 9 a rank
    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig(**{**base, **kw})
    assert e.value.field == "cp_order"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw", [dict(pp=2, micro_batches=2), dict(tp=2, sequence_parallel=True),
                                dict(pp=2, micro_batches=2, schedule="interleaved",
                                     virtual_stages=2, layers=4, cp_kind="ulysses")])
def test_context_parallelism_composes_with_pipelines_and_sequence_parallelism(kw):
    cfg = TrainConfig(model="gpt", sync="ring", seq_len=32, heads=4, d_model=16, cp=2,
                      global_batch=8, **kw)
    assert check_world(cfg, 4) == 1                     # dp(1) x cp(2) x pp or tp (2)


@pytest.mark.timeout(30)
def test_context_parallelism_takes_dp_from_what_is_left():
    cfg = TrainConfig(model="gpt", sync="ring", cp=2, global_batch=8)
    assert check_world(cfg, 4) == 2                     # dp(2) x cp(2): 4 samples a replica
    with pytest.raises(ConfigError, match=r"not divisible by cp\(2\) x pp\(1\) x tp\(1\)"):
        check_world(cfg, 3)


@pytest.mark.timeout(30)
def test_mesh_carves_expert_groups_out_of_dp():
    """ep borrows its ranks from dp: groups of ep consecutive dp ranks, and an expert's
    replicas at the same place of every group (mesh.py's table)."""
    mesh = Mesh(4, ep=2)
    assert [mesh.expert_coords_of(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert mesh.group_of(1, "ep") == [0, 1] and mesh.group_of(1, "ep_replicas") == [1, 3]
    grid = Mesh(8, pp=2, ep=2)              # dp 4 of stage-pairs: ranks 0 2 4 6, ...
    assert grid.group_of(2, "ep") == [0, 2] and grid.group_of(2, "ep_replicas") == [2, 6]
    assert grid.describe() == "dp(4) x pp(2) x tp(1) = 8, ep(2) of dp"
    assert (mesh.dp_enabled, mesh.pp_enabled, mesh.ep_enabled) == (True, False, True)
    with pytest.raises(ConfigError, match=r"world 6 is not a multiple of ep\(4\)"):
        Mesh(6, ep=4)
