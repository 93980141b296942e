"""The attention's activations per rank, whole against split by context parallelism.

    mpiexec -n 2 python -m mpi4py tests/mpi/context_memory.py

At seq 4096 every rank runs the GPT's attention core on the whole sequence (cp 1),
then ring attention and Ulysses on its T/cp positions, and measures the bytes
autograd saved for the backward (ActivationMeter, strategies/runtime/memory.py: q,
k, v, the output and the softmax's log-sum-exp).  Printed by rank 0: every rank's
three peaks, for the test to compare (tests/test_context_parallel.py).
"""
import json

import torch
from mpi4py import MPI

import allreduce
from strategies.model.models import causal_attention
from strategies.parallel.ring_attention import RingAttention
from strategies.parallel.ulysses import Ulysses
from strategies.runtime.memory import ActivationMeter

B, T, HEADS, D = 1, 4096, 4, 16


def saved_bytes(core, tensors):
    """The peak bytes autograd keeps for the backward of core(q, k, v, HEADS)."""
    q, k, v = (t.clone().requires_grad_() for t in tensors)
    meter = ActivationMeter()
    with meter:
        core(q, k, v, HEADS)
    return meter.peak_bytes


def main():
    comm = MPI.COMM_WORLD
    cp, rank = comm.size, comm.rank
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, HEADS * D, generator=g) for _ in range(3))
    mine = [t[:, rank * T // cp:(rank + 1) * T // cp] for t in (q, k, v)]
    peaks = {"cp1": saved_bytes(causal_attention, (q, k, v)),
             "ring": saved_bytes(RingAttention(allreduce.make_transport("mpi", comm, 60)), mine),
             "ulysses": saved_bytes(Ulysses(allreduce.create("ring", comm=comm, timeout=60)),
                                    mine)}
    everyone = comm.gather({"rank": rank, **peaks}, root=0)
    if rank == 0:                  # one line from one rank: the ranks' prints would interleave
        print(json.dumps(everyone), flush=True)


if __name__ == "__main__":
    main()
