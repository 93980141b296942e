"""max and min propagate NaN on every algorithm and every rank.

    mpiexec -n P python -m mpi4py tests/mpi/nan_minmax.py

Rank r holds NaN at the positions i with i % 5 == r (so every rank has some, at
P <= 5), and a rank- and position-dependent value elsewhere.  The answer, on
every rank and for every algorithm (auto included, at sizes where it picks MPI's
own collective; torch.distributed's gloo): NaN wherever any rank had one, the max or min of the values
elsewhere; all ranks bit-identical.
"""
import numpy as np
from mpi4py import MPI

import allreduce

world = MPI.COMM_WORLD
P, rank = world.size, world.rank
ALGOS = ("ring", "tree", "halving_doubling", "mpi", "auto", "torch")   # torch: gloo


def inputs(n, r, dtype):
    i = np.arange(n)
    x = (np.sin(0.37 * i + 1.3 * r) * 100).astype(dtype)
    x[i % 5 == r] = np.nan
    return x


for algo in ALGOS:
    coll = (allreduce.make("torch", allreduce.make_transport("torch", world)) if algo == "torch"
            else allreduce.create(algo))
    for dtype in (np.float32, np.float64):
        for n in (1, 7, 1000, 300_001):
            everyone = np.stack([inputs(n, r, dtype) for r in range(P)])
            for op, reduce in (("max", np.max), ("min", np.min)):
                want = reduce(everyone, axis=0)          # numpy's max/min propagate NaN
                assert np.isnan(want[np.arange(n) % 5 < P]).all()
                x = inputs(n, rank, dtype)
                coll.allreduce(x, op=op)
                assert np.array_equal(x, want, equal_nan=True), (algo, dtype, n, op)
                same = world.allgather(x.tobytes())
                assert all(b == same[0] for b in same), (algo, dtype, n, op, "ranks differ")
world.Barrier()
if rank == 0:
    print(f"OK P={P}", flush=True)
