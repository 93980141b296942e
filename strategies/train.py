"""The common training worker: one loop, the gradient synchronisation chosen by --sync.

One process (the reference every other --sync must reproduce):
    python -m strategies.train --sync local --model mlp --steps 200 --global-batch 64

Four processes on this host (mpiexec from the venv; `-m mpi4py` makes an
exception on one rank abort all of them instead of leaving the others hanging):
    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.train --sync ring \\
        --model gpt --layers 2 --d-model 128 --steps 200 --global-batch 64 --jsonl run.jsonl
    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.train --sync ps --servers 1 \\
        --consistency ssp --staleness 2          # 3 workers + 1 server
    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.train --sync hybrid --servers 1 \\
        --ranks-per-node 1                        # emulated nodes of 1 worker each

Several hosts (a hostfile lists them; ranks fill hosts in blocks, so
`hierarchical` and `hybrid` find real nodes by host name):
    mpiexec -f hosts.txt -n 8 -ppn 4 /path/.venv/bin/python -m mpi4py -m strategies.train \\
        --sync hierarchical --checkpoint-dir /shared/ckpt --checkpoint-every 100

torch.distributed's own launcher (only --sync torch; each process reads
RANK/WORLD_SIZE/MASTER_ADDR from torchrun):
    torchrun --nproc-per-node 2 -m strategies.train --sync torch --device cuda

Each step: this rank's B/P samples of the global batch -> forward -> backward
(buckets all-reduced meanwhile) -> sync.synchronize (wait for the rest) ->
optimizer step.  Every problem with the flags, the data or the checkpoint is
found before training, on every rank, and reported by every rank (exit 2).
"""
import os
import sys
import time

import numpy as np
import torch

from . import checkpoint, parallel
from .config import PS_SYNCS, ConfigError, parse_args
from .context import MPIControl, RunContext, require_psrv, under_torchrun
from .data import load_data
from .metrics import Metrics, now
from .models import build_model, count_parameters
from .sync import make_sync
from .trace import Tracer, write_chrome_trace


def prepare(argv=None):
    """Everything that can fail on bad input, with no collective but the context's.
    Returns (cfg, ctx, device, data, model, resume_state); every rank exits with the
    same error if any rank found one."""
    cfg = ctx = problem = None
    device = data = model = state = None
    try:
        cfg = parse_args(argv)
        ctx = RunContext.create(cfg)
        if cfg.sync in PS_SYNCS:
            require_psrv()
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // ctx.local_size))
        device = ctx.device(cfg)
        if not ctx.is_server:
            data = load_data(cfg)
            model = build_model(cfg, data.spec, device)
            state = checkpoint.read(cfg, ctx, model) if cfg.resume else None
            if cfg.on_grid:
                parallel.check(cfg, ctx.world_size)   # layers, heads, micro-batches vs grid
    except ConfigError as e:
        problem = str(e)
    if ctx is not None:
        control = ctx.control
    elif under_torchrun():
        raise ConfigError(problem)                 # torchrun reports every rank's failure
    else:
        from mpi4py import MPI
        control = MPIControl(MPI.COMM_WORLD)
    problems = control.allgather(problem)
    if any(problems):
        rank, first = next((r, p) for r, p in enumerate(problems) if p)
        mine = problem or f"rank {rank} failed: {first}"
        # one write per line, so that the ranks' lines do not interleave
        sys.stderr.write(f"strategies.train rank {control_rank(ctx)}: error: {mine}\n")
        sys.stderr.flush()
        control.barrier()                          # everyone has printed before anyone exits
        sys.exit(2)
    return cfg, ctx, device, data, model, state


def control_rank(ctx):
    if ctx is not None:
        return ctx.rank
    from mpi4py import MPI
    return MPI.COMM_WORLD.rank


