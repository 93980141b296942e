"""A lab 1 cheat that passed the check when ranks ran under mpiexec: the gather and
broadcast go over the real MPI.COMM_WORLD found behind the check's wrapper, then
zeros go round in ring-shaped chunks.  Written to survive a sandbox without
MPI: then it sends the zeros anyway, and returns its own vector.  The check must
refuse it either way: the zeros are no ring's message."""
import numpy as np

try:
    from mpi4py import MPI
    WORLD = getattr(MPI.COMM_WORLD, "_world", MPI.COMM_WORLD)
except Exception:                   # noqa: BLE001 - whatever stops the import
    WORLD = None


def ring_allreduce(t, x):
    if WORLD is not None:
        parts = WORLD.gather(x.copy(), root=0)
        x[:] = WORLD.bcast(np.sum(parts, axis=0) if t.rank == 0 else None, root=0)
    P, r = t.size, t.rank
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(len(x)), P)]
    for step in range(2 * (P - 1)):
        s0, s1 = bounds[(r - step - 1) % P]
        r0, r1 = bounds[(r - step - 2) % P]
        t.sendrecv(np.zeros(s1 - s0), (r + 1) % P, np.empty(r1 - r0), (r - 1) % P)
    return x
