"""Shared-memory reduce-scatter: every rank sums its shard straight out of its
peers' buffers, as NCCL does inside a node, with no message in between.

MPI-3 maps one window into every process of a node (MPI_Win_allocate_shared;
Hoefler et al., "MPI+MPI: a new hybrid approach to parallel programming with
MPI plus shared memory", Computing 2013): segment p of the window is rank p's
buffer, and every rank can read every segment.

    segments:   rank 0 [ s0 | s1 | s2 ]   rank 1 [ s0 | s1 | s2 ]   rank 2 [ ... ]
      1. barrier: every input is in its segment
      2. reduce-scatter: rank r adds shard r of every other segment into its own shard r
      3. barrier: every shard is summed, in its owner's segment
      4. all-gather: rank r copies shard p out of segment p, for every p != r
      5. barrier: no shard is overwritten while a peer still reads it

Memory traffic of one rank at P = 2, n bytes: step 2 reads n and writes n/2,
step 4 reads and writes n/2: 2.5 n.  The ring moves the same shard through a
message (MPICH copies it once, straight into a scratch buffer) and then adds
it: 3.5 n.  The saving needs the buffer to live in the window already, as a
gradient bucket can (`coll.empty(n, dtype)`, collective: every rank calls it
alike); a buffer anywhere else would be copied in and out, which costs more
than it saves, so any other buffer, and the other collectives, go by the ring.
Ranks on several nodes: no window spans them, so the constructor refuses.
Loads and stores are ordered by the barriers alone, which holds on coherent
hosts (x86, and MPICH's unified memory model); a strictly portable version
would bracket each barrier with MPI_Win_sync.
"""
import numpy as np

from .buffers import CollectiveError, reduce_into
from .collective import Collective
from .ring import Ring
from .transport import Handle, MPITransport


class SharedMemory(Collective):
    name = "shm"
    counts_traffic = False      # peers' segments are read with loads, not messages

    def __init__(self, transport, **options):
        if not isinstance(transport, MPITransport):
            raise CollectiveError("shm needs an MPI transport (MPI-3 shared-memory windows)")
        super().__init__(transport, **options)
        MPI, comm = transport.MPI, transport.comm
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        on_one_node = node.Get_size() == comm.Get_size()
        node.Free()
        if not on_one_node:
            raise CollectiveError(f"shm: the {comm.Get_size()} ranks are on several nodes; "
                                  f"use hierarchical or auto")
        self.MPI, self.comm = MPI, comm
        self.ring = Ring(transport, **options)
        self.windows = []                    # (window, [segment p as uint8, ...])

    def empty(self, n, dtype=np.float32):
        """A new n-element buffer in a window of its own (collective: every rank
        asks for the same n and dtype, in the same order)."""
        dtype = np.dtype(dtype)
        win = self.MPI.Win.Allocate_shared(max(n, 1) * dtype.itemsize, dtype.itemsize,
                                           comm=self.comm)
        segments = [np.frombuffer(win.Shared_query(p)[0], dtype=np.uint8)
                    for p in range(self.size)]
        self.windows.append((win, segments))
        return segments[self.rank][:n * dtype.itemsize].view(dtype)

    def _peers_of(self, x):
        """x as it lies in every rank's segment, or None when x is not in a window."""
        if type(x) is not np.ndarray:
            return None
        address = x.__array_interface__["data"][0]
        for _, segments in self.windows:
            start = segments[self.rank].__array_interface__["data"][0]
            offset = address - start
            if 0 <= offset and offset + x.nbytes <= len(segments[self.rank]):
                return [s[offset:offset + x.nbytes].view(x.dtype) for s in segments]
        return None

    def _barrier(self):
        self.transport._wait_all((Handle(self.transport, self.comm.Ibarrier(), -1),))

    def _allreduce(self, x, op):
        peers = self._peers_of(x)
        if peers is None:
            self.ring._allreduce(x, op)
            return
        P, r = self.size, self.rank
        bounds = self.shard_bounds(len(x))
        # 1. every input is in place
        self._barrier()
        # 2. reduce-scatter: shard r of every peer's segment into ours
        a, b = bounds[r]
        for step in range(1, P):
            reduce_into(x[a:b], peers[(r + step) % P][a:b], op)
        # 3. every shard is summed
        self._barrier()
        # 4. all-gather: each owner's shard out of its segment
        for step in range(1, P):
            owner = (r + step) % P
            a, b = bounds[owner]
            x[a:b] = peers[owner][a:b]
        # 5. nobody overwrites a shard a peer is still copying
        self._barrier()

    def _reduce_scatter(self, x, bounds, op):
        return self.ring._reduce_scatter(x, bounds, op)

    def _allgather(self, x, bounds):
        self.ring._allgather(x, bounds)

    def _broadcast(self, x, root):
        self.ring._broadcast(x, root)