def one_step(step, cfg, ctx, data, model, sync, optimizer, device, forward=None, tracer=None):
    """One training step; returns (local loss, compute s, exposed comm s, step s)."""
    t0 = now(device)
    x, y = data.batch(step, ctx.dp_rank, ctx.dp_size, cfg.global_batch, device)
    sync.before_backward()
    if ctx.rank == cfg.straggler_rank:             # --straggler: a slow GPU, seen as compute
        time.sleep(cfg.straggler_seconds)
    loss = model.criterion((forward or model)(x), y)
    t_forward = now(device) if tracer else None
    loss.backward()
    t1 = now(device)
    sync.synchronize(step)
    t2 = now(device)
    sync.step(optimizer)
    t3 = now(device)
    if tracer:                                     # --trace: the step's intervals, as lived
        tracer.add(f"forward {step}", "forward", t0, t_forward)
        tracer.add(f"backward {step}", "backward", t_forward, t1)
        tracer.add(f"wait for gradients {step}", "comm", t1, t2)
        tracer.add(f"optimizer {step}", "optimizer", t2, t3)
    return loss.item(), (t1 - t0) + (t3 - t2), t2 - t1, t3 - t0


def save_params(path, model):
    np.savez(path, **{n: p.detach().cpu().numpy() for n, p in model.named_parameters()})


def train(argv=None):
    """Train as the flags say; returns the run's summary on the writing rank, else None."""
    started = time.perf_counter()
    cfg, ctx, device, data, model, state = prepare(argv)
    if cfg.on_grid:                                # ZeRO, pipeline, tensor parallel
        return parallel.run(cfg, ctx, data, device)
    if cfg.sync in PS_SYNCS:
        role = ctx.attach_ps_role(cfg)
        if ctx.is_server:
            role.serve()                           # until every worker has closed
            return None
    sync = make_sync(cfg, ctx, device)
    sync.setup(model)
    optimizer = sync.make_optimizer(model)
    start = checkpoint.restore(state, model, optimizer, sync) if state else 0
    control = ctx.control if ctx.comm is None else MPIControl(ctx.dp_comm)
    metrics = Metrics(cfg, ctx, control, device, sync, start, cfg.global_batch)
    if ctx.dp_rank == 0 and start == 0:
        print(f"[{cfg.sync}] {cfg.model} with {count_parameters(model):,} parameters, "
              f"world {ctx.world_size}, dp {ctx.dp_size}, global batch {cfg.global_batch}, "
              f"data {data.name} ({len(data)} samples)", flush=True)
    tracer = Tracer(ctx.rank) if cfg.trace else None
    try:
        for step in range(start, cfg.steps):
            loss, compute_s, comm_s, step_s = one_step(step, cfg, ctx, data, model, sync,
                                                       optimizer, device, tracer=tracer)
            metrics.record(step, loss, step_s, compute_s, comm_s, sync)
            if cfg.checkpoint_dir and cfg.checkpoint_every and \
                    (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                checkpoint.save(cfg, ctx, step + 1, model, optimizer)
        if cfg.checkpoint_dir:
            if hasattr(sync, "save_state"):
                sync.save_state()
            checkpoint.save(cfg, ctx, cfg.steps, model, optimizer)
    except BaseException as e:
        sync.abort(e)                  # ps, hybrid: the servers hear of a crash, not a finish
        raise
    finally:
        sync.close()
    if cfg.params_out and ctx.dp_rank == 0:
        save_params(cfg.params_out, model)
    if tracer:                                     # workers only: servers have no steps
        events = control.allgather(tracer.events)
        if ctx.dp_rank == 0:
            labels = [f"worker {r} ({cfg.sync})" for r in range(len(events))]
            write_chrome_trace(cfg.trace, events, labels)
    return metrics.summary(time.perf_counter() - started)


def main(argv=None):
    """The command line (`topolab-train`): exit status 0 after a run.  Not the summary:
    a console script passes main's value to sys.exit, which prints a dict and exits 1."""
    train(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
