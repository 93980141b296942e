"""The training loop, written once, over one step engine, for every kind of run.

    engine = StepEngine(cfg, ctx, device, data, model)   parallelize.py cuts the model
    summary = run(cfg, ctx, device, data, engine, checkpoint_state, started)

One step, on every rank of every run (Megatron-LM's forward_backward_func and
torchtitan's train_step have the same shape):

    x, y = this dp replica's share of the global batch           (model/data.py)
        and of its positions, this cp rank's slice               (context_parallel.py)
    sync.before_backward()                                       (the sync's contract)
    schedule.run(x, y): the micro-batches forward and backward   (a Pipeline of pp >= 2
        gradients accumulate; the sync's collectives leave        stages, or the trivial
        as backward finishes them, once per step                  schedule of one stage:
                                                                  accumulation.py)
    sync.synchronize(step)                                       (every gradient came)
    the update: sync.step(optimizer), fp16's overflow skip       (runtime/precision.py)
    the record's fields                                          (below)

What an engine gives the loop: model, optimizer and sync (checkpoints: their
state_dicts; the sync's abort and close), precision, step(step) -> (local loss or
None, record fields), traffic() -> (bytes sent, bytes received) so far (None: not
observable), layout and describe() (the records, the banner), parameters_npz() on
the writer (collective: --params-out), tracer and trace_label(rank) (--trace).

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
from contextlib import nullcontext

import numpy as np

from ..config.settings import world_of
from ..model.models import count_parameters, signature
from ..parallel.context_parallel import my_positions
from ..runtime import checkpoint, waits
from ..runtime.context import control_of
from ..runtime.exits import AgreedExit
from ..runtime.metrics import Metrics, StepClock
from ..runtime.trace import Tracer, busy_seconds, span, write_chrome_trace
from .grid import assemble
from .parallelize import cut_into_layers, dropped_fraction, parallelize
from .stopping import NoStop, SignalStop


class StepEngine:
    """One rank's training: parallelize's plan (parallelize.py), one step at a time.

    plan: a parallelize.Parallelized built elsewhere (strategies.bench: torch's DDP);
    None: parallelize(model) as cfg says."""

    def __init__(self, cfg, ctx, device, data, model, plan=None):
        self.cfg, self.ctx, self.device, self.data = cfg, ctx, device, data
        self.signature = signature(model)          # the whole model's, for checkpoints
        self.parameters = count_parameters(model)  # the whole model's, for the banner
        # the grid's times and bubble are read off the spans: the grid always traces
        self.tracer = Tracer(ctx.rank) if cfg.trace or cut_into_layers(cfg) else None
        self.plan = plan or parallelize(model, ctx, cfg, device, self.tracer)
        p = self.plan
        self.model, self.sync, self.optimizer = p.model, p.sync, p.optimizer
        self.precision = p.precision
        mesh = ctx.mesh.mesh if ctx.mesh else None
        self.layout = {"world_size": ctx.world_size, "dp_size": ctx.dp_size,
                       "pp_size": mesh.pp if mesh else 1, "tp_size": mesh.tp if mesh else 1,
                       **({"ep_size": cfg.ep} if p.placement else {}),
                       **({"cp_size": cfg.cp} if p.context else {})}
        self._wire = (0, 0)                        # the sync's wire and dense bytes so far
        # the stages' meeting for the bubble's span, bounded by --timeout (collective)
        self.stages = waits.bounded(control_of(ctx.mesh.pp), cfg.timeout) \
            if self.plan.pipelined else None

    def step(self, step):
        """One training step (the module docstring); returns (this rank's loss where it
        holds one of the step's, else None; the record's fields)."""
        cfg, p, sync = self.cfg, self.plan, self.sync
        x, y = self.data.batch(step, self.ctx.dp_rank, self.ctx.dp_size, cfg.global_batch,
                               self.device)
        if p.context:                              # the same samples, this cp rank's positions
            comms = self.ctx.mesh
            x, y = (my_positions(t, comms.cp_rank, comms.cp_size, cfg.cp_order) for t in (x, y))
        rounds = sync.comm_rounds
        exchanged = (p.exchange.coll.bytes_sent, p.exchange.seconds) if p.exchange else None
        attended = (p.context.bytes_sent, p.context.seconds) if p.context else None
        # host times where spans are drawn (--trace, the grid's), else one wait a step
        clock = StepClock(self.device, host_times=self.tracer is not None)
        start = clock.mark()
        if self.ctx.rank == cfg.straggler_rank:    # --straggler: a slow GPU, seen as compute
            with span(self.tracer, f"straggler {step}", "forward"):
                time.sleep(cfg.straggler_seconds)
        if p.meter:
            p.meter.reset_peak()
        sync.before_backward()
        loss = p.schedule.run(x, y, step)
        t1 = clock.mark()
        # the exposed communication: the grid's spans are its times, so it is drawn
        # here; a whole model's clocked_times draws [t1, t2)
        with span(self.tracer, f"wait for gradients {step}", "comm") if p.pipelined \
                else nullcontext():
            sync.synchronize(step)
        t2 = clock.mark()
        # the grid's times are its spans'; a whole model's are clocked_times'
        with span(self.tracer, f"optimizer {step}", "optimizer") if p.pipelined \
                else nullcontext():
            if sync.scales_itself:   # 16-bit buffers, the servers: fp16's skip is its own
                sync.step(self.optimizer)
            else:   # every rank holds the same averaged gradients, or `agree` votes
                self.precision.step(sync.gradients(), lambda: sync.step(self.optimizer),
                                    sync.agree, sync.kept)
        # the loss and fp16's scale, copied to the host behind the update: one wait a step
        read = clock.read(loss, *self.precision.scalars())
        t3 = clock.mark()
        start, t1, t2, t3 = clock.seconds(start, t1, t2, t3)
        loss, *scalars = read.values()
        fields = {"step_time_s": t3 - start,
                  **(self.pipeline_times(start, t1, t3) if p.pipelined else
                     self.clocked_times(step, start, t1, t2, t3)),
                  "staleness": sync.staleness, "comm_rounds": sync.comm_rounds - rounds,
                  **self.wire_fields(), **self.precision.record(scalars)}
        if exchanged:                              # the experts' all-to-alls
            self.alltoall_fields(fields, *exchanged)
        if attended:                               # the attention cores' traffic
            self.context_fields(fields, *attended)
        return (loss if p.reports else None), fields

    def clocked_times(self, step, start, t1, t2, t3):
        """The whole model: [start, t1) is this rank's compute (forward and backward),
        [t1, t2) the exposed communication, [t2, t3) the update, compute again.  The
        comm_rounds (one per gradient bucket, or server round trip) are the same with k
        micro-batches as without: a bucket leaves on its k-th backward (accumulation.py)."""
        if self.tracer:                            # --trace: the step's intervals, as lived
            self.tracer.add(f"wait for gradients {step}", "comm", t1, t2)
            self.tracer.add(f"optimizer {step}", "optimizer", t2, t3)
        return {"compute_time_s": (t1 - start) + (t3 - t2), "comm_time_s": t2 - t1}

    def pipeline_times(self, start, t1, t3):
        """The grid: a rank's waits for its peers are interleaved with its compute, so
        the times are the spans': busy (forward, backward), comm, idle, and the bubble,
        the share of the flush-to-flush time of the pipeline this rank did not compute
        (the schedule's one stage at pp = 1: only its own gaps)."""
        self.tracer.add("step", "step", start, t3)
        events = self.tracer.since(start)
        busy = busy_seconds(events)
        comms, sync = self.ctx.mesh, self.sync
        memory = sync.state_bytes(self.optimizer)
        memory.update(activations_peak=self.plan.meter.peak_bytes,
                      gathered_peak=sync.peak_gathered_bytes)
        return {"coords": [comms.dp_rank, comms.pp_rank, comms.tp_rank],
                "compute_time_s": busy, "comm_time_s": busy_seconds(events, ("comm",)),
                "idle_time_s": busy_seconds(events, ("idle",)),
                "bubble_fraction": 1.0 - busy / self.pipeline_span(start, t1),
                "peak_in_flight": self.plan.schedule.peak_in_flight,
                "micro_batch_activation_bytes": self.plan.schedule.micro_batch_bytes,
                "memory": memory}

    def pipeline_span(self, start, end):
        """The flush-to-flush time of this step's pipeline: from the first stage's start to
        the last stage's end (ranks share one clock on a host).  The GPipe paper's bubble
        (p-1)/(m+p-1) is a share of this common span; a stage's own [start, end) would
        leave out the work of the others before it starts and after it ends."""
        spans = waits.allgather(self.stages, (start, end), "the pipeline's span")
        return max(e for _, e in spans) - min(s for s, _ in spans)

    def alltoall_fields(self, fields, bytes_before, seconds_before):
        """The experts' all-to-alls (two per MoE block in the forward, two in the
        backward) block the forward and backward: exposed communication, so where no
        spans are read (the whole model) their time moves from the compute to the
        communication; a pipeline's times already read it off their comm spans."""
        exchange = self.plan.exchange
        seconds, sent = exchange.seconds - seconds_before, exchange.coll.bytes_sent
        fields.update(alltoall_time_s=seconds,
                      alltoall_bytes=None if bytes_before is None else sent - bytes_before,
                      dropped_fraction=dropped_fraction(self.model))
        if not self.plan.pipelined:
            fields.update(compute_time_s=fields["compute_time_s"] - seconds,
                          comm_time_s=fields["comm_time_s"] + seconds)

    def context_fields(self, fields, bytes_before, seconds_before):
        """--cp: what the attention cores sent this step (`cp_bytes`: ring attention's
        key-value blocks and their gradients, or Ulysses' all-to-alls; None where the
        collective does not count), the time they waited for it (`cp_time_s`) and whose
        slice of the positions it is (`cp_rank`).
        That wait blocks the forward and backward: where no spans are read (the whole
        model), it moves from the compute to the communication, as the experts' does;
        the grid's times already read it off the cores' comm spans."""
        core = self.plan.context
        seconds = core.seconds - seconds_before
        sent = None if bytes_before is None or core.bytes_sent is None \
            else core.bytes_sent - bytes_before
        # the ranks of a context group share their (dp, pp, tp) coordinates
        fields.update(cp_bytes=sent, cp_time_s=seconds, cp_rank=self.ctx.mesh.cp_rank)
        if not self.plan.pipelined:
            fields.update(compute_time_s=fields["compute_time_s"] - seconds,
                          comm_time_s=fields["comm_time_s"] + seconds)

    def wire_fields(self):
        """This step's gradient bytes handed to the collectives (`wire_bytes`) and what
        float32 all-reduces would have handed over (`dense_bytes`); none where the sync
        does not count them (local).  Top-k adds `kept_ratio`, the fraction
        of each bucket it sent (above RATIO only during --sparsity-warmup)."""
        wire, dense = self.sync.wire_bytes, self.sync.dense_bytes
        if wire is None:
            return {}
        before, self._wire = self._wire, (wire, dense)
        kept = self.sync.kept_ratio
        return {"wire_bytes": wire - before[0], "dense_bytes": dense - before[1],
                **({} if kept is None else {"kept_ratio": kept})}

    def traffic(self):
        """This rank's bytes so far, of every counter the plan names (the sync's, the
        experts' all-to-alls', the tp all-reduces', the pipeline's messages); None where
        one of them is not observable."""
        counters = self.plan.counters
        sent, received = [c.bytes_sent for c in counters], [c.bytes_received for c in counters]
        if None in sent or None in received:
            return None, None
        return sum(sent), sum(received)

    def describe(self):
        """The banner's tail: the split, where there is one."""
        cfg, lay = self.cfg, self.plan.placement
        if lay:
            return f", ep {lay.ep}: experts {lay.per_rank} of {lay.experts} per rank, " \
                   f"{lay.replicas} replica(s) each"
        if not self.plan.pipelined:
            return "" if cfg.micro_batches == 1 else f", {cfg.micro_batches} micro-batches"
        v = f", {cfg.virtual_stages} chunks a rank" if cfg.virtual_stages > 1 else ""
        return f", zero {cfg.zero}, {cfg.micro_batches} micro-batches ({cfg.schedule}{v})"

    def trace_label(self, rank):
        """A rank's row in the trace, named by its coordinates; a context group's ranks
        share (dp, pp, tp), so their cp rank tells them apart."""
        mesh = self.ctx.mesh.mesh if self.ctx.mesh else None
        cp = f", cp {mesh.context_coords_of(rank)[1]}" if mesh and mesh.cp_enabled else ""
        if self.plan.placement:
            return f"rank {rank} (expert group {rank // self.cfg.ep}, ep {rank % self.cfg.ep}" \
                   f"{cp})"
        if self.plan.pipelined:
            d, p, t = mesh.coords_of(rank)
            return f"rank {rank} (dp {d}{cp}, pp {p}, tp {t})"
        return f"worker {rank} ({self.cfg.sync}{cp})"

    def parameters_npz(self):
        """The whole model's parameters on the writer (collective), for --params-out: the
        model itself where every rank holds it whole; else world rank 0 gathers the first
        replica's pieces (every stage and tp rank; the experts of the first expert group)
        and reassembles them (grid.assemble)."""
        p = self.plan
        if not (p.pipelined or p.placement):
            return {n: t.detach().cpu().numpy() for n, t in self.model.named_parameters()}
        experts = {id(t) for t in p.expert_params}
        first = self.ctx.mesh.dp_rank == 0 and self.ctx.mesh.cp_rank == 0
        mine = [piece for piece in self.pieces()
                if (first if piece[0] not in experts else p.placement.group == 0)]
        workers = self.ctx.mesh.world              # the servers hold no piece
        gathered = workers.gather([piece[1:] for piece in mine], root=0)
        return assemble(gathered) if workers.rank == 0 else {}

    def pieces(self):
        """(id, full name, local array, tp pieces, full shape) of this rank's parameters;
        ZeRO-3 layers are gathered for it (a collective on the dp axis)."""
        out = []
        for unit in self.sync.units:
            if self.cfg.zero == 3:
                unit.gather("save")
            for t in unit.params:
                pieces, shape = self.plan.tp_pieces.get(id(t), (None, None))  # None: whole
                out.append((id(t), self.plan.names[id(t)], t.detach().cpu().numpy().copy(),
                            pieces, shape))
            if self.cfg.zero == 3:
                unit.release()
        return out


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
                ended = time.perf_counter()        # before any wait for the others below
                done = stopped = step + 1
                meet = done == cfg.steps or cfg.checkpoint_every and \
                    done % cfg.checkpoint_every == 0
                if meet:   # every worker at `done` before the servers save it; and none in
                    control.barrier()   # the records' allgather while one waits (stopping.py)
                metrics.record(step, local_loss, fields, ended)
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
        raise AgreedExit(128 + stop.signum)      # every worker, at this step (exits.py)
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
