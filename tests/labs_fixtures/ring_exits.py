"""A wrong lab 1 ring: rank 1 leaves the process with os._exit(3) at its first
step.  check_ring must name rank 1 and its exit status, not just say FAIL."""
import os


def ring_allreduce(t, x):
    if t.rank == 1:
        os._exit(3)
    P, r = t.size, t.rank
    for step in range(2 * (P - 1)):
        t.sendrecv(x[:0], (r + 1) % P, x[:0], (r - 1) % P)
    return x
