"""A wrong lab 1 ring: MPI_Allreduce does the sum, then zeros go round the ring in
chunks of n/P, so that t counts a ring's bytes.  check_ring must refuse it: the
sandbox has no MPI (and zeros would be no ring's message)."""
import numpy as np
from mpi4py import MPI
from mpi4py.MPI import COMM_WORLD as WORLD


def ring_allreduce(t, x):
    WORLD.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    P, r = t.size, t.rank
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(len(x)), P)]
    for step in range(2 * (P - 1)):
        s0, s1 = bounds[(r - step - 1) % P]
        r0, r1 = bounds[(r - step - 2) % P]
        t.sendrecv(np.zeros(s1 - s0), (r + 1) % P, np.empty(r1 - r0), (r - 1) % P)
    return x
