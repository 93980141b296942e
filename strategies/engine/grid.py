"""The worker on a dp x pp x tp grid: ZeRO on dp, pipeline stages on pp, Megatron on tp.

    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \\
        --layers 4 --pp 2 --tp 2 --micro-batches 4 --schedule 1f1b --trace run.json
    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \\
        --layers 4 --pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2
    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --zero 3 \\
        --optimizer adam --jsonl zero3.jsonl

How the pieces meet in one step (every rank):

    x, y = this dp replica's part of the global batch            (data.py)
    zero.before_backward()                                       (zero.py: dp axis, a sync
    pipeline.run(x, y): micro-batches through this rank's stage   of the contract in sync/gradient_sync.py)
        each block's matrices split over the tp ranks            (tensor_parallel.py: tp axis)
        each layer's gradient reduced over dp as soon as backward finishes it
    zero.synchronize(step)                                       (every layer's gradient came)
    zero.step(optimizer)                                         (update; stages 1-2 all-gather)
    the step's fields: times, memory, bubble                     (memory.py, trace.py)

GridEngine is the step engine of the one training loop (loop.py): the records,
banner, summary and the global-batch check are the plain loop's as well.

Reference semantics: every choice of dp, pp, tp, zero, micro-batches and schedule
trains the same model on the same global batch as `--sync local` on one
process; only the order of float additions differs.
"""
import sys
import time

import numpy as np
import torch.nn as nn

from allreduce import make_transport

from ..model.models import signature
from ..parallel.interleaved import InterleavedPipeline, chunk_layers
from ..parallel.pipeline import Pipeline, Stage
from ..parallel.recompute import Recompute
from ..parallel.sequence_parallel import positions_per_rank, split_sequence
from ..parallel.tensor_parallel import TensorParallel, parallelize_blocks
from ..runtime.memory import ActivationMeter
from ..runtime.precision import any_rank_of, of_config
from ..runtime.trace import Tracer, busy_seconds
from ..sync.gradient_sync import build_compressor, collective_for
from ..sync.zero import ZeRO
from .loop import StepEngine


