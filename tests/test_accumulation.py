"""Gradient accumulation (--grad-accum k, strategies/engine/accumulation.py): every tier.

Equivalence: k micro-batches of b/k samples, each loss scaled by its share 1/k, make
the step of the unsplit batch b; only the order of float additions changes (the sum of k
partial gradients), a few ulps per step.  Tolerance rtol = 1e-5, atol = 1e-6, as
for the other data-parallel equivalences (tests/test_train_runs.py), against
differences of O(lr * grad) ~ 1e-3 for a real bug (a micro-batch counted twice or
left out, a missing 1/k).

Communication once per step: the sync's comm_rounds (bucket all-reduces, or server
round trips) in each step record must be the unaccumulated run's, not k times it.
"""
import contextlib
import json

import numpy as np
import pytest
import torch
from conftest import each_bucket

import strategies
from strategies.engine.accumulation import Accumulation
from strategies.sync.buckets import GradBuckets
from strategies.config.choices import ConfigError
from strategies.compression.casts import make_compressor
from strategies.config.settings import TrainConfig, check_world
from strategies.model.models import MLP
from strategies.sync.gradient_sync import LocalSync
from test_parallel_runs import launch as launch_runs

RTOL, ATOL = 1e-5, 1e-6
B, STEPS = 16, 3


def mlp():
    torch.manual_seed(0)
    return MLP(8, 24, 2, 4)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, 8, generator=g), torch.randint(0, 4, (B,), generator=g)


class CountingSync(LocalSync):
    """One process's sync whose gradients go through GradBuckets, as data_parallel's do,
    built for the schedule's k backwards a step; the 'all-reduce' of one rank is the
    identity, counted by the buckets."""
    backwards_per_step = 1

    def setup(self, model):
        super().setup(model)
        self.buckets = GradBuckets(list(model.parameters()), each_bucket(lambda flat: None), 600,
                                   make_compressor("none"), overlap=True,
                                   backwards_per_step=self.backwards_per_step)

    def before_backward(self):
        self.buckets.zero_()

    def synchronize(self, step):
        self.buckets.wait()


def train(k, sync_class=LocalSync):
    model = mlp()
    sync = sync_class(None, None, torch.device("cpu"))
    sync.backwards_per_step = k                    # as data_parallel builds it
    sync.setup(model)
    schedule = Accumulation(model, model.criterion, k, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, rounds = [], []
    for step in range(STEPS):
        x, y = batch(step)
        sync.before_backward()
        losses.append(schedule.run(x, y, step).item())
        sync.synchronize(step)
        sync.step(opt)
        rounds.append(getattr(sync, "buckets", None) and sync.buckets.reductions)
    sync.close()
    if sync_class is CountingSync:
        sync.buckets.close()
    return losses, [p.detach().clone() for p in model.parameters()], rounds, sync


@pytest.mark.parametrize("sync_class", [LocalSync, CountingSync])
def test_accumulated_steps_equal_the_unsplit_batch(sync_class):
    ref_losses, ref_params, _, _ = train(1, sync_class)
    for k in (2, 4):
        losses, params, _, _ = train(k, sync_class)
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
        for a, b in zip(params, ref_params):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=RTOL, atol=ATOL)


def test_the_buckets_are_reduced_once_per_step_not_per_micro_step():
    *_, ref_rounds, sync = train(1, CountingSync)
    buckets = len(sync.buckets.buckets)
    assert buckets > 1                              # the 600-byte cap splits the MLP
    assert ref_rounds == [buckets * (s + 1) for s in range(STEPS)]
    assert train(4, CountingSync)[2] == ref_rounds


def test_a_second_backward_outside_no_sync_is_still_refused():
    model = mlp()
    sync = CountingSync(None, None, torch.device("cpu"))
    sync.setup(model)
    x, y = batch(0)
    model.criterion(model(x), y).backward()
    with pytest.raises(RuntimeError, match="second backward"):
        model.criterion(model(x), y).backward()
    sync.buckets.close()


