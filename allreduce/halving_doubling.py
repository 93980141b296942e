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
"""
from .buffers import reduce_into
from .collective import Collective
from .shards import shard_bounds, span
from .tree import Tree


class HalvingDoubling(Collective):
    name = "halving_doubling"

    def __init__(self, transport, **options):
        super().__init__(transport, **options)
        self._tree = Tree(transport, **options)

    # ------------------------------------------------------------ folding
    def _fold_shape(self):
        p2 = 1 << (self.size.bit_length() - 1)
        return p2, self.size - p2

    def virtual_rank(self):
        """This rank's place among the p2 ranks that take part (None: sits out)."""
        p2, extra = self._fold_shape()
        r = self.rank
        if r < 2 * extra:
            return r // 2 if r % 2 else None
        return r - extra

    def _real_rank(self, v):
        p2, extra = self._fold_shape()
        return 2 * v + 1 if v < extra else v + extra

    def _blocks(self, bounds):
        """[start, stop) of each virtual rank's block: the shards of its real ranks."""
        p2, extra = self._fold_shape()
        return [span(bounds, 2 * v, 2 * v + 2) if v < extra else span(bounds, v + extra, v + extra + 1)
                for v in range(p2)]

    # -------------------------------------------------- the power-of-two core
    def _halving(self, x, blocks, v, op):
        t = self.transport
        p2 = len(blocks)
        lo, hi = 0, p2                       # the blocks this rank is still responsible for
        distance = p2 // 2
        while distance:
            partner = v ^ distance
            mid = lo + distance
            keep, give = ((lo, mid), (mid, hi)) if v < partner else ((mid, hi), (lo, mid))
            k0, k1 = blocks[keep[0]][0], blocks[keep[1] - 1][1]
            g0, g1 = blocks[give[0]][0], blocks[give[1] - 1][1]
            incoming = self.scratch.get("incoming", x, k1 - k0)
            t.sendrecv(x[g0:g1], self._real_rank(partner), incoming, self._real_rank(partner))
            reduce_into(x[k0:k1], incoming, op)
            lo, hi = keep
            distance //= 2

    def _doubling(self, x, blocks, v):
        t = self.transport
        p2 = len(blocks)
        distance = 1
        lo, hi = v, v + 1
        while distance < p2:
            partner = v ^ distance
            plo, phi = (lo + distance, hi + distance) if v < partner else (lo - distance, hi - distance)
            mine = blocks[lo][0], blocks[hi - 1][1]
            theirs = blocks[plo][0], blocks[phi - 1][1]
            t.sendrecv(x[mine[0]:mine[1]], self._real_rank(partner),
                       x[theirs[0]:theirs[1]], self._real_rank(partner))
            lo, hi = min(lo, plo), max(hi, phi)
            distance *= 2

    # ------------------------------------------------------- collectives
    def _fold_in(self, x, op):
        """Even ranks below 2*extra hand their whole vector to the odd rank above."""
        t, r = self.transport, self.rank
        p2, extra = self._fold_shape()
        if r < 2 * extra:
            if r % 2 == 0:
                t.send(x, r + 1)
            else:
                incoming = self.scratch.get("incoming", x, len(x))
                t.recv(incoming, r - 1)
                reduce_into(x, incoming, op)

    def _fold_out(self, x):
        """The odd ranks below 2*extra hand the whole result back."""
        t, r = self.transport, self.rank
        p2, extra = self._fold_shape()
        if r < 2 * extra:
            if r % 2 == 0:
                t.recv(x, r + 1)
            else:
                t.send(x, r - 1)

    def _allreduce(self, x, op):
        self._fold_in(x, op)
        v = self.virtual_rank()
        if v is not None:
            blocks = self._blocks(shard_bounds(len(x), self.size))
            self._halving(x, blocks, v, op)
            self._doubling(x, blocks, v)
        self._fold_out(x)

    def _reduce_scatter(self, x, bounds, op):
        t, r = self.transport, self.rank
        p2, extra = self._fold_shape()
        self._fold_in(x, op)
        v = self.virtual_rank()
        if v is not None:
            self._halving(x, self._blocks(bounds), v, op)
        a, b = bounds[r]
        if r < 2 * extra:                    # the odd rank owns both shards: hand one back
            if v is None:
                t.recv(x[a:b], r + 1)
            else:
                t.send(x[bounds[r - 1][0]:bounds[r - 1][1]], r - 1)
        return x[a:b]

    def _allgather(self, x, bounds):
        t, r = self.transport, self.rank
        p2, extra = self._fold_shape()
        v = self.virtual_rank()
        if r < 2 * extra:                    # fold: even hands its shard to odd
            if v is None:
                t.send(x[bounds[r][0]:bounds[r][1]], r + 1)
            else:
                t.recv(x[bounds[r - 1][0]:bounds[r - 1][1]], r - 1)
        if v is not None:
            self._doubling(x, self._blocks(bounds), v)
        self._fold_out(x)

    def _broadcast(self, x, root):
        # Broadcast has no reduction to halve; the latency-optimal tree serves.
        self._tree._broadcast(x, root)
