"""The worker on a dp x pp x tp grid: ZeRO on dp, pipeline stages on pp, Megatron on tp.

    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \\
        --layers 4 --pp 2 --tp 2 --micro-batches 4 --schedule 1f1b --trace run.json
    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --zero 3 \\
        --optimizer adam --jsonl zero3.jsonl

How the pieces meet in one step (every rank):

    x, y = this dp replica's part of the global batch            (data.py)
    zero.before_backward()                                       (zero.py: dp axis)
    pipeline.run(x, y): micro-batches through this rank's stage  (pipeline.py: pp axis)
        each block's matrices split over the tp ranks            (tensor_parallel.py: tp axis)
        each layer's gradient reduced over dp as soon as backward finishes it
    zero.step(optimizer)                                         (update; stages 1-2 all-gather)
    the step's record: loss, times, bytes, memory, bubble        (memory.py, trace.py)

Reference semantics: every choice of dp, pp, tp, zero, micro-batches and schedule
trains the same model on the same global batch as `--sync local` on one
process; only the order of float additions differs.
"""
import sys
import time

import numpy as np

from allreduce import make_transport
from allreduce.records import append_jsonl, truncate_jsonl

from .config import ConfigError
from .grid import ProcessGrid
from .memory import ActivationMeter
from .metrics import peak_memory_mb
from .models import build_model
from .pipeline import Pipeline, Stage, stage_layers
from .sync import collective_for
from .tensor_parallel import TensorParallel, parallelize_blocks
from .trace import Tracer, busy_seconds, write_chrome_trace
from .zero import ZeRO


def check(cfg, world_size):
    """Every problem of the grid flags against the world and the model (ConfigError);
    TrainConfig checked the flags alone (--zero with --sync ps, the schedule's name)."""
    grid = ProcessGrid(world_size, cfg.dp, cfg.pp, cfg.tp)
    blocks, what = (cfg.layers, "--layers") if cfg.model == "gpt" else (cfg.depth, "--depth")
    if blocks % grid.pp:
        raise ConfigError(f"{what} {blocks} is not divisible by pp({grid.pp}): "
                          f"{blocks} % {grid.pp} = {blocks % grid.pp}")
    if grid.tp > 1:
        if cfg.model != "gpt":
            raise ConfigError(f"--tp {grid.tp}: tensor parallelism splits the GPT's attention "
                              "and MLP; use --model gpt")
        if cfg.heads % grid.tp:
            raise ConfigError(f"--heads {cfg.heads} is not divisible by tp({grid.tp}): "
                              f"{cfg.heads} % {grid.tp} = {cfg.heads % grid.tp}")
        if cfg.d_model % grid.tp:
            raise ConfigError(f"--d-model {cfg.d_model} is not divisible by tp({grid.tp})")
    if cfg.global_batch % grid.dp:
        raise ConfigError(f"--global-batch {cfg.global_batch} is not divisible by dp({grid.dp}): "
                          f"{cfg.global_batch} % {grid.dp} = {cfg.global_batch % grid.dp}")
    per_replica = cfg.global_batch // grid.dp
    if cfg.micro_batches > per_replica:
        raise ConfigError(f"--micro-batches {cfg.micro_batches} is more than the "
                          f"{per_replica} samples of each replica (global batch "
                          f"{cfg.global_batch} / dp({grid.dp}))")
    return grid


class GridWorker:
    """This rank's share of the model, its optimizer, and the step."""

    def __init__(self, cfg, comms, spec, device):
        self.cfg, self.comms = cfg, comms
        self.tracer = Tracer(comms.rank)
        model = build_model(cfg, spec, device)      # the whole model, same seed on every rank
        self.criterion = model.criterion
        self.originals = list(model.parameters())   # alive: no new parameter may reuse an id
        self.total_parameters = sum(p.numel() for p in self.originals)
        self.names = {id(p): n for n, p in model.named_parameters()}
        layers = stage_layers(model, comms.pp_rank, comms.pp_size)
        self.tp_coll = None
        if comms.tp_size > 1:                      # Megatron: split this stage's blocks
            self.tp_coll = collective_for(cfg.sync, cfg, comms.tp)
            tp = TensorParallel(self.tp_coll, comms.tp_rank, comms.tp_size, self.tracer)
            mine = [b for name, b in layers if name.startswith("blocks.")]
            parallelize_blocks(mine, tp)
            for name, block in layers:
                for local, p in block.named_parameters():
                    self.names.setdefault(id(p), f"{name}.{local}")
        self.module = Stage(layers)
        units = [(name, module, list(module.parameters())) for name, module in layers]
        self.zero = ZeRO(cfg.zero, units, collective_for(cfg.sync, cfg, comms.dp), cfg,
                         cfg.micro_batches, self.tracer)
        self.optimizer = self.zero.make_optimizer()
        self.meter = ActivationMeter(self.zero.param_storages,
                                     [self.zero] if cfg.zero == 3 else [])
        self.p2p = make_transport("mpi", comms.pp, cfg.timeout)
        feature = (cfg.seq_len, cfg.d_model) if cfg.model == "gpt" else (cfg.width,)
        self.pipeline = Pipeline(self.module, self.criterion, self.p2p, comms.pp_rank,
                                 comms.pp_size, cfg.micro_batches, cfg.schedule,
                                 lambda n: (n, *feature), self.tracer, self.meter)

    def transports(self):
        colls = [self.zero.coll] + ([self.tp_coll] if self.tp_coll else [])
        return [c.transport for c in colls] + [self.p2p]

    def traffic(self):
        ts = self.transports()
        return sum(t.bytes_sent for t in ts), sum(t.bytes_received for t in ts)

    def step(self, x, y):
        """One step; returns (this stage's loss or None, record fields)."""
        start = time.perf_counter()
        self.meter.reset_peak()
        self.zero.before_backward()
        loss = self.pipeline.run(x, y)
        self.zero.after_backward()
        pipeline_end = time.perf_counter()
        with self.tracer.span("optimizer", "optimizer"):
            self.zero.step(self.optimizer)
        end = time.perf_counter()
        self.tracer.add("step", "step", start, end)
        events = self.tracer.since(start)
        busy = busy_seconds(events)
        memory = self.zero.state_bytes(self.optimizer)
        memory.update(activations_peak=self.meter.peak_bytes,
                      gathered_peak=self.zero.peak_gathered_bytes)
        return loss, {
            "step_time_s": end - start, "compute_time_s": busy,
            "comm_time_s": busy_seconds(events, ("comm",)),
            "idle_time_s": busy_seconds(events, ("idle",)),
            "bubble_fraction": 1.0 - busy / self.pipeline_span(start, pipeline_end),
            "peak_in_flight": self.pipeline.peak_in_flight,
            "micro_batch_activation_bytes": self.pipeline.micro_batch_bytes, "memory": memory}

    def pipeline_span(self, start, end):
        """The flush-to-flush time of this step's pipeline: from the first stage's start to
        the last stage's end (ranks share one clock on a host).  The GPipe paper's bubble
        (p-1)/(m+p-1) is a share of this common span; a stage's own [start, end) would
        leave out the work of the others before it starts and after it ends."""
        spans = self.comms.pp.allgather((start, end))
        return max(e for _, e in spans) - min(s for s, _ in spans)

    def full_parameters(self):
        """(full name, local array, tp pieces, full shape) of this rank's parameters;
        ZeRO-3 layers are gathered for it (a collective on the dp axis)."""
        out = []
        for unit in self.zero.units:
            if self.cfg.zero == 3:
                unit.gather("save")
            for p in unit.params:
                out.append((self.names[id(p)], p.detach().cpu().numpy().copy(),
                            getattr(p, "tp_pieces", None), getattr(p, "full_shape", None)))
            if self.cfg.zero == 3:
                unit.release()
        return out


