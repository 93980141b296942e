"""Every rank of `auto` takes the same algorithm for every collective and size.

    mpiexec -n P python -m mpi4py tests/mpi/auto_agreement.py CALIBRATION.json

Rank 1 alone is given the calibration (the others use the table), as if the
ranks had read different files: rank 0's decision must hold on all of them.
Then each size is run, so a disagreement would also show as a wrong sum, in a
buffer of numpy's and in one of `auto.empty` (the shared-memory path from SHM_FROM).
"""
import sys

import numpy as np
from mpi4py import MPI

import allreduce
from allreduce.auto import COLLECTIVES, SIZE_CLASSES

world = MPI.COMM_WORLD
coll = allreduce.create("auto", calibration=sys.argv[1] if world.rank == 1 else None)
choices = [coll.choice(c, (1 << k) - 1) for c in COLLECTIVES for k in range(SIZE_CLASSES)]
tables = world.allgather(choices)
assert all(t == tables[0] for t in tables), "ranks chose differently"
assert set(world.allgather(coll.rule)) == {"table"}, "rank 0 used the table, so all did"
P = world.size
for n in (1, 1000, 100_000, 1_000_003):
    for x in (np.empty(n), coll.empty(n, np.float64)):
        x[:] = np.arange(n, dtype=np.float64) + world.rank
        coll.allreduce(x)
        assert np.array_equal(x, np.arange(n) * P + P * (P - 1) / 2), (
            n, coll.choice("allreduce", x.nbytes))
assert coll.choice("allreduce", 8 * 1_000_003) == "shm"
world.Barrier()
if world.rank == 0:
    print(f"same on {world.size} ranks: {sorted(set(choices))}", flush=True)
