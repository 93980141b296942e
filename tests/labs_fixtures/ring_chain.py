"""A wrong lab 1 "ring": the right neighbours, chunk-sized messages, honest
partial sums, but a chain: every element starts at rank 0 and is summed on its
way to rank P-1, which sends the totals back round.  Rank 0 sends about 2n
elements, not a ring's 2(P-1)/P n.  The check must refuse it from P = 3 (at P = 2
a chain and a ring send alike)."""
import numpy as np


def ring_allreduce(t, x):
    P, r, n = t.size, t.rank, len(x)
    right, left = (r + 1) % P, (r - 1) % P
    pieces = [(a[0], a[-1] + 1) for a in np.array_split(np.arange(n), P) if len(a)]
    nothing = np.empty(0)
    for a, b in pieces:                         # reduce along 0 -> 1 -> ... -> P-1
        for hop in range(P - 1):
            incoming = np.empty(b - a)
            send = x[a:b] if r == hop else nothing
            recv = incoming if r == hop + 1 else nothing
            t.sendrecv(send, right, recv, left)
            if r == hop + 1:
                x[a:b] += incoming
    for a, b in pieces:                         # totals from P-1 round to P-2
        for hop in range(P - 1):
            sender = (P - 1 + hop) % P
            send = x[a:b] if r == sender else nothing
            recv = x[a:b] if r == (sender + 1) % P else nothing
            t.sendrecv(send, right, recv, left)
    return x
