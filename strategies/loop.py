"""The training loop, written once: records, banner, checkpoints, trace and summary,
for every kind of run.  What differs between kinds is the step engine.

    engine = DataParallel(cfg, ctx, device, data, model)    train.py: one sync, the
                                                             model whole on each rank
    engine = GridEngine(cfg, ctx, device, data, model)      parallel.py: ZeRO, pipeline
                                                             and tensor parallel
    summary = run(cfg, ctx, device, data, engine, checkpoint_state, started)

An engine has three parts of the sync contract (sync.py) and a step:

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

Steps run from the checkpoint's step (or 0) to cfg.steps; the records and the
summary go through metrics.Metrics; checkpoints every --checkpoint-every steps
and at the end.  If a step raises, the sync hears of it (abort) before it closes:
parameter servers fail the run instead of waiting for a worker that is gone.
"""
import time
import uuid

import numpy as np

from . import checkpoint
from .config import world_of
from .metrics import Metrics
from .trace import Tracer, write_chrome_trace


class StepEngine:
    """The defaults of the engine interface above; each kind of run fills in the rest."""
    model = optimizer = sync = tracer = None
    parameters = 0               # of the whole model, for the banner

    def __init__(self, cfg, ctx, device, data, model):
        """What an engine without pipeline or tensor axes (pp = tp = 1) keeps: every rank
        a data-parallel worker.  GridEngine (parallel.py) sets its own from the grid."""
        self.cfg, self.ctx, self.device, self.data, self.model = cfg, ctx, device, data, model
        self.layout = {"world_size": ctx.world_size, "dp_size": ctx.dp_size, "pp_size": 1,
                       "tp_size": 1}
        self.tracer = Tracer(ctx.rank) if cfg.trace else None

    def step(self, step):
        raise NotImplementedError

    def traffic(self):
        return self.sync.bytes_sent, self.sync.bytes_received

    def describe(self):
        return ""

    def parameters_npz(self):
        return {n: p.detach().cpu().numpy() for n, p in self.model.named_parameters()}

    def trace_label(self, rank):
        return f"rank {rank}"


def run(cfg, ctx, device, data, engine, state, started):
    """Train `engine` as cfg says; returns the summary on the writing rank, else None.
    state: a checked checkpoint (checkpoint.read) to resume from, or None; started:
    the run's time.perf_counter() before preflight, for the summary's wall time."""
    control = ctx.workers                          # the ranks that train
    writer = control.rank == 0
    start = checkpoint.restore(state, engine.model, engine.optimizer, engine.sync) \
        if state else 0
    # one id for the run's records, the same on every rank; a resumed run keeps its own
    run_id = state["run_id"] if state else control.allgather(uuid.uuid4().hex[:12])[0]
    world = world_of(cfg, ctx.world_size)[1]
    metrics = Metrics(cfg, ctx, device, engine.traffic, start, run_id, engine.layout)
    if writer:
        print(f"[{cfg.sync}] {cfg.model} with {engine.parameters:,} parameters, {world}"
              f"{engine.describe()}, global batch {cfg.global_batch}, data {data.name} "
              f"({len(data)} samples)" + (f", resumed at step {start}" if start else ""),
              flush=True)
    try:
        for step in range(start, cfg.steps):
            local_loss, fields = engine.step(step)
            metrics.record(step, local_loss, fields)
            done = step + 1
            if cfg.checkpoint_dir and cfg.checkpoint_every and \
                    done % cfg.checkpoint_every == 0 and done < cfg.steps:
                checkpoint.save(cfg, ctx, done, engine.model, engine.optimizer, engine.sync,
                                run_id)
        if cfg.checkpoint_dir:
            checkpoint.save(cfg, ctx, cfg.steps, engine.model, engine.optimizer, engine.sync,
                            run_id)
    except BaseException as e:
        engine.sync.abort(e)           # ps, hybrid: the servers hear of a crash, not a finish
        raise
    finally:
        engine.sync.close()
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
