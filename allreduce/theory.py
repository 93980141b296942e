"""What the textbook says each algorithm sends, and the nccl-tests bandwidth factors.

`bytes_sent(algo, collective, nbytes, P)` is the most any one rank sends, from
the algorithm's description (e.g. ring all-reduce: 2 (P-1)/P n).  The benchmark
prints it beside what the transport actually counted.

busbw (nccl-tests, doc/PERFORMANCE.md) turns the time of a collective into the
bandwidth each link must have sustained, so algorithms and P compare directly:
    allreduce 2(P-1)/P,  reduce_scatter, allgather and alltoall (P-1)/P,  broadcast 1.

Last, ZeRO's bytes sent per rank and step (`zero_comm_bytes`), built on them and
read by the cost model and strategies/bench_parallel.py alike.  ZeRO's memory and
the pipeline bubble live beside what they predict: strategies/runtime/memory.py and
strategies/parallel/bubble.py.
"""
import math

from .halving_doubling import recursive_doubling


def bus_factor(collective, P):
    if collective == "allreduce":
        return 2 * (P - 1) / P
    if collective in ("reduce_scatter", "allgather", "alltoall"):
        return (P - 1) / P
    return 1.0


def bytes_sent(algo, collective, nbytes, P):
    """Most bytes one rank sends, per the textbook; None where no simple formula holds."""
    if P == 1:
        return 0
    if collective == "alltoall":       # every algorithm object runs alltoall.py's
        if algo not in ("ring", "tree", "halving_doubling", "hierarchical"):
            return None
        from .alltoall import bytes_sent as alltoall_bytes, uses_bruck
        return alltoall_bytes(nbytes, P, uses_bruck(-(-nbytes // P), P))
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
        if collective == "allreduce" and recursive_doubling(n):
            return (p2.bit_length() - 1) * n + fold  # lg p2 swaps of the whole vector
        return {"allreduce": 2 * (p2 - 1) / p2 * n + fold,
                "reduce_scatter": (p2 - 1) / p2 * n + (n / P if fold else 0),
                "allgather": (p2 - 1) / p2 * n + fold,
                "broadcast": rounds * n}[collective]
    return None


def host_link_bytes(algo, nbytes, nodes, ranks_per_node, outer="ring"):
    """Bytes each host sends across its link in one all-reduce of nbytes; None
    for the libraries' own algorithms (mpi, mpi-raw, torch), whose schedule is
    theirs, and for auto, whose schedule is whichever it picks call by call.

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
    if algo in ("mpi", "mpi-raw", "torch", "auto"):
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


def _folded(P, n):
    """Halving-doubling on P ranks: p2, the largest power of two <= P; `real`, the
    world rank of rank v of those p2; the fold's messages (rank 2i hands its n bytes
    to 2i + 1 for each of the P - p2 extra ranks)."""
    p2 = 1 << (P.bit_length() - 1)
    extra = P - p2

    def real(v):
        return 2 * v + 1 if v < extra else v + extra
    return p2, real, [(2 * i, 2 * i + 1, n) for i in range(extra)]


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
        p2, real, fold = _folded(P, n)
        back = [(b, a, m) for a, b, m in fold]
        if recursive_doubling(n):                        # short: the whole vector, lg p2 times
            swaps = [(real(v), real(v ^ d), n) for d in _distances(p2) for v in range(p2)]
            return fold + swaps + back
        halving, distance = [], p2 // 2
        while distance:                                  # at distance d a rank sends n d / p2
            halving += [(real(v), real(v ^ distance), n * distance / p2) for v in range(p2)]
            distance //= 2
        return fold + halving + halving[::-1] + back
    raise ValueError(f"no textbook schedule for {algo!r}")


class Step:
    """One step of an all-reduce's schedule: messages that go at once.

    messages   (sender, receiver, bytes) of world ranks
    repeat     how many such steps follow one another (a ring's P - 1)
    exchange   True where every rank sends and receives at once (a ring's or
               halving-doubling's step), False where each message goes one way
               (a tree's round, a fold, a gather, a chain)
    reduces    the receivers add what arrived
    segmented  the messages go segment by segment, each waiting for the one
               before (tree.py's rounds, the chain broadcast): one latency a
               segment, where a ring's step posts all its segments at once
    fill       hops a pipelined chain takes to fill before it streams
    """
    __slots__ = ("messages", "repeat", "exchange", "reduces", "segmented", "fill")

    def __init__(self, messages, repeat=1, exchange=True, reduces=False, segmented=False,
                 fill=0):
        self.messages, self.repeat, self.exchange = messages, repeat, exchange
        self.reduces, self.segmented, self.fill = reduces, segmented, fill

    def __repr__(self):
        return (f"Step({len(self.messages)} messages x{self.repeat}, "
                f"{'exchange' if self.exchange else 'one way'}"
                f"{', reduces' if self.reduces else ''}{', segmented' if self.segmented else ''}"
                f"{f', fills in {self.fill} hops' if self.fill else ''})")


def _distances(p2):
    """1, 2, 4, ... below p2: recursive doubling's partners are v ^ d."""
    return [1 << k for k in range(p2.bit_length() - 1)]


def allreduce_steps(algo, n, P, ranks_per_node=None, outer="ring", short=None):
    """The schedule of one all-reduce of n bytes on P ranks, step by step, as
    ring.py, tree.py, halving_doubling.py and hierarchical.py run it (their
    messages add up to _allreduce_messages').  hierarchical: nodes of
    ranks_per_node consecutive ranks, inner ring, `outer` between the leaders.
    short: halving-doubling's short-message schedule (recursive doubling) or not;
    None = as halving_doubling.py chooses for n bytes (a per-byte profile, n = 1,
    says which it means)."""
    if P == 1:
        return []
    if algo == "ring":
        ring = [(r, (r + 1) % P, n / P) for r in range(P)]
        return [Step(ring, P - 1, reduces=True), Step(ring, P - 1)]
    if algo == "tree":
        # round k: every rank whose lowest set bit is 2^k sends up (reduce), then down
        rounds = [[(v, v - (1 << k), n) for v in range(1, P) if v & -v == 1 << k]
                  for k in range((P - 1).bit_length())]
        up = [Step(m, exchange=False, reduces=True, segmented=True) for m in rounds]
        down = [Step([(b, a, m) for a, b, m in msgs], exchange=False, segmented=True)
                for msgs in rounds[::-1]]
        return up + down
    if algo == "halving_doubling":
        p2, real, fold = _folded(P, n)
        fold_in = [Step(fold, exchange=False, reduces=True)] if fold else []
        fold_out = [Step([(b, a, m) for a, b, m in fold], exchange=False)] if fold else []
        if recursive_doubling(n if short is None else 0 if short else math.inf):
            return fold_in + [Step([(real(v), real(v ^ d), n) for v in range(p2)], reduces=True)
                              for d in _distances(p2)] + fold_out
        halving, distance = [], p2 // 2
        while distance:
            halving.append([(real(v), real(v ^ distance), n * distance / p2) for v in range(p2)])
            distance //= 2
        return fold_in + [Step(m, reduces=True) for m in halving] + \
            [Step(m) for m in halving[::-1]] + fold_out
    if algo == "hierarchical":
        R = ranks_per_node or P
        nodes = P // R
        steps = []
        if R > 1:
            # 1. ring reduce-scatter inside every node at once, the leader gathers the shards
            inner = [(h * R + i, h * R + (i + 1) % R, n / R)
                     for h in range(nodes) for i in range(R)]
            steps.append(Step(inner, R - 1, reduces=True))
            steps += [Step([(h * R + i, h * R, n / R) for h in range(nodes)], exchange=False)
                      for i in range(1, R)]
        # 2. the leaders all-reduce across nodes
        for s in allreduce_steps(outer, n, nodes, short=short):
            steps.append(Step([(a * R, b * R, m) for a, b, m in s.messages], s.repeat,
                              s.exchange, s.reduces, s.segmented, s.fill))
        if R > 1:
            # 3. a pipelined chain broadcast inside every node: leader -> 1 -> ... -> R-1
            chain = [(h * R + i, h * R + i + 1, n) for h in range(nodes) for i in range(R - 1)]
            steps.append(Step(chain, exchange=False, segmented=True, fill=R - 2))
        return steps
    raise ValueError(f"no textbook schedule for {algo!r}")


# ------------------------------------------------------------------------- ZeRO
def zero_comm_bytes(psi, N, stage, bytes_per_param=4):
    """Bytes one rank sends per step (ZeRO paper, section 7): stages 0-2 move what
    data parallelism moves, 2 (N-1)/N x gradient bytes (a reduce-scatter and an
    all-gather); stage 3 adds a second all-gather of the parameters: 1.5 x."""
    base = 2 * (N - 1) / N * psi * bytes_per_param
    return base * (1.5 if stage == 3 else 1.0)
