"""strategies.DistributedOptimizer on a model that is not one of ours, against one process.

    mpiexec -n 3 python -m mpi4py tests/mpi/distributed_optimizer.py equivalence
    mpiexec -n 3 python -m mpi4py tests/mpi/distributed_optimizer.py subcomm
    mpiexec -n 3 python -m mpi4py tests/mpi/distributed_optimizer.py errors
    mpiexec -n 3 python -m mpi4py tests/mpi/distributed_optimizer.py fp16_skip
    torchrun --standalone --nproc-per-node 2 tests/mpi/distributed_optimizer.py torchrun

Every rank starts from its own random weights; the optimizer must broadcast
rank 0's (parameters and buffers).  Each rank trains on its shard of every
global batch, and the run must end where one process training on the whole
batch ends (tests/test_distributed_optimizer.py states the tolerance).  Each
rank also checks its shard's loss at every step against that process's.
"""
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import strategies

RTOL, ATOL = 1e-5, 1e-6
B, STEPS, LR, MOMENTUM = 12, 4, 0.1, 0.9


class UserNet(nn.Module):
    """conv -> layer norm -> linear, and buffers of two dtypes (one that the
    collectives do not take: bool)."""

    def __init__(self, seed, width=3):
        torch.manual_seed(seed)
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.LayerNorm([4, 6, 6])
        self.head = nn.Linear(4 * 6 * 6, width)
        self.register_buffer("shift", torch.randn(4, 1, 1))
        self.register_buffer("keep", torch.rand(4 * 6 * 6) > 0.2)

    def forward(self, x):
        h = torch.relu(self.norm(self.conv(x) + self.shift))
        return self.head(h.flatten(1) * self.keep)


def say(line):
    """One write per line, so that the ranks' lines do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(B, 2, 6, 6, generator=g), torch.randint(0, 3, (B,), generator=g)


def shard(x, rank, size):
    n = B // size
    return x[rank * n:(rank + 1) * n]


def reference(seed, size, clip=None):
    """One process on the whole batch: the final state, and the loss of every
    shard of `size` at every step (what each rank must see)."""
    model = UserNet(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        with torch.no_grad():
            losses.append([F.cross_entropy(model(shard(x, r, size)), shard(y, r, size)).item()
                           for r in range(size)])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict(), losses


def train(seed, rank, clip=None, rtol=RTOL, atol=ATOL, **kwargs):
    """This rank's run with DistributedOptimizer(**kwargs); compares and returns the
    largest absolute difference from one process."""
    model = UserNet(seed + rank)
    with strategies.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), model,
            **kwargs) as opt:
        want_state, want_losses = reference(seed, opt.size, clip)
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(model(shard(x, opt.rank, opt.size)),
                                   shard(y, opt.rank, opt.size))
            loss.backward()
            if clip:
                opt.synchronize()                  # averaged gradients, then clip them
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            np.testing.assert_allclose(loss.item(), want_losses[step][opt.rank], rtol=rtol,
                                       atol=atol, err_msg=f"loss at step {step}")
    worst = 0.0
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value.numpy(), want_state[name].numpy(), rtol=rtol,
                                   atol=atol, err_msg=f"{kwargs}: {name}")
        worst = max(worst, (value.double() - want_state[name].double()).abs().max().item())
    return worst


def equivalence(world):
    """Every all-reduce sync over COMM_WORLD, then ps and hybrid (rank P-1 serves)."""
    from strategies.config.settings import ALLREDUCE_SYNCS
    rank = world.rank
    runs = [(name, {"sync": name}) for name in ALLREDUCE_SYNCS if name != "hierarchical"]
    runs += [("hierarchical", {"sync": "hierarchical", "ranks_per_node": 2}),   # nodes {0,1} {2}
             ("ring no-overlap", {"sync": "ring", "overlap": False}),
             ("tree one-bucket", {"sync": "tree", "bucket_mb": 25.0}),
             ("ring clip", {"sync": "ring", "clip": 0.5}),
             # 16 bits on the wire: the sums round to 11 significant bits (strategies/compression/casts.py)
             ("ring fp16", {"sync": "ring", "compress": "fp16", "rtol": 0, "atol": 2e-3}),
             ("ring bf16", {"sync": "ring", "compress": "bf16", "rtol": 0, "atol": 2e-2})]
    for label, kwargs in runs:
        kwargs.setdefault("bucket_mb", 0.001)      # ~1 KB: five buckets of one or more tensors
        worst = train(100, rank, **kwargs)
        say(f"rank {rank} {label}: ok, max |diff| {worst:.1e}")
    for name, extra in (("ps", {}), ("hybrid", {"ranks_per_node": 1})):
        role = strategies.ps_roles(servers=1, comm=world)
        if role.is_server:
            role.serve()                           # until both workers have closed
            say(f"rank {rank} {name}: served")
        else:
            worst = train(100, rank, sync=name, role=role, **extra)
            say(f"rank {rank} {name}: ok, max |diff| {worst:.1e}")


def subcomm(world):
    """Ranks {0, 1} and {2} train apart, each group from its first rank's weights."""
    rank = world.rank
    group = 0 if rank < 2 else 1
    sub = world.Split(group, rank)
    first = 0 if group == 0 else 2
    for name in ("ring", "torch"):                 # torch: groups made over the whole world
        worst = train(100 + first, rank - first, sync=name, comm=sub, bucket_mb=0.001)
        say(f"rank {rank} subcomm {name} group of {sub.size}: ok, max |diff| {worst:.1e}")
    # An LR schedule and a checkpoint go through to the wrapped optimizer.
    model = UserNet(7)
    with strategies.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                         momentum=0.9),
                                         model, sync="tree", comm=sub) as opt:
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 2, 6, 6)).sum().backward()
            opt.step()
            schedule.step()
        assert opt.optimizer.param_groups[0]["lr"] == 0.025, opt.optimizer.param_groups
        assert opt.state_dict()["param_groups"][0]["lr"] == 0.025
        assert len(opt.state_dict()["state"]) == len(list(model.parameters()))
    say(f"rank {rank} schedule: ok")
    # A checkpoint of one's own loop holds the sync's state too (top-k's residuals): a
    # loop stopped after 2 steps and resumed in a new optimizer ends where 4 steps do.
    for compress in ("topk:0.1", "powersgd:1"):
        whole, _ = resumed_loop(sub, compress, stop=None)
        resumed, saved = resumed_loop(sub, compress, stop=2)
        assert "data_parallel" in saved, sorted(saved)
        for name, value in whole.items():
            assert torch.equal(value, resumed[name]), (compress, name)
        say(f"rank {rank} resume {compress}: ok")


