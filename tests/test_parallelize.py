"""The one parallelize step and the one step engine (strategies/engine/parallelize.py, loop.py).

In process, one rank: what parallelize builds for each shape of run (the whole model,
the grid), and the one step over both: every run whose pipeline has one stage is driven
by the trivial schedule (accumulation.py), over the whole model or over the grid's one
Stage (under ZeRO stage 0), and both train the same parameters from the same seed, up
to the order of float additions (rtol 1e-5, atol 1e-6, as the other equivalences; a
micro-batch counted twice or a missing 1/k moves them by ~1e-3).  The multi-rank equivalences are
test_accumulation.py's, test_parallel_runs.py's and test_one_worker.py's.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strategies.config.choices import ConfigError
from strategies.config.mesh import Mesh
from strategies.config.settings import TrainConfig
from strategies.config.validate import check_world
from strategies.engine.accumulation import Accumulation
from strategies.engine.loop import StepEngine
from strategies.engine.parallelize import parallelize
from strategies.model.data import load_data
from strategies.model.models import build_model
from strategies.parallel.pipeline import Pipeline, Stage
from strategies.runtime.context import RunContext
from strategies.sync.gradient_sync import LocalSync
from strategies.sync.zero import ZeRO

RTOL, ATOL = 1e-5, 1e-6
SMALL = dict(model="mlp", width=16, depth=2, in_dim=8, classes=4, dataset_size=64,
             global_batch=8, steps=3, lr=0.05, momentum=0.9, progress=False, threads=1)


def built(**flags):
    cfg = TrainConfig(**{**SMALL, **flags})
    ctx = RunContext.create(cfg)
    data = load_data(cfg)
    return cfg, ctx, data, build_model(cfg, data.spec, torch.device("cpu"))


def test_grad_accum_is_micro_batches_on_every_run():
    plain = TrainConfig(sync="ring", grad_accum=4)
    assert plain.micro_batches == 4 and not plain.on_grid
    assert not TrainConfig(sync="ps", micro_batches=2).on_grid    # accumulation, any sync
    with pytest.raises(ConfigError, match="--grad-accum 2 and --micro-batches 4"):
        TrainConfig(sync="ring", grad_accum=2, micro_batches=4)
    # a whole model cuts unequal micro-batches as the grid does (3, 3, 2 here)
    assert check_world(TrainConfig(sync="ring", micro_batches=3, global_batch=16), 2) == 2


def test_the_whole_model_gets_the_trivial_schedule():
    cfg, ctx, _, model = built(sync="local", micro_batches=2, recompute=True)
    plan = parallelize(model, ctx, cfg, torch.device("cpu"), None)
    assert plan.model is model and isinstance(plan.sync, LocalSync)
    assert isinstance(plan.schedule, Accumulation) and plan.schedule.k == 2
    assert plan.recompute is not None and not plan.pipelined and plan.reports
    plan.sync.close()


def test_the_grid_gets_stages_zero_and_at_one_stage_the_trivial_schedule():
    cfg, ctx, _, model = built(sync="ring", model="gpt", layers=2, d_model=16, heads=2,
                               vocab=12, seq_len=8, zero=1, micro_batches=2, recompute=True)
    plan = parallelize(model, ctx, cfg, torch.device("cpu"), None)
    assert isinstance(plan.model, Stage) and isinstance(plan.sync, ZeRO)
    # pp = 1: the schedule of one stage, as a whole model's; Pipeline is for pp >= 2
    assert isinstance(plan.schedule, Accumulation) and not isinstance(plan.schedule, Pipeline)
    assert plan.schedule.k == 2 and plan.schedule.forward is plan.model
    assert plan.schedule.meter is plan.meter is not None     # the grid's memory records
    assert plan.schedule.recompute is plan.recompute and plan.pipelined
    # every parameter of this rank's share has its name in the whole model
    assert {plan.names[id(p)] for p in plan.model.parameters()} == \
        {n for n, _ in model.named_parameters()}
    plan.sync.close()


def train(**flags):
    cfg, ctx, data, model = built(**flags)
    engine = StepEngine(cfg, ctx, torch.device("cpu"), data, model)
    records = [engine.step(step) for step in range(cfg.steps)]
    params = engine.parameters_npz()
    engine.sync.close()
    return records, params


def test_one_step_over_either_schedule_trains_the_same_model():
    whole, whole_params = train(sync="local", micro_batches=2)
    grid, grid_params = train(sync="ring", zero=0, dp=1, micro_batches=2)
    np.testing.assert_allclose([loss for loss, _ in grid], [loss for loss, _ in whole],
                               rtol=RTOL, atol=ATOL)
    assert sorted(grid_params) == sorted(whole_params)
    for name, value in whole_params.items():
        np.testing.assert_allclose(grid_params[name], value, rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    every = {"step_time_s", "compute_time_s", "comm_time_s", "staleness", "comm_rounds"}
    assert all(every <= set(fields) for _, fields in whole + grid)
    assert all({"coords", "bubble_fraction", "peak_in_flight", "memory", "wire_bytes"}
               <= set(fields) for _, fields in grid)
    assert all(fields["peak_in_flight"] == 1 for _, fields in grid)   # one stage: 1F1B


def test_the_grid_at_one_stage_and_a_whole_model_share_one_schedule():
    schedules = []
    for flags in (dict(sync="local"), dict(sync="ring"), dict(sync="ring", dp=1),
                  dict(sync="ring", zero=3)):
        cfg, ctx, _, model = built(micro_batches=2, **flags)
        plan = parallelize(model, ctx, cfg, torch.device("cpu"), None)
        schedules.append(type(plan.schedule))
        plan.sync.close()
    assert schedules == [Accumulation] * 4


def test_unequal_micro_batches_on_the_grid_at_one_stage_match_one_process():
    """Local batch 5 in micro-batches of 3 and 2, each loss scaled by its share (3/5, 2/5):
    the step of the unsplit batch (a 1/k scale instead moves the losses by ~7e-3)."""
    whole, whole_params = train(sync="local", global_batch=5)
    for zero in (0, 3):
        grid, grid_params = train(sync="ring", dp=1, zero=zero, global_batch=5,
                                  micro_batches=2)
        np.testing.assert_allclose([loss for loss, _ in grid], [loss for loss, _ in whole],
                                   rtol=RTOL, atol=ATOL)
        for name, value in whole_params.items():
            np.testing.assert_allclose(grid_params[name], value, rtol=RTOL, atol=ATOL,
                                       err_msg=name)


def test_a_trace_names_each_rank_by_its_coordinates_cp_included():
    """A context group's ranks share (dp, pp, tp): the trace's rows tell them apart by
    their cp rank; without cp the labels are as before."""
    def labels(mesh, pipelined, sync="ring"):
        engine = SimpleNamespace(ctx=SimpleNamespace(mesh=SimpleNamespace(mesh=mesh)),
                                 plan=SimpleNamespace(placement=None, pipelined=pipelined),
                                 cfg=SimpleNamespace(sync=sync))
        return [StepEngine.trace_label(engine, r) for r in range(mesh.world_size)]

    assert labels(Mesh(4, 1, 1, 2, 1, 2), True) == [
        "rank 0 (dp 0, cp 0, pp 0, tp 0)", "rank 1 (dp 0, cp 0, pp 0, tp 1)",
        "rank 2 (dp 0, cp 1, pp 0, tp 0)", "rank 3 (dp 0, cp 1, pp 0, tp 1)"]
    assert labels(Mesh(2, 1, 1, 1, 1, 2), False) == ["worker 0 (ring, cp 0)",
                                                     "worker 1 (ring, cp 1)"]
    assert labels(Mesh(2, 1, 2, 1, 1, 1), True) == ["rank 0 (dp 0, pp 0, tp 0)",
                                                    "rank 1 (dp 0, pp 1, tp 0)"]
