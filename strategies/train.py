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
(buckets all-reduced meanwhile; --grad-accum k: in k micro-steps, the first k-1
under sync.no_sync, accumulation.py) -> sync.synchronize (wait for the rest) ->
sync.step (the update).  The syncs are built by strategies.DistributedOptimizer,
the API a user's own loop has (optimizer.py); the loop around the step
(records, checkpoints, summary) is loop.py's, shared with the dp x pp x tp grid
(parallel.py).  Every problem with the flags, the data or the checkpoint is
found before training, on every rank, and reported by every rank (exit 2).
"""
import sys
import time

from allreduce.torch_transport import under_torchrun

from . import checkpoint, loop, recompute
from .accumulation import accumulate
from .choices import ConfigError
from .config import parse_args
from .context import MPIControl, RunContext
from .data import load_data
from .expert_parallel import ExpertParallel, check as check_experts
from .metrics import now
from .models import build_model, count_parameters
from .optimizer import DistributedOptimizer
from .parallel import GridEngine, check
from .precision import MixedPrecision, of_config
from .sync import make_optimizer


def prepare(argv=None):
    """Everything that can fail on bad input, with no collective but the context's.
    Returns (cfg, ctx, device, data, model, resume_state); every rank exits with the
    same error if any rank found one."""
    cfg = ctx = problem = None
    device = data = model = state = None
    try:
        cfg = parse_args(argv)
        ctx = RunContext.create(cfg)           # ps, hybrid: psrv.launch says who serves
        ctx.set_threads(cfg)
        device = ctx.device(cfg)
        if not ctx.is_server:
            data = load_data(cfg)
            model = build_model(cfg, data.spec, device)
            state = checkpoint.read(cfg, ctx, model) if cfg.resume else None
            if cfg.on_grid:
                check(cfg, ctx.world_size)     # layers, heads, micro-batches vs the grid
            if cfg.model == "moe":
                check_experts(cfg, ctx.world_size)   # experts, groups vs the world
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
        sys.stderr.write(f"strategies.train rank {control.rank}: error: {mine}\n")
        sys.stderr.flush()
        control.barrier()                          # everyone has printed before anyone exits
        sys.exit(2)
    return cfg, ctx, device, data, model, state


def one_step(step, cfg, ctx, data, model, sync, optimizer, device, forward=None, tracer=None,
             recompute=None, precision=None):
    """One training step; returns (local loss, compute s, exposed comm s, step s).
    Forward and backward run in --grad-accum micro-steps (accumulation.py), the
    communication once; recompute: recompute.Recompute of --recompute, or None;
    precision: a precision.MixedPrecision (None: fp32) around the forward, the backward
    and the update (fp16: skipped where the synchronised gradients overflowed)."""
    precision = precision or MixedPrecision()
    t0 = now(device)
    x, y = data.batch(step, ctx.dp_rank, ctx.dp_size, cfg.global_batch, device)
    sync.before_backward()
    if ctx.rank == cfg.straggler_rank:             # --straggler: a slow GPU, seen as compute
        time.sleep(cfg.straggler_seconds)
    loss = accumulate(step, model, forward or model, x, y, cfg.grad_accum, sync,
                      lambda: now(device), tracer, recompute, precision)
    t1 = now(device)
    sync.synchronize(step)
    t2 = now(device)
    # every rank holds the same averaged gradients, so every rank skips the same steps
    precision.step([p.grad for p in model.parameters()], lambda: sync.step(optimizer))
    t3 = now(device)
    if tracer:                                     # --trace: the step's intervals, as lived
        tracer.add(f"wait for gradients {step}", "comm", t1, t2)
        tracer.add(f"optimizer {step}", "optimizer", t2, t3)
    return loss.item(), (t1 - t0) + (t3 - t2), t2 - t1, t3 - t0


class DataParallel(loop.StepEngine):
    """The whole model on every worker, a sync of the contract between them: local,
    an all-reduce, or parameter servers.  DistributedOptimizer builds the sync (the one
    place that knows every kind); the step drives the contract on it directly, as
    one_step times each call."""

    def __init__(self, cfg, ctx, device, data, model):
        super().__init__(cfg, ctx, device, data, model)
        opt = DistributedOptimizer(
            make_optimizer(cfg, model.parameters()), model, sync=cfg.sync, comm=ctx.dp_comm,
            role=ctx.role, bucket_mb=cfg.bucket_mb, overlap=cfg.overlap, compress=cfg.compress,
            error_feedback=cfg.error_feedback,
            momentum_correction=cfg.momentum if cfg.momentum_correction else 0.0,
            ranks_per_node=cfg.ranks_per_node, timeout=cfg.timeout,
            consistency=cfg.consistency, staleness=cfg.staleness,
            link_latency_us=cfg.link_latency_us, link_gbps=cfg.link_gbps)
        self.sync, self.optimizer = opt.sync, opt.optimizer
        self.parameters = count_parameters(model)
        # the model's fp32 parameters are the master weights; autocast casts them per matmul
        self.precision = of_config(cfg, device.type)
        self.recompute = recompute.enable(cfg, model, self.tracer)   # --recompute, or None
        self._wire = (0, 0)                        # wire and dense bytes after the last step

    def step(self, step):
        rounds_before = self.sync.comm_rounds
        loss, compute_s, comm_s, step_s = one_step(step, self.cfg, self.ctx, self.data,
                                                   self.model, self.sync, self.optimizer,
                                                   self.device, tracer=self.tracer,
                                                   recompute=self.recompute,
                                                   precision=self.precision)
        # comm_rounds: this step's collectives (one per gradient bucket) or server round
        # trips; the same with --grad-accum k as without, which is the point of no_sync
        return loss, {"step_time_s": step_s, "compute_time_s": compute_s,
                      "comm_time_s": comm_s, "staleness": self.sync.staleness,
                      "comm_rounds": self.sync.comm_rounds - rounds_before,
                      **self.wire_fields(), **self.precision.record()}

    def wire_fields(self):
        """This step's gradient bytes handed to the collectives (`wire_bytes`) and what
        float32 all-reduces would have handed over (`dense_bytes`); none where the sync
        does not count them (local, ps, hybrid)."""
        wire, dense = self.sync.wire_bytes, self.sync.dense_bytes
        if wire is None:
            return {}
        before, self._wire = self._wire, (wire, dense)
        return {"wire_bytes": wire - before[0], "dense_bytes": dense - before[1]}

    def trace_label(self, rank):
        return f"worker {rank} ({self.cfg.sync})"


def train(argv=None):
    """Train as the flags say; returns the run's summary on the writing rank, else None."""
    started = time.perf_counter()
    cfg, ctx, device, data, model, state = prepare(argv)
    if ctx.is_server:
        ctx.role.serve()                           # until every worker has closed
        return None
    engine = (GridEngine if cfg.on_grid else ExpertParallel if cfg.ep > 1 else DataParallel)(
        cfg, ctx, device, data, model)
    return loop.run(cfg, ctx, device, data, engine, state, started)


def main(argv=None):
    """The command line (`topolab-train`): exit status 0 after a run.  Not the summary:
    a console script passes main's value to sys.exit, which prints a dict and exits 1."""
    train(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
