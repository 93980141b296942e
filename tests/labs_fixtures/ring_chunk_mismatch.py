"""A wrong lab 1 ring: the reduce-scatter receives into the whole scratch buffer,
not into a slice as long as the chunk that arrives.  With uneven chunks the sizes
differ (in MPI: a truncation error on one rank, a wait on the others); check_ring
must say that the send and receive chunk sizes differ."""
import numpy as np


def ring_allreduce(t, x):
    P, r = t.size, t.rank
    right, left = (r + 1) % P, (r - 1) % P
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(len(x)), P)]
    incoming = np.empty(max(b - a for a, b in bounds))
    for step in range(P - 1):
        s0, s1 = bounds[(r - step - 1) % P]
        r0, r1 = bounds[(r - step - 2) % P]
        t.sendrecv(x[s0:s1], right, incoming, left)        # should be incoming[:r1 - r0]
        x[r0:r1] += incoming[:r1 - r0]
    for step in range(P - 1):
        s0, s1 = bounds[(r - step) % P]
        r0, r1 = bounds[(r - step - 1) % P]
        t.sendrecv(x[s0:s1], right, x[r0:r1], left)
    return x
