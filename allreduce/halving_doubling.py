"""Rabenseifner's all-reduce: recursive-halving reduce-scatter, then
recursive-doubling all-gather (Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", 2005).

With P a power of two, P = 4, ranks pair at distance P/2, then P/4, ...:

    halving   distance 2: 0<->2, 1<->3  swap halves;   each keeps the half it owns
              distance 1: 0<->1, 2<->3  swap quarters; each now owns 1/4, fully summed
    doubling  distance 1: 0<->1, 2<->3  swap quarters
              distance 2: 0<->2, 1<->3  swap halves;   everyone has everything

log2 P steps each way (latency like a tree) while each rank sends only
2 (P-1)/P n elements (bandwidth like a ring).

P not a power of two: fold it to p2, the largest power of two below it.  With
extra = P - p2, the first 2*extra ranks pair up (0,1), (2,3), ...: the even one
hands its vector to the odd one and sits out; the p2 ranks left run the power-
of-two algorithm as "virtual" ranks; at the end the odd ones hand the result
back.  Virtual rank v owns the shards of the real ranks it stands for, so the
reduce-scatter still leaves rank r with shard r.

Short messages (below RECURSIVE_DOUBLING_BELOW bytes) take the other half of the
same paper's rule, as MPICH does: recursive doubling, lg p2 exchanges of the
*whole* vector at distance 1, 2, 4, ..., each rank adding what came.

    distance 1: 0<->1, 2<->3  swap all;  each holds x0+x1 or x2+x3
    distance 2: 0<->2, 1<->3  swap all;  everyone holds the sum

It sends lg p2 times n where halving-doubling sends 2 (p2-1)/p2 n, but in half
the messages (lg p2, not 2 lg p2): when a message costs more to start than to
carry, it wins.  At P = 2 it is one exchange.  The threshold is where the two
alpha-beta-gamma formulas (allreduce/costs.py) cross with this machine's
alpha ~ 6 us and beta ~ gamma ~ 0.2 ns/B: 60 KB at P = 2, 34 KB at 4, 27 KB at
8; 32 KiB sits between.  Every rank adds the same two partial sums, only in
swapped order, and float addition commutes: all ranks end bit-identical.
"""
from .buffers import reduce_into
from .collective import Collective
from .shards import span
from .tree import Tree


RECURSIVE_DOUBLING_BELOW = 32 << 10     # bytes; below it the all-reduce doubles only


def recursive_doubling(nbytes):
    """Whether an all-reduce of nbytes takes the short-message schedule."""
    return nbytes < RECURSIVE_DOUBLING_BELOW


def fold(P):
    """(p2, extra): the largest power of two <= P, and how many ranks exceed it."""
    p2 = 1 << (P.bit_length() - 1)
    return p2, P - p2


def virtual_rank(rank, P):
    """rank's place among the p2 ranks that take part; None for the even ranks that sit out."""
    p2, extra = fold(P)
    if rank < 2 * extra:
        return rank // 2 if rank % 2 else None
    return rank - extra


def real_rank(v, P):
    """The rank that plays virtual rank v."""
    p2, extra = fold(P)
    return 2 * v + 1 if v < extra else v + extra


def blocks(bounds, P):
    """[start, stop) of each virtual rank's block: the shards of the real ranks it stands for."""
    p2, extra = fold(P)
    return [span(bounds, 2 * v, 2 * v + 2) if v < extra else span(bounds, v + extra, v + extra + 1)
            for v in range(p2)]


