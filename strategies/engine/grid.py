"""The dp x pp x tp grid: its flags checked against the world, its pieces reassembled.

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
    pipeline.run(x, y): micro-batches through this rank's stage  (parallel/pipeline.py)
        each block's matrices split over the tp ranks           (tensor_parallel.py: tp)
        each layer's gradient reduced over dp as soon as backward finishes it
    zero.synchronize(step)                                       (every layer's gradient came)
    zero.step(optimizer)                                         (update; stages 1-2 all-gather)
    the step's fields: times, memory, bubble                     (memory.py, trace.py)

Here: `check`, every problem of the grid's flags against the world before any rank
starts, and `assemble`, the whole model from every rank's pieces (--params-out).

Reference semantics: every choice of dp, pp, tp, zero, micro-batches and schedule
trains the same model on the same global batch as `--sync local` on one
process; only the order of float additions differs.
"""
import sys

import numpy as np

from ..config.choices import ConfigError
from ..config.mesh import Mesh
from ..config.settings import dp_size_of
from ..parallel.interleaved import check as check_interleaved


def check(cfg, world_size):
    """Every problem of the grid flags against the world and the model (ConfigError);
    TrainConfig checked the flags alone (--zero with --sync ps, the schedule's name).
    The global batch and the micro-batches against dp are config.dp_size_of's, the one
    check of them for every run."""
    dp_size_of(cfg, world_size)
    grid = Mesh(world_size, cfg.dp, cfg.pp, cfg.tp)
    blocks, what = cfg.blocks
    if blocks % grid.pp:
        raise ConfigError(f"{what} {blocks} is not divisible by pp({grid.pp}): "
                          f"{blocks} % {grid.pp} = {blocks % grid.pp}", field=what[2:])
    if cfg.schedule == "interleaved":
        check_interleaved(cfg, grid.pp)
    if grid.tp > 1:
        if cfg.model != "gpt":
            raise ConfigError(f"--tp {grid.tp}: tensor parallelism splits the GPT's attention "
                              "and MLP; use --model gpt", field="tp")
        if cfg.heads % grid.tp:
            raise ConfigError(f"--heads {cfg.heads} is not divisible by tp({grid.tp}): "
                              f"{cfg.heads} % {grid.tp} = {cfg.heads % grid.tp}", field="heads")
        if cfg.d_model % grid.tp:
            raise ConfigError(f"--d-model {cfg.d_model} is not divisible by tp({grid.tp})",
                              field="d_model")
    return grid


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
