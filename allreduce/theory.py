"""What the textbook says each algorithm sends, and the nccl-tests bandwidth factors.

`bytes_sent(algo, collective, nbytes, P)` is the most any one rank sends, from
the algorithm's description (e.g. ring all-reduce: 2 (P-1)/P n).  The benchmark
prints it beside what the transport actually counted.

busbw (nccl-tests, doc/PERFORMANCE.md) turns the time of a collective into the
bandwidth each link must have sustained, so algorithms and P compare directly:
    allreduce 2(P-1)/P,  reduce_scatter and allgather (P-1)/P,  broadcast 1.
"""
import math


def bus_factor(collective, P):
    if collective == "allreduce":
        return 2 * (P - 1) / P
    if collective in ("reduce_scatter", "allgather"):
        return (P - 1) / P
    return 1.0


def bytes_sent(algo, collective, nbytes, P):
    """Most bytes one rank sends, per the textbook; None where no simple formula holds."""
    if P == 1:
        return 0
    n = nbytes
    rounds = math.ceil(math.log2(P))                 # binomial tree depth
    p2 = 1 << (P.bit_length() - 1)
    if algo == "ring":
        return {"allreduce": 2 * (P - 1) / P * n, "reduce_scatter": (P - 1) / P * n,
                "allgather": (P - 1) / P * n, "broadcast": n}[collective]
    if algo == "tree":
        # The root sends the whole message to each of its `rounds` children.
        return {"allreduce": rounds * n, "reduce_scatter": n,
                "allgather": rounds * n, "broadcast": rounds * n}[collective]
    if algo == "halving_doubling":
        fold = n if p2 != P else 0                   # the odd rank hands the result back
        return {"allreduce": 2 * (p2 - 1) / p2 * n + fold,
                "reduce_scatter": (p2 - 1) / p2 * n + (n / P if fold else 0),
                "allgather": (p2 - 1) / p2 * n + fold,
                "broadcast": rounds * n}[collective]
    return None


def host_link_bytes(algo, nbytes, nodes, ranks_per_node, outer="ring"):
    """Bytes each host sends across its link in one all-reduce of nbytes; None
    for the libraries' own algorithms (mpi, torch), whose schedule is theirs.

    P = nodes * ranks_per_node ranks in blocks (ranks 0..R-1 on host 0, ...).
    Only a message between ranks on different hosts crosses a link:
      ring              rank r sends 2(P-1)/P n to r+1; of a host's R ranks only the
                        last has its right neighbour on another host: 2(P-1)/P n a
                        host, the same as one rank, not R times it.
      hierarchical      the steps inside a node stay inside; the leaders' outer
                        all-reduce crosses: 2(N-1)/N n a host with a ring outside.
      halving_doubling  the pairs at distance >= R cross: with R = P/2 that is the
                        first halving and the last doubling step, n/2 each way a
                        rank, n a host each way: 2n (more than the ring's 1.5n at P=4).
      tree              every edge of the binomial tree twice (reduce up, broadcast
                        down), n each; the edges between hosts end at the hosts' first
                        ranks.
    """
    if algo in ("mpi", "torch"):
        return None
    R = ranks_per_node
    P = nodes * R
    if algo == "hierarchical":
        messages = [(a * R, b * R, m) for a, b, m in _allreduce_messages(outer, nbytes, nodes)]
    else:
        messages = _allreduce_messages(algo, nbytes, P)
    sent = [0.0] * nodes
    for src, dst, m in messages:
        if src // R != dst // R:
            sent[src // R] += m
    return sent


def _allreduce_messages(algo, n, P):
    """(sender, receiver, bytes) of every message of one all-reduce of n bytes on P
    ranks, as the textbook schedules them (ring.py, tree.py, halving_doubling.py)."""
    if P == 1:
        return []
    if algo == "ring":
        return [(r, (r + 1) % P, 2 * (P - 1) / P * n) for r in range(P)]
    if algo == "tree":
        up = [(v, v & (v - 1), n) for v in range(1, P)]      # to the parent: lowest bit cleared
        return up + [(parent, child, m) for child, parent, m in up]
    if algo == "halving_doubling":
        p2 = 1 << (P.bit_length() - 1)
        extra = P - p2

        def real(v):
            return 2 * v + 1 if v < extra else v + extra
        fold = [(2 * i, 2 * i + 1, n) for i in range(extra)]
        halving, distance = [], p2 // 2
        while distance:                                  # at distance d a rank sends n d / p2
            halving += [(real(v), real(v ^ distance), n * distance / p2) for v in range(p2)]
            distance //= 2
        return fold + halving + halving[::-1] + [(b, a, m) for a, b, m in fold]
    raise ValueError(f"no textbook schedule for {algo!r}")
