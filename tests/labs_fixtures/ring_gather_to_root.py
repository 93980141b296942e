"""A wrong lab 1 "ring": the whole vector goes round to rank 0, summed on the way
(1 -> 2 -> ... -> P-1 -> 0), then rank 0's total goes round to everyone.  Right
sums, and at P = 2 a ring's bytes.  check_ring must refuse it at every P: its
messages are whole vectors, not chunks."""
import numpy as np


def ring_allreduce(t, x):
    P, r = t.size, t.rank
    right, left, nothing = (r + 1) % P, (r - 1) % P, np.empty(0)
    for step in range(P - 1):                   # gather: rank step+1 passes the partial sum on
        sender = step + 1
        if r == sender:
            t.sendrecv(x, right, nothing, left)
        elif r == (sender + 1) % P:
            incoming = np.empty_like(x)
            t.sendrecv(nothing, right, incoming, left)
            x += incoming
        else:
            t.sendrecv(nothing, right, nothing, left)
    for step in range(P - 1):                   # and back: rank `step` passes the total on
        if r == step:
            t.sendrecv(x, right, nothing, left)
        elif r == step + 1:
            t.sendrecv(nothing, right, x, left)
        else:
            t.sendrecv(nothing, right, nothing, left)
    return x
