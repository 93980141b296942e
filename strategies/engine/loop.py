"""The training loop, written once: records, banner, checkpoints, trace and summary,
for every kind of run.  What differs between kinds is the step engine.

    engine = DataParallel(cfg, ctx, device, data, model)    below: one sync, the
                                                             model whole on each rank
    engine = GridEngine(cfg, ctx, device, data, model)      engine/grid.py: ZeRO, pipeline
                                                             and tensor parallel
    summary = run(cfg, ctx, device, data, engine, checkpoint_state, started)

An engine has three parts of the sync contract (sync/gradient_sync.py) and a step:

    engine.model, engine.optimizer   what this rank trains and its optimizer
    engine.sync                      a GradientSync: the loop calls its state_dict and
                                     load_state_dict (checkpoints), abort and close
    engine.step(step) -> (local loss or None, record fields)
                                     one training step; inside it the engine calls
                                     the sync's before_backward, synchronize and step
    engine.traffic() -> (bytes sent, bytes received) of this rank so far (None: not
                                     observable)
    engine.layout, engine.describe() the run's sizes for the records, the banner's tail
    engine.parameters_npz() -> {name: array} on the writer (collective), for --params-out
    engine.tracer, engine.trace_label(rank)   --trace: a Tracer, each rank's track name

The data-parallel step itself, timed, is one_step: DataParallel's, ExpertParallel's
(expert_parallel.py) and strategies.bench's.

Steps run from the checkpoint's step (or 0) to cfg.steps; the records and the
summary go through metrics.Metrics; checkpoints every --checkpoint-every steps
and at the end.  If a step raises, the sync hears of it (abort) before it closes:
parameter servers fail the run instead of waiting for a worker that is gone.
Under --sync ps, SIGINT and SIGTERM end the run at a step the workers agree on
(stopping.py), with the checkpoint set of that step, and exit 128 + the signal.
"""
import signal
import sys
import time
import uuid

import numpy as np

from ..config.sections import PrecisionOptions, SyncOptions
from ..config.settings import world_of
from ..model.models import count_parameters, signature
from ..parallel import recompute
from ..runtime import checkpoint
from ..runtime.metrics import Metrics, now
from ..runtime.precision import MixedPrecision, of_config
from ..runtime.trace import Tracer, write_chrome_trace
from ..sync.gradient_sync import torch_optimizer
from .accumulation import accumulate
from .optimizer import DistributedOptimizer
from .stopping import NoStop, SignalStop


class StepEngine:
    """The defaults of the engine interface above; each kind of run fills in the rest."""
    model = optimizer = sync = tracer = precision = None
    parameters = 0               # of the whole model, for the banner
    signature = ()               # of the whole model, for checkpoints (models.signature)
    _wire = (0, 0)               # the sync's wire and dense bytes after the last step

    def __init__(self, cfg, ctx, device, data, model):
        """What an engine without pipeline or tensor axes (pp = tp = 1) keeps: every rank
        a data-parallel worker.  GridEngine (engine/grid.py) sets its own from the grid."""
        self.cfg, self.ctx, self.device, self.data, self.model = cfg, ctx, device, data, model
        self.signature = signature(model)          # before an engine keeps a share of it
        self.layout = {"world_size": ctx.world_size, "dp_size": ctx.dp_size, "pp_size": 1,
                       "tp_size": 1}
        self.tracer = Tracer(ctx.rank) if cfg.trace else None

    def step(self, step):
        raise NotImplementedError

    def traffic(self):
        return self.sync.bytes_sent, self.sync.bytes_received

    def describe(self):
        return ""

    def wire_fields(self):
        """This step's gradient bytes handed to the collectives (`wire_bytes`) and what
        float32 all-reduces would have handed over (`dense_bytes`); none where the sync
        does not count them (local, ps, hybrid).  Top-k adds `kept_ratio`, the fraction
        of each bucket it sent (above RATIO only during --sparsity-warmup)."""
        wire, dense = self.sync.wire_bytes, self.sync.dense_bytes
        if wire is None:
            return {}
        before, self._wire = self._wire, (wire, dense)
        kept = self.sync.kept_ratio
        return {"wire_bytes": wire - before[0], "dense_bytes": dense - before[1],
                **({} if kept is None else {"kept_ratio": kept})}

    def parameters_npz(self):
        return {n: p.detach().cpu().numpy() for n, p in self.model.named_parameters()}

    def trace_label(self, rank):
        return f"rank {rank}"