def assemble(pieces_per_rank):
    """The whole model's parameters from every rank's (name, local, tp pieces, full shape)."""
    full = {}
    for pieces in pieces_per_rank:
        for name, local, tp_pieces, shape in pieces:
            if tp_pieces is None:
                full[name] = local
                continue
            whole = full.setdefault(name, np.zeros(shape, dtype=local.dtype))
            for full_index, local_index in tp_pieces:
                whole[full_index] = local[local_index]
    return full


def run(cfg, ctx, data, device):
    """Train on the grid; every rank calls it after the preflight checks passed."""
    started = time.perf_counter()
    grid = check(cfg, ctx.world_size)
    comms = ctx.grid or grid.split(ctx.comm)
    worker = GridWorker(cfg, comms, data.spec, device)
    world = ctx.comm
    writer = world.rank == 0
    out = cfg.jsonl if writer else ""            # one run a file, as strategies.train
    if writer:
        n = worker.total_parameters
        print(f"[{cfg.sync}] {cfg.model} with {n:,} parameters on {grid.describe()}, "
              f"zero {cfg.zero}, {cfg.micro_batches} micro-batches ({cfg.schedule}), "
              f"global batch {cfg.global_batch}", flush=True)
        if out:
            truncate_jsonl(out)
            append_jsonl(out, [{"kind": "config", **cfg.as_dict(), "world_size": grid.world_size,
                                "dp_size": grid.dp, "pp_size": grid.pp, "tp_size": grid.tp}])
    reports = (comms.is_last_stage and comms.tp_rank == 0)
    traffic = worker.traffic()
    losses = []
    try:
        for step in range(cfg.steps):
            x, y = data.batch(step, comms.dp_rank, grid.dp, cfg.global_batch, device)
            local, fields = worker.step(x, y)
            loss = world.allreduce(local if reports else 0.0) / grid.dp
            sent, received = worker.traffic()
            record = {"kind": "step", "step": step, "rank": world.rank,
                      "coords": [comms.dp_rank, comms.pp_rank, comms.tp_rank], "loss": loss,
                      "local_loss": local, **fields, "bytes_sent": sent - traffic[0],
                      "bytes_received": received - traffic[1],
                      "peak_mem_mb": round(peak_memory_mb(device), 1)}
            traffic = (sent, received)
            records = world.gather(record, root=0)
            losses.append(loss)
            if out:
                append_jsonl(out, records)
    finally:
        worker.zero.close()
    pieces = worker.full_parameters() if cfg.params_out else []
    gathered = world.gather(pieces if comms.dp_rank == 0 else [], root=0)
    if writer and cfg.params_out:
        np.savez(cfg.params_out, **assemble(gathered))
    if cfg.trace:
        events = world.gather(worker.tracer.events, root=0)
        if writer:
            labels = [f"rank {r} (dp {c[0]}, pp {c[1]}, tp {c[2]})"
                      for r, c in enumerate(grid.coords_of(r) for r in range(grid.world_size))]
            write_chrome_trace(cfg.trace, events, labels)
    if writer:
        wall = time.perf_counter() - started
        summary = {"kind": "summary", "first_loss": losses[0], "final_loss": losses[-1],
                   "steps": cfg.steps, "wall_s": wall, "grid": grid.describe()}
        print(f"[{cfg.sync}] {grid.describe()} zero {cfg.zero}: loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f} in {cfg.steps} steps, wall {wall:.1f} s", flush=True)
        if out:
            append_jsonl(out, [summary])
        return summary
    return None


if __name__ == "__main__":
    sys.exit("run the grid worker through `python -m strategies.train --pp/--tp/--zero ...`")
