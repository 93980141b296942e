"""Ring all-reduce: reduce-scatter, then all-gather, around a ring of P ranks.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations" (2009); the algorithm Baidu brought to deep learning in 2017.

          rank 0 ───▶ rank 1            each rank sends only to its right
            ▲            │              neighbour and receives only from
            │            ▼              its left one
          rank 3 ◀─── rank 2

The buffer is cut into P chunks (`shard_bounds`, so uneven sizes work).

Reduce-scatter, step s = 0 .. P-2: rank r sends chunk (r - s - 1) % P to the
right and receives chunk (r - s - 2) % P from the left, adding it to its own.

    step | rank 0 sends | rank 1 sends | rank 2 sends | rank 3 sends
      0  |      c3      |      c0      |      c1      |      c2
      1  |      c2      |      c3      |      c0      |      c1
      2  |      c1      |      c2      |      c3      |      c0

After P-1 steps rank r holds the complete sum of chunk r: its shard.
All-gather, step s: rank r sends chunk (r - s) % P, the one it completed last,
and receives chunk (r - s - 1) % P, which it stores as it is.

Each rank sends 2 (P-1)/P n elements, whatever P: the bandwidth bound for
all-reduce, which is why nccl-tests' busbw is algbw * 2 (P-1)/P.

Pipelining: a chunk longer than SEGMENT_BYTES is sent in segments, and every
segment's receive is posted at once, so adding segment k overlaps receiving
segment k+1 (Collective.sendrecv_reduce).
"""
from .collective import Collective


def reduce_scatter_chunks(rank, step, P):
    """(chunk sent right, chunk received from the left) at reduce-scatter step `step`."""
    return (rank - step - 1) % P, (rank - step - 2) % P


def allgather_chunks(rank, step, P):
    """(chunk sent right, chunk received from the left) at all-gather step `step`."""
    return (rank - step) % P, (rank - step - 1) % P


class Ring(Collective):
    name = "ring"

    def _allreduce(self, x, op):
        bounds = self.shard_bounds(len(x))
        self._reduce_scatter(x, bounds, op)
        self._allgather(x, bounds)

    def _reduce_scatter(self, x, bounds, op):
        P, r = self.size, self.rank
        right, left = (r + 1) % P, (r - 1) % P
        for step in range(P - 1):
            send_chunk, recv_chunk = reduce_scatter_chunks(r, step, P)
            s0, s1 = bounds[send_chunk]
            r0, r1 = bounds[recv_chunk]
            # our partial sum of send_chunk goes right; the left neighbour's
            # partial sum of recv_chunk is added into ours
            self.sendrecv_reduce(x[s0:s1], right, x[r0:r1], left, op)
        start, stop = bounds[r]
        return x[start:stop]

    def _allgather(self, x, bounds):
        t, P, r = self.transport, self.size, self.rank
        right, left = (r + 1) % P, (r - 1) % P
        for step in range(P - 1):
            send_chunk, recv_chunk = allgather_chunks(r, step, P)
            s0, s1 = bounds[send_chunk]
            r0, r1 = bounds[recv_chunk]
            t.sendrecv(x[s0:s1], right, x[r0:r1], left)

    def _broadcast(self, x, root):
        """A pipelined chain: root -> root+1 -> ... -> root-1, segment by segment,
        so every link of the ring is busy once the pipeline has filled."""
        t, P, r = self.transport, self.size, self.rank
        position = (r - root) % P           # 0 for the root, P-1 for the chain's end
        right, left = (r + 1) % P, (r - 1) % P
        sends = []
        for a, b in self.segments(x, len(x)):
            if position != 0:
                t.recv(x[a:b], left)
            if position != P - 1:
                sends.append(t.isend(x[a:b], right))
        t.wait_all(sends)
