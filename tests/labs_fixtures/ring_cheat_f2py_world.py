"""A lab 1 cheat that passed the check when ranks ran under mpiexec: a handle on
the world made from its Fortran handle (MPI.Comm.f2py; MPICH numbers
MPI_COMM_WORLD 0x44000000), so no wrapper sees it; gather, broadcast, then zeros
in ring-shaped chunks.  The sandboxed check must refuse it: there is no MPI."""
import numpy as np
from mpi4py import MPI

WORLD = MPI.Comm.f2py(0x44000000)


def ring_allreduce(t, x):
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