class HalvingDoubling(Collective):
    name = "halving_doubling"

    def __init__(self, transport, **options):
        super().__init__(transport, **options)
        self._tree = Tree(transport, **options)
        self._owned = {}
        # fixed for the communicator: the fold, and this rank's place in it
        self.p2, self.extra = fold(self.size)
        self.v = virtual_rank(self.rank, self.size)

    def owned(self, n):
        """blocks() of an n-element all-reduce, kept per n, as shard_bounds is."""
        owned = self._owned.get(n)
        if owned is None:
            if len(self._owned) >= 64:
                self._owned.clear()
            owned = self._owned[n] = blocks(self.shard_bounds(n), self.size)
        return owned

    # -------------------------------------------------- the power-of-two core
    def _halving(self, x, owned, v, op):
        p2 = len(owned)
        lo, hi = 0, p2                       # the blocks this rank is still responsible for
        distance = p2 // 2
        while distance:
            partner = v ^ distance
            mid = lo + distance
            keep, give = ((lo, mid), (mid, hi)) if v < partner else ((mid, hi), (lo, mid))
            k0, k1 = owned[keep[0]][0], owned[keep[1] - 1][1]
            g0, g1 = owned[give[0]][0], owned[give[1] - 1][1]
            peer = real_rank(partner, self.size)
            # the partner's half of what we keep comes in and is added to ours
            self.sendrecv_reduce(x[g0:g1], peer, x[k0:k1], peer, op)
            lo, hi = keep
            distance //= 2

    def _recursive_doubling(self, x, v, op):
        """Short messages: swap the whole vector at distance 1, 2, 4, ... and add."""
        distance = 1
        while distance < self.p2:
            peer = real_rank(v ^ distance, self.size)
            # one segment: sendrecv_reduce finishes the send before it adds
            self.sendrecv_reduce(x, peer, x, peer, op)
            distance *= 2

    def _doubling(self, x, owned, v):
        t = self.transport
        p2 = len(owned)
        distance = 1
        lo, hi = v, v + 1
        while distance < p2:
            partner = v ^ distance
            plo, phi = (lo + distance, hi + distance) if v < partner else (lo - distance, hi - distance)
            mine = owned[lo][0], owned[hi - 1][1]
            theirs = owned[plo][0], owned[phi - 1][1]
            peer = real_rank(partner, self.size)
            t.sendrecv(x[mine[0]:mine[1]], peer, x[theirs[0]:theirs[1]], peer)
            lo, hi = min(lo, plo), max(hi, phi)
            distance *= 2

    # ------------------------------------------------------- collectives
    def _fold_in(self, x, op):
        """Even ranks below 2*extra hand their whole vector to the odd rank above."""
        t, r = self.transport, self.rank
        if r < 2 * self.extra:
            if r % 2 == 0:
                t.send(x, r + 1)
            else:
                incoming = self.scratch.get("incoming", x, len(x))
                t.recv(incoming, r - 1)
                reduce_into(x, incoming, op)

    def _fold_out(self, x):
        """The odd ranks below 2*extra hand the whole result back."""
        t, r = self.transport, self.rank
        if r < 2 * self.extra:
            if r % 2 == 0:
                t.recv(x, r + 1)
            else:
                t.send(x, r - 1)

    def _allreduce(self, x, op):
        self._fold_in(x, op)
        v = self.v
        # a vector of more than one segment would be added to while still being sent
        if v is not None and recursive_doubling(x.nbytes) and x.nbytes <= self.segment_bytes:
            self._recursive_doubling(x, v, op)
        elif v is not None:
            owned = self.owned(len(x))
            self._halving(x, owned, v, op)
            self._doubling(x, owned, v)
        self._fold_out(x)

    def _reduce_scatter(self, x, bounds, op):
        t, r = self.transport, self.rank
        p2, extra = fold(self.size)
        self._fold_in(x, op)
        v = virtual_rank(self.rank, self.size)
        if v is not None:
            self._halving(x, blocks(bounds, self.size), v, op)
        a, b = bounds[r]
        if r < 2 * extra:                    # the odd rank owns both shards: hand one back
            if v is None:
                t.recv(x[a:b], r + 1)
            else:
                t.send(x[bounds[r - 1][0]:bounds[r - 1][1]], r - 1)
        return x[a:b]

    def _allgather(self, x, bounds):
        t, r = self.transport, self.rank
        p2, extra = fold(self.size)
        v = virtual_rank(self.rank, self.size)
        if r < 2 * extra:                    # fold: even hands its shard to odd
            if v is None:
                t.send(x[bounds[r][0]:bounds[r][1]], r + 1)
            else:
                t.recv(x[bounds[r - 1][0]:bounds[r - 1][1]], r - 1)
        if v is not None:
            self._doubling(x, blocks(bounds, self.size), v)
        self._fold_out(x)

    def _broadcast(self, x, root):
        # Broadcast has no reduction to halve; the latency-optimal tree serves.
        self._tree._broadcast(x, root)
