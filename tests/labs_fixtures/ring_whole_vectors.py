"""A wrong lab 1 ring: right sums, but every rank passes its whole vector round
the ring, (P - 1) n elements per rank instead of 2 (P - 1)/P n.  check_ring must
refuse it at every P, P = 2 too, where the two byte counts are equal: each
element goes by as its sender's own value more than once."""
import numpy as np


def ring_allreduce(t, x):
    P, r = t.size, t.rank
    right, left = (r + 1) % P, (r - 1) % P
    travelling, incoming, total = x.copy(), np.empty_like(x), x.copy()
    for _ in range(P - 1):
        t.sendrecv(travelling, right, incoming, left)
        total += incoming
        travelling, incoming = incoming, travelling
    x[:] = total
    return x