def one_step(step, cfg, ctx, data, model, sync, optimizer, device, forward=None, tracer=None,
             recompute=None, precision=None, agree=None):
    """One training step; returns (local loss, compute s, exposed comm s, step s).
    Forward and backward run in --grad-accum micro-steps (accumulation.py), the
    communication once; recompute: recompute.Recompute of --recompute, or None;
    precision: a precision.MixedPrecision (None: fp32) around the forward, the backward
    and the update (fp16: skipped where the synchronised gradients overflowed);
    agree: the ranks' overflow vote (precision.any_rank_of) where ranks hold different
    gradients (expert parallelism), None where every rank holds the same."""
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
    # data parallel: every rank holds the same averaged gradients, so every rank skips
    # the same steps; expert parallel: `agree` makes them
    precision.step(sync.gradients(), lambda: sync.step(optimizer), agree)
    t3 = now(device)
    if tracer:                                     # --trace: the step's intervals, as lived
        tracer.add(f"wait for gradients {step}", "comm", t1, t2)
        tracer.add(f"optimizer {step}", "optimizer", t2, t3)
    return loss.item(), (t1 - t0) + (t3 - t2), t2 - t1, t3 - t0


class DataParallel(StepEngine):
    """The whole model on every worker, a sync of the contract between them: local,
    an all-reduce, or parameter servers.  DistributedOptimizer builds the sync (the one
    place that knows every kind); the step drives the contract on it directly, as
    one_step times each call."""

    def __init__(self, cfg, ctx, device, data, model):
        super().__init__(cfg, ctx, device, data, model)
        settings = {**vars(cfg.section(SyncOptions)), **vars(cfg.section(PrecisionOptions))}
        opt = DistributedOptimizer(torch_optimizer(cfg, model.parameters()), model,
                                   comm=ctx.dp_comm, role=ctx.role, **settings)
        self.sync, self.optimizer = opt.sync, opt.optimizer
        self.parameters = count_parameters(model)
        # the model's fp32 parameters are the master weights; autocast casts them per matmul
        self.precision = of_config(cfg, device.type)
        self.recompute = recompute.enable(cfg, model, self.tracer)   # --recompute, or None

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

    def trace_label(self, rank):
        return f"worker {rank} ({self.cfg.sync})"


def run(cfg, ctx, device, data, engine, state, started):
    """Train `engine` as cfg says; returns the summary on the writing rank, else None.
    state: a checked checkpoint (checkpoint.read) to resume from, or None; started:
    the run's time.perf_counter() before preflight, for the summary's wall time."""
    control = ctx.workers                          # the ranks that train
    writer = control.rank == 0
    start = checkpoint.restore(state, engine, control) if state else 0
    # one id for the run's records, the same on every rank; a resumed run keeps its own
    run_id = state["run_id"] if state else control.allgather(uuid.uuid4().hex[:12])[0]
    world = world_of(cfg, ctx.world_size)[1]
    metrics = Metrics(cfg, ctx, device, engine.traffic, start, run_id, engine.layout)
    if writer:
        print(f"[{cfg.sync}] {cfg.model} with {engine.parameters:,} parameters, {world}"
              f"{engine.describe()}, global batch {cfg.global_batch}, data {data.name} "
              f"({len(data)} samples)" + (f", resumed at step {start}" if start else ""),
              flush=True)
    stop = SignalStop(control, cfg.timeout) if engine.sync.signal_stop else NoStop()
    saved = stopped = start            # steps of the last checkpoint, and where the run ends
    try:
        with stop:
            for step in range(start, cfg.steps):
                if stop.at(step):
                    break
                local_loss, fields = engine.step(step)
                done = stopped = step + 1
                meet = done == cfg.steps or cfg.checkpoint_every and \
                    done % cfg.checkpoint_every == 0
                if meet:   # every worker at `done` before the servers save it; and none in
                    control.barrier()   # the records' allgather while one waits (stopping.py)
                metrics.record(step, local_loss, fields)
                if meet and cfg.checkpoint_dir:
                    checkpoint.save(cfg, ctx, done, engine, run_id)
                    saved = done
            if stopped < cfg.steps:              # stopped by a signal, at an agreed step
                control.barrier()
                metrics.flush()
                if cfg.checkpoint_dir and stopped > saved:
                    checkpoint.save(cfg, ctx, stopped, engine, run_id)
                    saved = stopped
    except BaseException as e:
        engine.sync.abort(e)           # ps, hybrid: the servers hear of a crash, not a finish
        raise
    finally:
        engine.sync.close()
    if stopped < cfg.steps:
        if stopped > start:
            metrics.summary(time.perf_counter() - started, world)
        if writer:
            sys.stderr.write(f"strategies.train: stopped by {signal.Signals(stop.signum).name} "
                             f"after step {stopped} of {cfg.steps}" + (
                                 f"; checkpoint of step {saved} in {cfg.checkpoint_dir} "
                                 f"(--resume goes on from it)" if cfg.checkpoint_dir else "")
                             + "\n")
        raise SystemExit(128 + stop.signum)
    if cfg.params_out:
        params = engine.parameters_npz()
        if writer:
            np.savez(cfg.params_out, **params)
    if cfg.trace:                                  # workers only: servers have no steps
        events = control.allgather(engine.tracer.events)
        if writer:
            write_chrome_trace(cfg.trace, events, [engine.trace_label(r)
                                                   for r in range(len(events))])
    return metrics.summary(time.perf_counter() - started, world)
