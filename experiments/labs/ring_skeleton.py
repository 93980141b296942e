"""Lab 1: complete the ring all-reduce.  Copy this file, fill in the five TODOs, then

    .venv/bin/python -m experiments.labs.check_ring my_ring.py

The check runs each of your ranks in a sandbox whose only channel is t, at 2, 3
and 4 ranks on awkward lengths with random inputs, reads every message you send
(a partial sum of the chunk, or a finished chunk), compares every element with
the true sum, and times your ring at 16 MiB against the cost model's prediction.

          rank 0 ───▶ rank 1            each rank sends only to its right
            ▲            │              neighbour and receives only from
            │            ▼              its left one
          rank 3 ◀─── rank 2

The buffer is cut into P chunks c0 .. c(P-1).  Phase 1, reduce-scatter, leaves
rank r holding the complete sum of chunk r; phase 2, all-gather, passes the
completed chunks round the ring until every rank holds all of them.  Before you
write code, fill in on paper, for P = 4, which chunk each rank sends at each step:

    reduce-scatter   rank 0   rank 1   rank 2   rank 3
      step 0           ?        ?        ?        ?
      step 1           ?        ?        ?        ?
      step 2           ?        ?        ?        ?      after it: rank r holds sum(c_r)

The only thing you get is the transport `t` (no communicator, no collective):
    t.rank, t.size                           who I am, how many we are
    t.sendrecv(sendbuf, dest, recvbuf, src)  send one array to rank dest while
                                             receiving another from rank src
Arrays are numpy float64 (views like x[a:b] are fine: they are contiguous).
The array you receive into must be exactly as long as the one its sender sends.
"""
import numpy as np


def chunk_bounds(n, P):
    """[(start, stop)] of P chunks of n elements, sizes differing by at most one
    (np.array_split's arithmetic), so any n works, even n < P."""
    base, extra = divmod(n, P)
    bounds, start = [], 0
    for i in range(P):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_allreduce(t, x):
    """Sum x over all ranks, in place.  Returns x."""
    P, r = t.size, t.rank
    right, left = (r + 1) % P, (r - 1) % P
    bounds = chunk_bounds(len(x), P)
    incoming = np.empty(max(b - a for a, b in bounds), dtype=x.dtype)

    # 1. reduce-scatter: P-1 steps.  At step s rank r sends the chunk it has
    #    summed the most of and adds the chunk arriving from the left to its own.
    #    After the last step rank r must hold the complete sum of chunk r.
    for step in range(P - 1):
        send_chunk = None      # TODO: which chunk goes right at this step?
        recv_chunk = None      # TODO: which chunk arrives from the left?
        s0, s1 = bounds[send_chunk]
        r0, r1 = bounds[recv_chunk]
        t.sendrecv(x[s0:s1], right, incoming[:r1 - r0], left)
        # TODO: add what arrived into our copy of recv_chunk

    # 2. all-gather: P-1 steps.  Pass the completed chunks around the ring;
    #    what arrives is stored as it is (no addition).
    for step in range(P - 1):
        send_chunk = None      # TODO: the chunk this rank completed most recently
        recv_chunk = None      # TODO: the chunk that arrives from the left
        s0, s1 = bounds[send_chunk]
        r0, r1 = bounds[recv_chunk]
        t.sendrecv(x[s0:s1], right, x[r0:r1], left)
    return x
