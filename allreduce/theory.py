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
