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
RANK/WORLD_SIZE/MASTER_ADDR from torchrun; every split runs, the mesh's axes being
torch process groups: allreduce/torch_comm.py):
    torchrun --nproc-per-node 2 -m strategies.train --sync torch --device cuda
    torchrun --standalone --nproc-per-node 4 -m strategies.train --sync torch \
        --model gpt --layers 4 --dp 2 --pp 2 --micro-batches 4

Each step: this rank's B/P samples of the global batch -> forward -> backward
(buckets all-reduced meanwhile; --micro-batches k: in k micro-batches, a bucket leaving
on its k-th backward, accumulation.py) -> sync.synchronize (wait for the rest) ->
sync.step (the update).  engine/parallelize.py cuts the model for the flags (tensor,
recompute, pipeline, experts, then data parallelism: ZeRO, or the syncs that
strategies.DistributedOptimizer builds, the API a user's own loop has); the one step
and the loop around it (records, checkpoints, summary) are engine/loop.py's.  Every
problem with the flags, the data or the checkpoint is found before training, on every
rank, and reported by every rank (exit 2).
"""
import sys
import time
import traceback

from allreduce.torch_world import under_torchrun
from psrv.link import PSError

from .config.choices import ConfigError
from .config.optimizer_checks import check_same_config
from .config.settings import (check_memory, check_outputs, parse_args, with_moe_group,
                              world_of)
from .engine import loop
from .engine.grid import with_stage_split
from .engine.loop import StepEngine
from .model.data import load_data
from .model.models import build_model
from .runtime import checkpoint
from .runtime.context import MPIControl, RunContext
from .runtime.exits import AgreedExit, FailedRank, end_together, finish
from .runtime.waits import Bounded, bounded


def prepare(argv=None):
    """Everything that can fail on bad input, with no collective but the settings'
    check and the context's.  Returns (cfg, ctx, device, data, model, resume_state); every rank exits with the
    same error if any rank found one."""
    cfg = ctx = problem = None
    device = data = model = state = None
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        problem = str(e)
    if not under_torchrun():
        # the one cross-rank check of the settings, on every run, before the context's
        # collectives, which ranks of other settings would enter unlike each other
        from mpi4py import MPI
        world = MPIControl(MPI.COMM_WORLD)
        everyone = world.allgather(cfg)
        if problem is None and None not in everyone:
            problem = same_config_problem(everyone, cfg)
        report(world, problem)
    try:
        if cfg is None:                        # torchrun: a bad flag, reported below
            raise ConfigError(problem)
        ctx = RunContext.create(cfg)           # ps, hybrid: psrv.launch says who serves
        if under_torchrun():                   # its world exists from here on
            check_same_config(ctx.control.allgather(cfg), cfg)
        check_outputs(cfg, writer=ctx.rank == 0)   # before any work, not after it
        dp = world_of(cfg, ctx.world_size)[0]
        cfg = with_moe_group(cfg, dp)          # the gating group in force, in the records
        check_memory(cfg, dp, ctx.local_size)  # vs free memory
        ctx.set_threads(cfg)
        device = ctx.device(cfg)
        if not ctx.is_server:
            data = load_data(cfg)
            model = build_model(cfg, data.spec, device)
            cfg = with_stage_split(cfg, model)     # the pipeline's split, in the records
            state = checkpoint.read(cfg, ctx, model) if cfg.resume else None
    except ConfigError as e:
        problem = str(e)
    if ctx is not None:
        report(ctx.control, problem)
    elif under_torchrun():
        raise ConfigError(problem)                 # torchrun reports every rank's failure
    else:
        from mpi4py import MPI
        report(MPIControl(MPI.COMM_WORLD), problem)
    return cfg, ctx, device, data, model, state


def same_config_problem(everyone, cfg):
    try:
        check_same_config(everyone, cfg)
    except ConfigError as e:
        return str(e)
    return None


def report(control, problem):
    """Collective: if any rank has a problem, every rank prints one line (its own, or
    the first rank's) and exits 2."""
    problems = control.allgather(problem)
    if any(problems):
        rank, first = next((r, p) for r, p in enumerate(problems) if p)
        mine = problem or f"rank {rank} failed: {first}"
        # one write per line, so that the ranks' lines do not interleave
        sys.stderr.write(f"strategies.train rank {control.rank}: error: {mine}\n")
        sys.stderr.flush()
        control.barrier()                          # everyone has printed before anyone exits
        raise AgreedExit(2)                        # every rank: MPI finalized (exits.py)


def train(argv=None):
    """Train as the flags say; returns the run's summary on the writing rank, else None."""
    started = time.perf_counter()
    cfg, ctx, device, data, model, state = prepare(argv)
    if ctx.is_server:
        ctx.role.serve()                           # until every worker has closed
        return None
    # every control wait of the workers (records, barriers, checkpoints) within
    # --timeout, as the gradients' and the pipeline's already are (runtime/waits.py)
    ctx.workers = bounded(ctx.workers, cfg.timeout)
    # one engine: engine/parallelize.py cuts the model as the flags say, the engine
    # runs its micro-batches through the schedule, step after step
    try:
        engine = StepEngine(cfg, ctx, device, data, model)
        return loop.run(cfg, ctx, device, data, engine, state, started)
    except Exception as e:
        if isinstance(ctx.workers, Bounded):       # the ranks can agree to end (main)
            raise FailedRank(ctx.workers) from e
        raise


def main(argv=None):
    """The command line (`topolab-train`): exit status 0 after a run.  Not the summary:
    a console script passes main's value to sys.exit, which prints a dict and exits 1.
    A peer that never came (a wait past --timeout) or failed (a ps server's error
    naming it) is one line and exit 1 on the rank that waited; a rank's own error its
    traceback and exit 1.  An exit every rank takes together (a refused flag, a signal's
    agreed stop, a failure once every rank has said it ends: runtime/exits.py)
    finalizes MPI, which removes MPICH's shared-memory segments, where main reads the
    command line (argv None): the process ends there; a rank that stays silent leaves
    the others the exit, which `python -m mpi4py` turns into MPI_Abort.  Called with an
    argv from Python, as several runs in one process are, main agrees nothing and
    leaves MPI running for the next."""
    failed = None
    try:
        train(argv)
    except FailedRank as e:
        failed = e                                 # handled below, outside this handler
    except (TimeoutError, PSError) as e:          # waits.WaitTimeout, CollectiveTimeout;
        # a server's: the workers' keys never came, or its bind failed (psrv.launch)
        sys.stderr.write(f"strategies.train: error: {e}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    except AgreedExit as e:
        if argv is None:
            finish()
        raise SystemExit(e.code) from None
    if failed is not None:
        ended_by_error(failed, argv is None)
    return 0


def ended_by_error(failed, command_line):
    """A worker's run stopped on an error: the traceback of this rank's own, at once; one
    line for a peer that never came or failed (a wait past --timeout, a server's error
    naming it).  On the command line the ranks then agree to end and finalize MPI
    (runtime/exits.py), and the line says what the failed ranks said, or who stayed
    silent.  Exit 1 either way; in-process callers get the exception itself, but for a
    timeout (one line, exit 1, as on the command line)."""
    error, control = failed.__cause__, failed.control
    own = not isinstance(error, (TimeoutError, PSError))
    if not command_line and not isinstance(error, TimeoutError):
        raise error                                # as it came, for the caller to handle
    if own:
        traceback.print_exception(error)
        why = f"rank {control.rank} failed: {type(error).__name__}: {error}"
    else:
        why = str(error)
    notices, silent = end_together(control, why, control.timeout, own) if command_line \
        else ({}, None)
    causes = [w for r, (o, w) in (notices or {}).items() if o and r != control.rank]
    if not own or silent:
        line = "; ".join([why, *causes, *([silent] if silent else [])])
        sys.stderr.write(f"strategies.train: error: {line}\n")
        sys.stderr.flush()
    raise SystemExit(1) from None


if __name__ == "__main__":
    sys.exit(main())
