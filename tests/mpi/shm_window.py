"""shm's own path: all-reduces of buffers in its shared-memory window.

    mpiexec -n P python -m mpi4py tests/mpi/shm_window.py

(The reference matrix covers shm with private buffers, which go by the ring.)
Inputs depend on rank and position; every rank computes the expected result
itself.  A slice of a window buffer, at an offset, takes the window path too.
"""
import numpy as np
from mpi4py import MPI

import allreduce

world = MPI.COMM_WORLD
rank, P = world.rank, world.size
coll = allreduce.create("shm")
failures = []


def inputs(dtype, n):
    i = np.arange(n)
    if dtype.startswith("int"):
        return [((i * 7 + r * 1000) % 20011 - 10000).astype(dtype) for r in range(P)]
    return [(np.sin(0.37 * i + 1.3 * r) * 4).astype(dtype) for r in range(P)]


for dtype in ("float32", "float64", "int64"):
    for n in sorted({0, 1, max(P - 1, 0), 2 * P + 1, 1_000_003}):
        every = inputs(dtype, n)
        buf = coll.empty(n + 5, dtype)
        for op in ("sum", "max", "min") + (("avg",) if not dtype.startswith("int") else ()):
            want = {"sum": sum(e.astype(np.float64) for e in every),
                    "avg": sum(e.astype(np.float64) for e in every) / P,
                    "max": np.max(every, axis=0), "min": np.min(every, axis=0)}[op]
            x = buf[5:]                           # a view at an offset into the window
            x[:] = every[rank]
            assert coll._peers_of(x) is not None, "a window buffer missed the window path"
            coll.allreduce(x, op=op)
            tol = 0 if dtype.startswith("int") or op in ("max", "min") else 1e-5 * P * 4
            if n and np.max(np.abs(x - want)) > tol:
                failures.append(f"P={P} {dtype} n={n} {op}: off by {np.max(np.abs(x - want))}")
private = inputs("float32", 1000)[rank].copy()
assert coll._peers_of(private) is None
coll.allreduce(private)                            # by the ring
if np.max(np.abs(private - sum(e.astype(np.float64) for e in inputs("float32", 1000)))) > \
        1e-5 * P * 4:
    failures.append("a private buffer (the ring's path) summed wrong")

failures = sum(world.allgather(failures), [])
if rank == 0:
    print("\n".join(failures[:20]) if failures else f"OK P={P}", flush=True)
    if failures:
        world.Abort(1)
world.Barrier()