def resumed_loop(comm, compress, stop):
    """STEPS steps of ring data parallelism with `compress`; with `stop`, the model and
    the optimizer saved after that step and loaded into a fresh pair that goes on."""
    def optimizer(model):
        return strategies.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), model,
            sync="ring", comm=comm, compress=compress, bucket_mb=0.001)
    model, saved = UserNet(11), {}
    opt = optimizer(model)
    for step in range(STEPS):
        if step == stop:
            saved = {"model": model.state_dict(), "opt": opt.state_dict()}
            opt.close()
            model = UserNet(99)                     # other weights: the load must win
            opt = optimizer(model)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x, opt.rank, opt.size)), shard(y, opt.rank, opt.size)).backward()
        opt.step()
    opt.close()
    return model.state_dict(), saved.get("opt", {})


def push_compressor_state(role):
    """Under ps the servers keep the parameters, yet each worker's push compressor holds
    residuals the servers never see: the optimizer's state_dict carries them (without
    asking the servers to checkpoint: they have no --checkpoint-dir here), and
    load_state_dict takes them back."""
    model = UserNet(5)
    with strategies.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), model, sync="ps", role=role,
            compress="topk:0.1", bucket_mb=0.001) as opt:
        for step in range(2):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(shard(x, opt.rank, opt.size)),
                            shard(y, opt.rank, opt.size)).backward()
            opt.step()
        saved = opt.state_dict()
        opt.load_state_dict(saved)
        again = opt.state_dict()
    residuals = saved["data_parallel"]["compressor"]["feedback"]["residuals"]
    assert residuals and any(r.abs().sum() > 0 for r in residuals.values()), saved
    assert all(torch.equal(again["data_parallel"]["compressor"]["feedback"]["residuals"][k],
                           r) for k, r in residuals.items())


def errors(world):
    """Each bad argument raises on every rank; one line per rank and case."""
    from mpi4py import MPI
    rank = world.rank
    model = UserNet(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    split = nn.Linear(2, 2)
    split.bias = nn.Parameter(torch.zeros(2, device="meta"))
    cases = {
        "unknown sync": lambda: strategies.DistributedOptimizer(sgd, model, sync="rign"),
        "foreign parameters": lambda: strategies.DistributedOptimizer(
            torch.optim.SGD(UserNet(0).parameters(), lr=0.1), model),
        "not an optimizer": lambda: strategies.DistributedOptimizer(model, model),
        "two devices": lambda: wrap(split),
        "float64": lambda: wrap(nn.Linear(2, 2).double()),
        "comm not a communicator": lambda: strategies.DistributedOptimizer(sgd, model,
                                                                           comm="world"),
        "comm null": lambda: strategies.DistributedOptimizer(sgd, model, comm=MPI.COMM_NULL),
        "unknown compression": lambda: strategies.DistributedOptimizer(sgd, model,
                                                                       compress="int8"),
        "bucket size": lambda: strategies.DistributedOptimizer(sgd, model, bucket_mb=0),
        "mpi over torch": lambda: strategies.DistributedOptimizer(sgd, model, sync="mpi",
                                                                  transport="torch"),
        "ps without role": lambda: strategies.DistributedOptimizer(sgd, model, sync="ps"),
        "ps amsgrad": lambda: strategies.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), amsgrad=True), model, sync="ps"),
        "models differ": lambda: wrap(model if rank else UserNet(0, width=4)),
        "second backward": lambda: second_backward(model, sgd),
    }
    for case, make in cases.items():
        try:
            make()
        except Exception as e:
            say(f"rank {rank} error {case}: {type(e).__name__}: {e}")
        else:
            say(f"rank {rank} error {case}: none raised")


