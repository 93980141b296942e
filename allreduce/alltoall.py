"""All-to-all: every rank sends a different block to every other rank.

Rank r's input is cut into P blocks by `shard_bounds(n, P)`; block j goes to
rank j.  Rank r's output block j is rank j's input block r.  Every rank's
block r has the same size (the bounds depend on n and P alone), so rank r
receives P blocks of shard r's size: P * |shard r| elements (`received_bounds`),
n when P divides n.  No size travels: every rank computes every block's size.

    input blocks      rank 0: a0 a1 a2     rank 1: b0 b1 b2     rank 2: c0 c1 c2
    output blocks     rank 0: a0 b0 c0     rank 1: a1 b1 c1     rank 2: a2 b2 c2

A transpose of the P x P matrix of blocks.  Two textbook schedules, as MPICH
has them (Thakur, Rabenseifner & Gropp, "Optimization of collective
communication operations in MPICH", 2005, section 3.3):

Pairwise exchange, for large blocks: P-1 steps.  At step k rank r sends block
(r+k) % P to rank (r+k) % P and receives block r of rank (r-k) % P (the shift
variant, which works for any P; not the XOR variant, which needs a power of two).
With P = 4 (xj: the sender's block j):

    step | rank 0          | rank 1          | rank 2          | rank 3
      1  | x1 to 1, from 3 | x2 to 2, from 0 | x3 to 3, from 1 | x0 to 0, from 2
      2  | x2 to 2, from 2 | x3 to 3, from 3 | x0 to 0, from 0 | x1 to 1, from 1
      3  | x3 to 3, from 1 | x0 to 0, from 2 | x1 to 1, from 3 | x2 to 2, from 0

Each rank sends (P-1)/P n, every byte once and straight to its destination.

Bruck's algorithm, for small blocks (Bruck, Ho, Kipnis, Upfal & Weathersby,
"Efficient algorithms for all-to-all communications in multiport message-passing
systems", IEEE TPDS 8(11), 1997): ceil(log2 P) steps.
  1. rotate: slot i holds the block for rank (r+i) % P, so a block's slot is the
     distance it must travel;
  2. step k: send every slot whose index has bit k set to rank r + 2^k, receive
     the same slots from rank r - 2^k.  A block moves by the bits of its
     distance, one per step, and never changes slot;
  3. rotate back: slot i now holds the block from rank (r-i) % P.

With P = 4, the blocks in rank 0's slots ("s>d": rank s's block for rank d):

                  slot 0   slot 1   slot 2   slot 3
      rotated      0>0      0>1      0>2      0>3
      step 0       0>0      3>0      0>2      3>2     sent slots 1, 3 to rank 1, from rank 3
      step 1       0>0      3>0      2>0      1>0     sent slots 2, 3 to rank 2, from rank 2

Each step moves about half the blocks: (n/2) log2 P per rank, against the
pairwise (P-1)/P n, for log2 P latencies instead of P-1.  Blocks sent at one
step are packed into one message; with uneven blocks a slot's size at step k
is that of its block's destination, known from the bounds (`bruck_destination`).
"""
import math

import numpy as np

from .buffers import copy_into, empty_like, is_tensor, nbytes, numel, validate
from .errors import CollectiveError
from .shards import bounds_from_sizes, shard_bounds

# Bruck below this many bytes in the largest block, pairwise exchange from it.
# Bruck saves (P-1) - log2 P latencies alpha and sends (P/2) log2 P - (P-1) more
# blocks of m bytes at beta a byte (packing included), so it wins while
# m < alpha/beta * (P-1 - log2 P) / ((P/2) log2 P - (P-1)): about alpha/beta at
# P = 4, 0.8 alpha/beta at P = 8.  A step of ours costs alpha ~ 10 us (Python
# over MPI) and a block moves at ~ 2 GB/s counting the copies: alpha/beta ~ 20 KB,
# so the power of two below.  Timings at P = 4 on our shared 2-core machine were
# too noisy to place it better (the crossover fell between 4 and 64 KiB).
# MPICH, in C (alpha ~ 1 us), switches at 256 bytes: MPIR_CVAR_ALLTOALL_SHORT_MSG_SIZE.
BRUCK_BELOW = 16 << 10


def received_bounds(bounds, rank):
    """[start, stop) of rank's output blocks: P blocks of shard rank's size."""
    start, stop = bounds[rank]
    return bounds_from_sizes([stop - start] * len(bounds))


def pairwise_peers(rank, step, P):
    """(rank sent to, rank received from) at pairwise step `step` (1 .. P-1)."""
    return (rank + step) % P, (rank - step) % P


def bruck_destination(holder, slot, distance, P):
    """The destination of the block in `slot` of rank `holder` before the step
    that moves slots by `distance` (= 2^k): it has covered the low k bits of its
    distance `slot`, so it started at holder - slot % distance."""
    return (holder + slot - slot % distance) % P