class GridEngine(StepEngine):
    """This rank's share of the model, its optimizer, and the step (loop.py's interface)."""

    def __init__(self, cfg, ctx, device, data, model):
        comms = ctx.mesh
        self.cfg, self.comms, self.data, self.device = cfg, comms, data, device
        self.tracer = Tracer(comms.rank)             # always: the bubble is read off it
        self.criterion = model.criterion
        self.signature = signature(model)            # the whole model's, for checkpoints
        self.originals = list(model.parameters())   # alive: no new parameter may reuse an id
        self.parameters = sum(p.numel() for p in self.originals)
        self.names = {id(p): n for n, p in model.named_parameters()}
        # v chunks of layers (interleaved.py), or the one stage of GPipe and 1F1B: v = 1
        chunks = chunk_layers(model, comms.pp_rank, comms.pp_size, cfg.virtual_stages)
        layers = [layer for chunk in chunks for layer in chunk]
        self.tp_coll, self.tp_pieces = None, {}
        if comms.tp_size > 1:                      # Megatron: split this stage's blocks
            self.tp_coll = collective_for(cfg.sync, cfg, comms.tp)
            tp = TensorParallel(self.tp_coll, comms.tp_rank, comms.tp_size, self.tracer)
            mine = [b for name, b in layers if name.startswith("blocks.")]
            parallelize_blocks(mine, tp)
            if cfg.sequence_parallel:              # LayerNorms on T/tp positions each
                layers = split_sequence(layers, tp)
            self.tp_pieces = tp.pieces
            for name, block in layers:
                for local, p in block.named_parameters():
                    self.names.setdefault(id(p), f"{name}.{local}")
        # --recompute: each GPT block of this stage checkpointed, after its tp split
        self.recompute = Recompute.of_blocks(
            [(n, b) for n, b in layers if n.startswith("blocks.")], self.tracer) \
            if cfg.recompute else None
        sizes = [len(chunk) for chunk in chunks]          # layers stay in order: re-cut
        stages = [Stage(layers[sum(sizes[:c]):sum(sizes[:c + 1])]) for c in range(len(sizes))]
        self.model = stages[0] if len(stages) == 1 else nn.ModuleList(stages)
        units = [(name, module, list(module.parameters())) for name, module in layers]
        self.precision = of_config(cfg)            # --precision: ZeRO's 16-bit buffers
        split = comms.mesh.pp_enabled or comms.mesh.tp_enabled   # a rank sees part of it
        # the comm thread's collective: its own communicator, beside the main thread's
        thread_coll = collective_for(cfg.sync, cfg, comms.dp.Dup()) if cfg.overlap else None
        compressor = build_compressor(cfg.compress, thread_coll, cfg.error_feedback,
                                      cfg.momentum if cfg.momentum_correction else 0.0,
                                      cfg.sparsity_warmup)
        self.sync = ZeRO(cfg.zero, units, collective_for(cfg.sync, cfg, comms.dp), cfg,
                         cfg.micro_batches, self.tracer, self.precision,
                         agree=any_rank_of(comms.world) if split else None,
                         thread_coll=thread_coll, compressor=compressor, overlap=cfg.overlap)
        self.sync.setup(self.model)
        self.optimizer = self.sync.make_optimizer()
        self.meter = ActivationMeter(self.sync.param_storages,
                                     [self.sync] if cfg.zero == 3 else [])
        self.p2p = make_transport("mpi", comms.pp, cfg.timeout)
        feature = (positions_per_rank(cfg, comms.tp_size), cfg.d_model) \
            if cfg.model == "gpt" else (cfg.width,)
        kind = InterleavedPipeline if cfg.schedule == "interleaved" else Pipeline
        self.pipeline = kind(stages, self.criterion, self.p2p, comms.pp_rank, comms.pp_size,
                             cfg.micro_batches, cfg.schedule, lambda n: (n, *feature),
                             self.tracer, self.meter, self.precision)
        self.pipeline.recompute = self.recompute
        grid = comms.mesh
        self.layout = {"world_size": grid.world_size, "dp_size": grid.dp, "pp_size": grid.pp,
                       "tp_size": grid.tp}
        # the loss of a replica is on its last stage, the same on each of its tp ranks
        self.reports = comms.is_last_stage and comms.tp_rank == 0

    def describe(self):
        v = f", {self.cfg.virtual_stages} chunks a rank" if self.cfg.virtual_stages > 1 else ""
        return f", zero {self.cfg.zero}, {self.cfg.micro_batches} micro-batches " \
               f"({self.cfg.schedule}{v})"

    def trace_label(self, rank):
        d, p, t = self.comms.mesh.coords_of(rank)
        return f"rank {rank} (dp {d}, pp {p}, tp {t})"

    def traffic(self):
        colls = self.sync.colls() + ([self.tp_coll] if self.tp_coll else [])
        ts = [c.transport for c in colls] + [self.p2p]
        return sum(t.bytes_sent for t in ts), sum(t.bytes_received for t in ts)

    def step(self, step):
        """One step; returns (the replica's loss where this rank reports it, else None;
        record fields)."""
        comms = self.comms
        x, y = self.data.batch(step, comms.dp_rank, comms.dp_size, self.cfg.global_batch,
                               self.device)
        start = time.perf_counter()
        if comms.rank == self.cfg.straggler_rank:     # --straggler: a slow GPU, seen as compute
            with self.tracer.span(f"straggler {step}", "forward"):
                time.sleep(self.cfg.straggler_seconds)
        self.meter.reset_peak()
        self.sync.before_backward()
        loss = self.pipeline.run(x, y)
        self.sync.synchronize(step)
        pipeline_end = time.perf_counter()
        with self.tracer.span("optimizer", "optimizer"):
            self.sync.step(self.optimizer)
        end = time.perf_counter()
        self.tracer.add("step", "step", start, end)
        events = self.tracer.since(start)
        busy = busy_seconds(events)
        memory = self.sync.state_bytes(self.optimizer)
        memory.update(activations_peak=self.meter.peak_bytes,
                      gathered_peak=self.sync.peak_gathered_bytes)
        return loss if self.reports else None, {
            "coords": [comms.dp_rank, comms.pp_rank, comms.tp_rank],
            "step_time_s": end - start, "compute_time_s": busy,
            "comm_time_s": busy_seconds(events, ("comm",)),
            "idle_time_s": busy_seconds(events, ("idle",)),
            "bubble_fraction": 1.0 - busy / self.pipeline_span(start, pipeline_end),
            "peak_in_flight": self.pipeline.peak_in_flight,
            "micro_batch_activation_bytes": self.pipeline.micro_batch_bytes, "memory": memory,
            **self.wire_fields(), **self.precision.record()}

    def pipeline_span(self, start, end):
        """The flush-to-flush time of this step's pipeline: from the first stage's start to
        the last stage's end (ranks share one clock on a host).  The GPipe paper's bubble
        (p-1)/(m+p-1) is a share of this common span; a stage's own [start, end) would
        leave out the work of the others before it starts and after it ends."""
        spans = self.comms.pp.allgather((start, end))
        return max(e for _, e in spans) - min(s for s, _ in spans)

    def parameters_npz(self):
        """The whole model's parameters on world rank 0 (collective): the first replica's
        pieces from every stage and tp rank, reassembled."""
        mine = self.full_parameters()               # every rank: ZeRO-3 gathers on dp
        gathered = self.comms.world.gather(mine if self.comms.dp_rank == 0 else [], root=0)
        return assemble(gathered) if self.comms.rank == 0 else {}

    def full_parameters(self):
        """(full name, local array, tp pieces, full shape) of this rank's parameters;
        ZeRO-3 layers are gathered for it (a collective on the dp axis)."""
        out = []
        for unit in self.sync.units:
            if self.cfg.zero == 3:
                unit.gather("save")
            for p in unit.params:
                pieces, shape = self.tp_pieces.get(id(p), (None, None))   # None: whole here
                out.append((self.names[id(p)], p.detach().cpu().numpy().copy(), pieces, shape))
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


if __name__ == "__main__":
    sys.exit("run the grid worker through `python -m strategies.train --pp/--tp/--zero ...`")