def test_distributed_optimizer_no_sync_in_a_users_loop():
    """The DDP / Horovod pattern of the optimizer's docstring, ring over one rank."""
    from mpi4py import MPI

    def run(k):
        model = mlp()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with strategies.DistributedOptimizer(sgd, model, sync="ring", comm=MPI.COMM_SELF) as opt:
            for step in range(STEPS):
                x, y = batch(step)
                opt.zero_grad()
                for i, (xi, yi) in enumerate(zip(x.chunk(k), y.chunk(k))):
                    with opt.no_sync() if i < k - 1 else contextlib.nullcontext():
                        (model.criterion(model(xi), yi) / k).backward()
                opt.step()
            return [p.detach().clone() for p in model.parameters()], opt.sync.comm_rounds

    ref_params, ref_rounds = run(1)
    params, rounds = run(4)
    assert rounds == ref_rounds == STEPS           # one 25 MB bucket, once a step
    for a, b in zip(params, ref_params):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("flags,world,message", [
    (dict(grad_accum=0), 1, "--grad-accum must be >= 1"),
    (dict(grad_accum=2, pp=2, micro_batches=4, sync="ring"), 2,
     "--grad-accum 2 and --micro-batches 4 are the same thing on the grid"),
    (dict(grad_accum=3, model="moe", global_batch=8), 1,
     "--grad-accum 3 cuts each replica's 8 sequences"),
    (dict(grad_accum=7, global_batch=12, sync="ring"), 2,
     r"--grad-accum 7 is more than the 6 samples of each replica"),
])
def test_bad_combinations_name_their_flags(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        check_world(TrainConfig(**flags), world)


@pytest.mark.parametrize("flags,world", [(dict(grad_accum=4, global_batch=12, sync="ring"), 2),
                                         (dict(grad_accum=5, global_batch=12, sync="ps"), 3)])
def test_unequal_micro_batches_are_taken_on_every_run(flags, world):
    """6 samples in 4 (or 5) micro-batches: each loss scaled by its share (accumulation.py);
    the runs below train 8 samples in 3 against k = 1."""
    assert check_world(TrainConfig(**flags), world) == 2


def test_on_the_grid_grad_accum_is_micro_batches():
    """One concept: accumulating K micro-batches is what a pipeline's schedule does, so on
    the grid --grad-accum K is --micro-batches K (and the plain loop keeps its own)."""
    cfg = TrainConfig(grad_accum=2, pp=2, sync="ring")
    assert (cfg.micro_batches, cfg.grad_accum) == (2, 1)
    assert TrainConfig(grad_accum=3, micro_batches=3, zero=1, sync="ring").micro_batches == 3
    assert TrainConfig(grad_accum=2, sync="ring").grad_accum == 2


# --------------------------------------------------------------- under mpiexec
COMMON = ["--steps", STEPS, "--threads", 1, "--no-progress", "--model", "mlp", "--width", 24,
          "--depth", 2, "--in-dim", 8, "--classes", 4, "--dataset-size", 120,
          "--global-batch", B, "--lr", 0.05, "--momentum", 0.9]


def launch(tmp_path, nprocs, runs, timeout=200):
    """Each (name, flags) trained in one launch; {name: (step records, parameters)}."""
    return launch_runs(tmp_path, nprocs, runs, timeout=timeout, common=COMMON)


def assert_same(run, ref):
    (records, params), (ref_records, ref_params) = run, ref
    key = lambda r: (r["rank"], r["step"])                           # noqa: E731
    np.testing.assert_allclose([r["loss"] for r in sorted(records, key=key)],
                               [r["loss"] for r in sorted(ref_records, key=key)],
                               rtol=RTOL, atol=ATOL)
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)


def rounds(run):
    return sorted((r["rank"], r["step"], r["comm_rounds"]) for r in run[0])


def test_allreduce_syncs_accumulate_on_two_ranks(tmp_path):
    small = ["--bucket-mb", "0.001"]               # 1 KiB buckets: 3 all-reduces a step
    runs = launch(tmp_path, 2, [
        ("ring", ["--sync", "ring"] + small),
        ("ring_k4", ["--sync", "ring", "--grad-accum", 4] + small),
        ("ring_k3", ["--sync", "ring", "--grad-accum", 3] + small),    # 3, 3, 2 samples
        ("tree_k2", ["--sync", "tree", "--grad-accum", 2, "--no-overlap"]),
        ("mpi_k4", ["--sync", "mpi", "--grad-accum", 4]),
        ("ring_k2_recompute", ["--sync", "ring", "--grad-accum", 2, "--recompute",
                               "--trace", tmp_path / "trace.json"]),
    ])
    for name in ("ring_k4", "ring_k3", "tree_k2", "mpi_k4", "ring_k2_recompute"):
        assert_same(runs[name], runs["ring"])
    assert rounds(runs["ring_k4"]) == rounds(runs["ring_k3"]) == rounds(runs["ring"])
    assert {r["comm_rounds"] for r in runs["ring"][0]} == {3}
    assert {r["comm_rounds"] for r in runs["mpi_k4"][0]} == {1}      # one 25 MB bucket
    events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
    cats = {e.get("cat") for e in events}
    assert {"forward", "backward", "comm", "recompute"} <= cats
    # 2 ranks x 3 steps x 2 micro-steps x 1 segment of the depth-2 mlp
    assert sum(e.get("cat") == "recompute" for e in events) == 2 * STEPS * 2


def test_parameter_servers_accumulate_with_one_push_per_step(tmp_path):
    runs = launch(tmp_path, 3, [                   # 2 workers + 1 server
        ("ps", ["--sync", "ps", "--consistency", "bsp"]),
        ("ps_k4", ["--sync", "ps", "--consistency", "bsp", "--grad-accum", 4]),
        ("ps_k3", ["--sync", "ps", "--consistency", "bsp", "--grad-accum", 3]),  # 3, 3, 2
        ("hybrid_k2", ["--sync", "hybrid", "--ranks-per-node", 1, "--grad-accum", 2]),
    ])
    assert_same(runs["ps_k4"], runs["ps"])
    assert_same(runs["ps_k3"], runs["ps"])
    assert_same(runs["hybrid_k2"], runs["ps"])
    assert {r["comm_rounds"] for r in runs["ps_k4"][0]} == {1}       # one push_pull
    # hybrid, nodes of one worker: no all-reduce in a node of one, then one push_pull
    assert {r["comm_rounds"] for r in runs["hybrid_k2"][0]} == {1}