POISONED = 3          # fp16_skip: the step whose loss one rank multiplies by inf


def fp16_skip(world):
    """fp16 with a lossy compressor: one rank's step-3 loss times inf gives it inf and
    NaN gradients, which its buckets compress during backward, before the vote; the
    others' finite buckets move their compressors' state too.  The vote skips the step
    on every rank, the compressors' state goes back to the step's start, and the run
    ends where the run that never took step 3 ends.  Over the ring (3 ranks: topk,
    powersgd, fp8) and under ps (2 workers, 1 server: topk, whose pushes wait for the
    vote).  Then the push compressor's state through the optimizer's state_dict under ps
    (push_compressor_state)."""
    rank = world.rank
    for compress in ("topk:0.2", "powersgd:1", "fp8"):
        skipped = skipping_run(range(6), sync="ring", comm=world, compress=compress)
        never = skipping_run([0, 1, 2, 4, 5], sync="ring", comm=world, compress=compress)
        compare(skipped, never, f"rank {rank} fp16 skip ring {compress}")
    runs = []
    for steps in (range(6), [0, 1, 2, 4, 5]):
        role = strategies.ps_roles(servers=1, comm=world)
        if role.is_server:
            role.serve()
        else:
            runs.append(skipping_run(steps, sync="ps", role=role, compress="topk:0.2"))
    if runs:
        compare(*runs, f"rank {rank} fp16 skip ps topk:0.2")
    role = strategies.ps_roles(servers=1, comm=world)
    if role.is_server:
        role.serve()
    else:
        push_compressor_state(role)
        say(f"rank {rank} ps topk state: ok")


def skipping_run(steps, **kwargs):
    """(parameters, skips) after `steps` of fp16 at a scale of 2^10, the last rank's loss
    of step POISONED times inf."""
    model = UserNet(7)
    with strategies.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), model, precision="fp16",
            loss_scale=1024.0, loss_scale_window=1000, bucket_mb=0.001, **kwargs) as opt:
        for step in steps:
            x, y = batch(step)
            opt.zero_grad()
            with opt.autocast():
                loss = F.cross_entropy(model(shard(x, opt.rank, opt.size)).float(),
                                       shard(y, opt.rank, opt.size))
            poisoned = step == POISONED and opt.rank == opt.size - 1
            opt.backward(loss * float("inf") if poisoned else loss)
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}, opt.overflow_skips


def compare(skipped, never, label):
    """rtol 1e-6: the runs' scales differ by a power of two (2^9 after the skip, 2^10),
    which the unscaling undoes exactly; an inf kept in a residual makes every later
    step overflow, and a residual of the wrong scale moves the weights by ~1e-2."""
    (got, skips), (want, none) = skipped, never
    assert (skips, none) == (1, 0), (label, skips, none)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=f"{label}: {name}")
    say(f"{label}: ok")


def wrap(model):
    return strategies.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def second_backward(model, sgd):
    """Two backwards with no step between them: refused before the buckets are mixed."""
    with strategies.DistributedOptimizer(sgd, model, sync="ring", bucket_mb=0.001) as opt:
        opt.zero_grad()
        model(torch.ones(2, 2, 6, 6)).sum().backward()
        model(torch.ones(2, 2, 6, 6)).sum().backward()


def under_torchrun():
    rank = int(os.environ["RANK"])
    for name in ("torch", "ring"):                 # ring: over torch.distributed, no MPI
        worst = train(100, rank, sync=name, bucket_mb=0.001)
        say(f"rank {rank} torchrun {name}: ok, max |diff| {worst:.1e}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "torchrun":
        under_torchrun()
    else:
        from mpi4py import MPI
        {"equivalence": equivalence, "subcomm": subcomm, "errors": errors,
         "fp16_skip": fp16_skip}[mode](MPI.COMM_WORLD)
