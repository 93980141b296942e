"""A lab 1 cheat that passed the check when ranks ran under mpiexec: the sum is made
by a gather to rank 0 and a broadcast on the lab transport's own communicator
(t._comm), then zeros go round in ring-shaped chunks so that t counts a ring's
bytes.  The sandboxed check must refuse it: t has no communicator."""
import numpy as np


def ring_allreduce(t, x):
    comm = t._comm
    parts = comm.gather(x.copy(), root=0)
    x[:] = comm.bcast(np.sum(parts, axis=0) if t.rank == 0 else None, root=0)
    P, r = t.size, t.rank
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(len(x)), P)]
    for step in range(2 * (P - 1)):
        s0, s1 = bounds[(r - step - 1) % P]
        r0, r1 = bounds[(r - step - 2) % P]
        t.sendrecv(np.zeros(s1 - s0), (r + 1) % P, np.empty(r1 - r0), (r - 1) % P)
    return x
