"""Binomial tree: reduce to a root, then broadcast from it.

The tree MPICH uses for short messages.  Ranks are renumbered so the root is
0 (`vrank = (rank - root) % P`); with P = 8:

              0                 round 0: 1->0, 3->2, 5->4, 7->6
           /  |  \\              round 1: 2->0, 6->4
          1   2   4             round 2: 4->0
              |   | \\
              3   5  6          Reduce: in round k a rank whose bit k is set
                     |          sends its partial sum to its parent and is
                     7          done; the others add in their child's.

`parent(v)` clears v's lowest set bit; `children(v)` adds each lower power of
two.  Broadcast walks the same tree downwards.  Both take ceil(log2 P) rounds
of a whole message: latency log P, but n log P bytes through the root's links,
which is why rings win for large messages.  Messages travel in segments so
the levels of the tree work at once (a pipelined tree).

Reduce-scatter is a reduce followed by the root sending each rank its shard;
all-gather is a binomial gather (a subtree's shards are contiguous, since the
root is rank 0) followed by a broadcast.
"""
from .buffers import reduce_into
from .collective import Collective


def parent(vrank):
    """vrank with its lowest set bit cleared; the root (0) has none."""
    return vrank & (vrank - 1) if vrank else None


def children(vrank, size):
    """vrank + 2^k for every 2^k below vrank's lowest set bit, smallest first."""
    limit = vrank & -vrank if vrank else 1 << size.bit_length()
    kids = []
    step = 1
    while step < limit and vrank + step < size:
        kids.append(vrank + step)
        step <<= 1
    return kids


def subtree(vrank, size):
    """The [first, stop) of the vranks in vrank's subtree."""
    limit = vrank & -vrank if vrank else 1 << size.bit_length()
    return vrank, min(vrank + limit, size)


class Tree(Collective):
    name = "tree"

    def __init__(self, transport, **options):
        super().__init__(transport, **options)
        self._families = {}

    def _real(self, vrank, root):
        return (vrank + root) % self.size

    def family(self, root):
        """(parent, children) of this rank in the tree rooted at `root`, as real
        ranks, children smallest subtree first; kept per root."""
        found = self._families.get(root)
        if found is None:
            v = (self.rank - root) % self.size
            up = parent(v)
            found = self._families[root] = (
                None if up is None else self._real(up, root),
                [self._real(c, root) for c in children(v, self.size)])
        return found

    def _reduce(self, x, op, root):
        t = self.transport
        up, kids = self.family(root)
        for a, b in self.segments(x, len(x)):
            incoming = self.scratch.get("incoming", x, b - a)
            for child in kids:
                t.recv(incoming, child)
                reduce_into(x[a:b], incoming, op)
            if up is not None:
                t.send(x[a:b], up)

    def _bcast(self, x, root):
        t = self.transport
        up, kids = self.family(root)
        sends = []
        for a, b in self.segments(x, len(x)):
            if up is not None:
                t.recv(x[a:b], up)
            sends += [t.isend(x[a:b], child) for child in reversed(kids)]  # largest subtree first
        t.wait_all(sends)

    def _allreduce(self, x, op):
        self._reduce(x, op, root=0)
        self._bcast(x, root=0)

    def _broadcast(self, x, root):
        self._bcast(x, root)

    def _reduce_scatter(self, x, bounds, op):
        t = self.transport
        self._reduce(x, op, root=0)
        if self.rank == 0:
            t.wait_all([t.isend(x[a:b], r) for r, (a, b) in enumerate(bounds) if r != 0])
        else:
            a, b = bounds[self.rank]
            t.recv(x[a:b], 0)
        a, b = bounds[self.rank]
        return x[a:b]

    def _allgather(self, x, bounds):
        # Gather up the tree: each rank forwards its whole subtree's shards, which
        # are contiguous in x because the root is rank 0 (vrank == rank).
        t, P, r = self.transport, self.size, self.rank
        for child in children(r, P):
            first, stop = subtree(child, P)
            t.recv(x[bounds[first][0]:bounds[stop - 1][1]], child)
        up = parent(r)
        if up is not None:
            first, stop = subtree(r, P)
            t.send(x[bounds[first][0]:bounds[stop - 1][1]], up)
        self._bcast(x, root=0)
