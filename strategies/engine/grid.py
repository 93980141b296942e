"""The dp x pp x tp grid: how its pieces meet in one step, and the whole model from them.

    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \\
        --layers 4 --pp 2 --tp 2 --micro-batches 4 --schedule 1f1b --trace run.json
    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \\
        --layers 4 --pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2
    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --zero 3 \\
        --optimizer adam --jsonl zero3.jsonl

A rank of the grid holds a share of the model: ZeRO's shards on dp, a pipeline stage
on pp, Megatron's pieces on tp.  parallelize.py cuts it, in one order; the step
engine of the one training loop (loop.py) drives it:

    x, y = this dp replica's part of the global batch            (data.py)
    zero.before_backward()                                       (sync/zero.py: dp axis)
    schedule.run(x, y): micro-batches through this rank's stage (parallel/pipeline.py;
                                                                 at pp = 1 accumulation.py)
        each block's matrices split over the tp ranks           (tensor_parallel.py: tp)
        each bucket's gradient reduced over dp as soon as backward finishes it
    zero.synchronize(step)                                       (the last buckets' collectives)
    zero.step(optimizer)                                         (update; stages 1-2 all-gather)
    the step's fields: times, memory, bubble                     (memory.py, trace.py)

Here: `with_stage_split`, the pipeline's split of the blocks written into the config
(its records and its checkpoints' layout name it), and `assemble`, the whole model
from every rank's pieces (--params-out).  The grid's
flags against the world (layers per stage, heads per tp rank, micro-batches) are
checked before any rank starts, by config/validate.py's check_world.

Reference semantics: every choice of dp, pp, tp, zero, micro-batches and schedule
trains the same model on the same global batch as `--sync local` on one
process; only the order of float additions differs.
"""
import dataclasses
import sys

import numpy as np

from ..parallel.pipeline import stage_sizes
from .parallelize import cut_into_layers


def with_stage_split(cfg, model):
    """cfg with --pp-layers the blocks of each stage this run cuts (parallel/pipeline.py:
    as given, or the balanced split of `model`): a checkpoint is one stage's blocks, so
    its layout must name the split, and a resumed run cuts the same one.  Interleaved
    chunks are cut evenly; no pipeline, no split."""
    if not (cut_into_layers(cfg) and cfg.pp > 1 and cfg.virtual_stages == 1):
        return cfg
    sizes = stage_sizes(model, cfg.pp, cfg.stage_split)
    return dataclasses.replace(cfg, pp_layers=",".join(map(str, sizes)))


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
