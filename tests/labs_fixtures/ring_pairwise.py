"""A wrong lab 1 ring: right sums and a ring's bytes, but each rank exchanges
directly with every other (rank r sends to r + k at step k), not round a ring:
a direct reduce-scatter, then a direct all-gather.  check_ring must refuse it at
P = 3 and 4 (at P = 2 the partner is both neighbours): the peer is named."""
import numpy as np


def ring_allreduce(t, x):
    P, r = t.size, t.rank
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(len(x)), P)]
    r0, r1 = bounds[r]
    incoming = np.empty(r1 - r0)
    for k in range(1, P):                       # reduce-scatter: chunk j to rank j
        to, came_from = (r + k) % P, (r - k) % P
        s0, s1 = bounds[to]
        t.sendrecv(x[s0:s1], to, incoming, came_from)
        x[r0:r1] += incoming
    for k in range(1, P):                       # all-gather: my sum to everyone
        to, came_from = (r + k) % P, (r - k) % P
        c0, c1 = bounds[came_from]
        t.sendrecv(x[r0:r1], to, x[c0:c1], came_from)
    return x
