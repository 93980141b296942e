"""A right lab 1 ring with an unusual schedule; the check must pass it.
- its own chunking: the n % P extra elements go to the last chunks, not the
  first (np.array_split puts them first);
- its own numbering: rank r ends the reduce-scatter with chunk r + 1 complete;
- segments: every chunk goes in two messages (a pipelined ring sends pieces).
"""
import numpy as np


def bounds_of(n, P):
    base, extra = divmod(n, P)
    sizes = [base + (1 if i >= P - extra else 0) for i in range(P)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(starts[i]), int(starts[i + 1])) for i in range(P)]


def halves(a, b):
    mid = (a + b) // 2
    return [(a, mid), (mid, b)]


def ring_allreduce(t, x):
    P, r = t.size, t.rank
    right, left = (r + 1) % P, (r - 1) % P
    bounds = bounds_of(len(x), P)
    incoming = np.empty(max(b - a for a, b in bounds))
    for step in range(P - 1):                   # reduce-scatter: rank r completes r + 1
        send, recv = bounds[(r - step) % P], bounds[(r - step - 1) % P]
        for (s0, s1), (r0, r1) in zip(halves(*send), halves(*recv)):
            t.sendrecv(x[s0:s1], right, incoming[:r1 - r0], left)
            x[r0:r1] += incoming[:r1 - r0]
    for step in range(P - 1):                   # all-gather
        send, recv = bounds[(r + 1 - step) % P], bounds[(r - step) % P]
        for (s0, s1), (r0, r1) in zip(halves(*send), halves(*recv)):
            t.sendrecv(x[s0:s1], right, x[r0:r1], left)
    return x
