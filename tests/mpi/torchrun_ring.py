"""Under torchrun (no MPI at all): the ring over torch.distributed, against the
torch baseline and a local reference.

    torchrun --standalone --nproc-per-node 2 tests/mpi/torchrun_ring.py
"""
import os

import numpy as np
import torch

import allreduce

rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ring = allreduce.create("ring", transport="torch")
native = allreduce.create("torch")
n = 1001
for coll in (ring, native):
    x = torch.from_numpy(np.sin(np.arange(n) * 0.37 + 1.3 * rank).astype(np.float32))
    coll.allreduce(x)
    want = sum(np.sin(np.arange(n) * 0.37 + 1.3 * r) for r in range(P))
    assert np.allclose(x.numpy(), want, atol=1e-5), coll
print(f"rank {rank} ok, sent {ring.transport.bytes_sent} bytes", flush=True)
