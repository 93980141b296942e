"""A wrong lab 1 ring that fails on one rank only (rank 1 raises before its
first step), so the others wait for it.  check_ring must name rank 1's error as
the cause, once, and not report the others' waits as errors of their own."""


def ring_allreduce(t, x):
    if t.rank == 1:
        raise IndexError("chunk index out of range")
    P, r = t.size, t.rank
    for step in range(2 * (P - 1)):
        t.sendrecv(x[:0], (r + 1) % P, x[:0], (r - 1) % P)
    return x
