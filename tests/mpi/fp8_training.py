"""Training with fp8 frames (strategies/compression/fp8.py) against float32, on P ranks.

    mpiexec -n 2 python -m mpi4py tests/mpi/fp8_training.py

One loop, run twice from the same initial weights: each step every rank computes
the gradient of its half of the batch, the flat gradient goes through the
compressor's reduce_bucket (float32's all-reduce, then fp8's all-gather) and SGD
steps on the mean.  Printed per run: the global loss after the last step, the bytes
handed to the collective and the bytes the transport sent, per rank and step.  The
ranks must also end with the same weights (every rank adds the same gathered bytes).
"""
import json

import torch

import allreduce
from strategies.compression.casts import Compressor
from strategies.compression.fp8 import Fp8Compressor
from strategies.model.models import MLP

STEPS, BATCH, LR = 30, 64, 1.0


def batch_of(step, rank, size):
    """This rank's half of the step's batch: a teacher's labels on Gaussian inputs."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 32, generator=g)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(0))
    y = (x @ teacher).argmax(1)
    part = BATCH // size
    return x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]


def train(coll, compressor):
    torch.manual_seed(0)
    model = MLP(32, 64, 2, 10)
    params = list(model.parameters())
    handed, sent_before = 0, coll.bytes_sent
    for step in range(STEPS):
        x, y = batch_of(step, coll.rank, coll.size)
        model.zero_grad()
        model.criterion(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        handed += compressor.reduce_bucket(0, flat, None, None,
                                           lambda t: coll.allreduce(t, op="avg"))
        with torch.no_grad():
            at = 0
            for p in params:
                p -= LR * flat[at:at + p.numel()].view_as(p)
                at += p.numel()
    sent = coll.bytes_sent - sent_before
    x, y = batch_of(STEPS, coll.rank, coll.size)        # a batch no step has seen
    with torch.no_grad():
        loss = coll.allreduce(model.criterion(model(x), y).reshape(1), op="avg").item()
    weights = torch.cat([p.detach().reshape(-1) for p in params])
    same = coll.allreduce(weights.clone(), op="max") - coll.allreduce(weights.clone(), op="min")
    assert same.abs().max() == 0, "the ranks' weights differ"
    return {"loss": loss, "handed_per_step": handed / STEPS,
            "sent_per_step": sent / STEPS}


def main():
    coll = allreduce.create("ring", timeout=60)
    runs = {"fp32": train(coll, Compressor()), "fp8": train(coll, Fp8Compressor(coll))}
    if coll.rank == 0:
        print(json.dumps(runs))


if __name__ == "__main__":
    main()
