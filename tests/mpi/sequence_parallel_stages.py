"""Sequence parallelism across a pipeline cut, on the tp ranks alone: both stages on each rank.

    mpiexec -n 2 python -m mpi4py tests/mpi/sequence_parallel_stages.py

First the sequence collectives against their definitions.  Then the cut: a
pp = 2 x tp = 2 run needs four processes; what pipelining adds to sequence
parallelism is only the cut, so this runs the cut in one process per tp rank:
stage 0 (embedding, block 0) makes the activation that would travel, which must
be this rank's (B, T/tp, C) shard; stage 1 (block 1, head) takes a detached copy,
as the receiving stage does, computes the loss, and hands the input's gradient
back to stage 0's backward, as the pipeline does.  The loss and every gradient
(tp pieces reassembled by index) must equal the unsplit GPT's on the same batch
(tolerance in tests/test_sequence_parallel.py: rtol 1e-5, atol 1e-6).
"""
import copy

import numpy as np
import torch
from mpi4py import MPI

from strategies.config.settings import parse_args
from strategies.model.data import DataSpec
from strategies.model.models import build_model
from strategies.parallel.pipeline import Stage, stage_layers
from strategies.parallel.sequence_parallel import (all_gather_sequence, positions_per_rank,
                                         reduce_scatter_sequence, split_sequence)
from strategies.sync.gradient_sync import collective_for
from strategies.parallel.tensor_parallel import TensorParallel, parallelize_blocks

RTOL, ATOL = 1e-5, 1e-6
B = 3


def check_collectives(tp):
    """The sequence collectives against their definitions, on rank- and position-dependent
    values (B = 2, C = 3, so a transposed or misplaced run of positions shows)."""
    T, size = 4 * tp.size, tp.size
    every = [torch.arange(2 * T * 3, dtype=torch.float32).view(2, T, 3) + 1000 * r
             for r in range(size)]
    part = T // size
    mine = every[tp.rank][:, tp.rank * part:(tp.rank + 1) * part]
    gathered = all_gather_sequence(mine, tp, "check")
    want = torch.cat([every[r][:, r * part:(r + 1) * part] for r in range(size)], dim=1)
    assert torch.equal(gathered, want), (gathered, want)
    summed = reduce_scatter_sequence(every[tp.rank], tp, "check")
    assert torch.equal(summed, sum(every)[:, tp.rank * part:(tp.rank + 1) * part])


def main():
    comm = MPI.COMM_WORLD
    cfg = parse_args(["--sync", "ring", "--model", "gpt", "--layers", "2", "--d-model", "16",
                      "--heads", "2", "--vocab", "12", "--seq-len", "8", "--tp", str(comm.size),
                      "--pp", "2", "--sequence-parallel"])
    model = build_model(cfg, DataSpec("lm", vocab=cfg.vocab))
    whole = copy.deepcopy(model)
    originals = list(model.parameters())         # alive: no new parameter may reuse an id
    names = {id(p): n for n, p in model.named_parameters()}
    tp = TensorParallel(collective_for("ring", cfg, comm), comm.rank, comm.size)
    check_collectives(tp)
    stages = []
    for s in range(cfg.pp):
        layers = stage_layers(model, s, cfg.pp)
        parallelize_blocks([m for n, m in layers if n.startswith("blocks.")], tp)
        layers = split_sequence(layers, tp)
        for name, module in layers:               # the tp pieces: new tensors, same names
            for local, p in module.named_parameters():
                names.setdefault(id(p), f"{name}.{local}")
        stages.append(Stage(layers))

    g = torch.Generator().manual_seed(1)
    x = torch.randint(cfg.vocab, (B, cfg.seq_len), generator=g)
    y = torch.randint(cfg.vocab, (B, cfg.seq_len), generator=g)

    sent = stages[0](x)                          # what stage 0 would send to stage 1
    assert sent.shape == (B, positions_per_rank(cfg, comm.size), cfg.d_model), sent.shape
    received = sent.detach().clone().requires_grad_()
    loss = model.criterion(stages[1](received), y)
    loss.backward()
    sent.backward(received.grad)                 # the gradient stage 1 would send back

    reference = whole.criterion(whole(x), y)
    reference.backward()
    np.testing.assert_allclose(loss.item(), reference.item(), rtol=RTOL, atol=ATOL)
    full = {n: p.grad for n, p in whole.named_parameters()}
    checked = set()
    for stage in stages:
        for p in stage.parameters():
            want = full[names[id(p)]]
            pieces = tp.pieces.get(id(p))
            pairs = [(slice(None), slice(None))] if pieces is None else pieces[0]
            for full_index, local_index in pairs:
                np.testing.assert_allclose(p.grad[local_index].numpy(), want[full_index].numpy(),
                                           rtol=RTOL, atol=ATOL, err_msg=names[id(p)])
            checked.add(names[id(p)])
    assert checked == set(full), set(full) - checked
    del originals
    if comm.rank == 0:
        print(f"sequence-parallel stages: {len(checked)} gradients equal", flush=True)


if __name__ == "__main__":
    main()