def uses_bruck(block_bytes, P):
    """Whether `alltoall` takes Bruck: only where it takes fewer steps than
    pairwise (ceil(log2 P) < P - 1: from P = 4), for blocks below BRUCK_BELOW."""
    return P >= 4 and block_bytes < BRUCK_BELOW


def bytes_sent(nbytes, P, bruck):
    """Bytes one rank sends in an all-to-all of nbytes with even blocks."""
    if bruck:   # step k moves the slots with bit k set: P/2 of them where P is a power of two
        moved = sum(1 for k in range(math.ceil(math.log2(P))) for i in range(P) if i >> k & 1)
        return moved * nbytes / P
    return (P - 1) / P * nbytes


def check_out(x, out, rank, P, what):
    """Raise CollectiveError where `out` cannot take rank's all-to-all of x."""
    validate(out, f"{what}: out", writable=True)
    if is_tensor(out) != is_tensor(x):
        raise CollectiveError(f"{what}: out is a {type(out).__name__}, x a {type(x).__name__}; "
                              f"pass the same kind of buffer")
    if out.dtype != x.dtype:
        raise CollectiveError(f"{what}: out is {out.dtype}, x is {x.dtype}")
    if is_tensor(x) and out.device != x.device:
        raise CollectiveError(f"{what}: out is on {out.device}, x on {x.device}")
    n_out = received_bounds(shard_bounds(numel(x), P), rank)[-1][1]
    if numel(out) != n_out:
        raise CollectiveError(f"{what}: out has {numel(out)} elements, but rank {rank} receives "
                              f"{n_out} ({P} blocks of its shard of x's {numel(x)})")
    if n_out and _overlap(x, out):
        raise CollectiveError(f"{what}: out shares memory with x; the all-to-all does not "
                              f"run in place")


def _overlap(x, out):
    if is_tensor(x):
        a, b = x.data_ptr(), out.data_ptr()
        return a < b + nbytes(out) and b < a + nbytes(x)
    return np.may_share_memory(x, out)


def alltoall(transport, x, out, bounds, scratch=None):
    """x's blocks to every rank, theirs into out; Bruck or pairwise by block size."""
    start, stop = bounds[0]                    # block 0 is the largest (shard_bounds)
    itemsize = out.element_size() if is_tensor(out) else out.itemsize
    if uses_bruck((stop - start) * itemsize, transport.size):
        bruck(transport, x, out, bounds, scratch)
    else:
        pairwise_exchange(transport, x, out, bounds)


def pairwise_exchange(transport, x, out, bounds):
    """P-1 exchanges, one block each way per step (the shift variant)."""
    t, P, r = transport, transport.size, transport.rank
    mine = received_bounds(bounds, r)
    # step 0: our own block stays here
    a, b = bounds[r]
    copy_into(out[mine[r][0]:mine[r][1]], x[a:b])
    for step in range(1, P):
        send_to, recv_from = pairwise_peers(r, step, P)
        a, b = bounds[send_to]
        c, d = mine[recv_from]
        t.sendrecv(x[a:b], send_to, out[c:d], recv_from)


def bruck(transport, x, out, bounds, scratch=None):
    """ceil(log2 P) exchanges of the packed blocks whose distance has bit k set."""
    t, P, r = transport, transport.size, transport.rank
    sizes = [stop - start for start, stop in bounds]
    width = sizes[0]                          # a slot is as wide as the largest block

    def buffer(name, n):
        return scratch.get(name, x, n) if scratch is not None else empty_like(x, n)
    slots = buffer("alltoall slots", P * width)
    length = [0] * P                          # the size of the block each slot holds
    # 1. rotate: slot i holds our block for rank (r + i) % P
    for i in range(P):
        a, b = bounds[(r + i) % P]
        copy_into(slots[i * width:i * width + b - a], x[a:b])
        length[i] = b - a
    # 2. step k: the slots with bit k set travel 2^k ranks on
    distance = 1
    while distance < P:
        send_to, recv_from = (r + distance) % P, (r - distance) % P
        moving = [i for i in range(P) if i & distance]
        incoming = [sizes[bruck_destination(recv_from, i, distance, P)] for i in moving]
        packed = buffer("alltoall send", sum(length[i] for i in moving))
        at = 0
        for i in moving:
            copy_into(packed[at:at + length[i]], slots[i * width:i * width + length[i]])
            at += length[i]
        arrived = buffer("alltoall recv", sum(incoming))
        t.sendrecv(packed, send_to, arrived, recv_from)
        at = 0
        for i, m in zip(moving, incoming):
            copy_into(slots[i * width:i * width + m], arrived[at:at + m])
            length[i] = m
            at += m
        distance <<= 1
    # 3. rotate back: our output block j came from rank j, in slot (r - j) % P
    m = sizes[r]
    for j in range(P):
        i = (r - j) % P
        copy_into(out[j * m:(j + 1) * m], slots[i * width:i * width + m])
