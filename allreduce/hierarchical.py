"""Hierarchical all-reduce: first inside each node, then between nodes.

Links inside a node (shared memory, NVLink) are much faster than links
between nodes, so cross the slow links as little as possible:

    node 0: ranks 0 1 2 3        node 1: ranks 4 5 6 7
      1. reduce-scatter inside the node (inner algorithm), then
         the leader (local rank 0) gathers the node's sum
      2. the leaders all-reduce across nodes (outer algorithm)     0 <==> 4
      3. each leader broadcasts the result inside its node (inner algorithm)

Only one rank per node talks across nodes, each moving 2 (N-1)/N n for N
nodes; the other ranks stay on the fast links.

Nodes are real (ranks sharing memory: MPI_COMM_TYPE_SHARED, which MPICH decides by
host name, so hosts emulated by `python -m experiments.cluster` count as nodes too)
or, for teaching on one machine, declared with `ranks_per_node=k` (ranks 0..k-1
form node 0, and so on).  A node's ranks must be consecutive, as mpiexec's
default block placement makes them.
"""
import numpy as np

from .collective import Collective
from .errors import CollectiveError
from .registry import TEXTBOOK, make_one_level
from .shards import shard_bounds, span

# What may run inside a node and between the leaders: algorithms over a split of the
# transport (the torch baseline needs a process group of its own, which a split has not;
# shm gains only on buffers in its own window, which the leaders' buffer is not).
LEVELS = TEXTBOOK + ("mpi",)


class Hierarchical(Collective):
    name = "hierarchical"

    def __init__(self, transport, inner="ring", outer="ring", ranks_per_node=None, **options):
        super().__init__(transport, **options)
        for role, algo in (("inner", inner), ("outer", outer)):
            if algo not in LEVELS:
                raise CollectiveError(f"hierarchical: {role}={algo!r} is not one of "
                                      f"{', '.join(LEVELS)}")
        if ranks_per_node is not None:
            if int(ranks_per_node) < 1:
                raise CollectiveError(f"hierarchical: ranks_per_node={ranks_per_node} must be >= 1")
            node_id = transport.rank // int(ranks_per_node)
        else:
            node_id = transport.node_id()                  # ranks sharing memory
        self.node = transport.split(node_id)            # my node's ranks
        self.is_leader = self.node.rank == 0
        leaders = transport.split(0 if self.is_leader else 1)
        self.inner = make_one_level(inner, self.node, **options)
        self.outer = make_one_level(outer, leaders, **options) if self.is_leader else None
        self.node_sizes = self._exchange_node_sizes()
        self.levels = (inner, outer)                    # the same on every rank
        self.description = f"hierarchical(inner={inner}, outer={outer}, nodes={self.node_sizes})"

    def _exchange_node_sizes(self):
        """Every node's rank count, in node order, on every rank; checks block placement."""
        first = np.array([self.rank - self.node.rank], dtype=np.int64)
        firsts = np.zeros(self.node.size, dtype=np.int64)
        firsts[self.node.rank] = first[0]
        self.inner._allgather(firsts, shard_bounds(self.node.size, self.node.size))
        if (firsts != firsts[0]).any():
            raise CollectiveError(
                f"hierarchical: the ranks of a node must be consecutive (block placement); "
                f"rank {self.rank} shares a node with ranks that are not")
        count = np.zeros(1, dtype=np.int64)
        if self.is_leader:
            nodes = self.outer.size
            sizes = np.zeros(nodes, dtype=np.int64)
            sizes[self.outer.rank] = self.node.size
            self.outer._allgather(sizes, shard_bounds(nodes, nodes))
            count[0] = nodes
        self.inner._broadcast(count, 0)
        if not self.is_leader:
            sizes = np.zeros(int(count[0]), dtype=np.int64)
        self.inner._broadcast(sizes, 0)
        return [int(s) for s in sizes]

    def _node_of(self, rank):
        """(node index, first rank of that node) of a world rank."""
        first = 0
        for node, size in enumerate(self.node_sizes):
            if rank < first + size:
                return node, first
            first += size
        raise ValueError(rank)

    def _allreduce(self, x, op):
        node = self.node
        # 1. reduce inside the node: reduce-scatter, then the leader gathers the shards
        bounds = shard_bounds(len(x), node.size)
        self.inner._reduce_scatter(x, bounds, op)
        if self.is_leader:
            node.wait_all([node.irecv(x[a:b], i) for i, (a, b) in enumerate(bounds) if i])
        else:
            a, b = bounds[node.rank]
            node.send(x[a:b], 0)
        # 2. across nodes, leaders only
        if self.is_leader:
            self.outer._allreduce(x, op)
        # 3. back inside the node
        self.inner._broadcast(x, 0)

    def _reduce_scatter(self, x, bounds, op):
        # Kept simple: a full all-reduce, then keep our shard.  It moves n rather
        # than (P-1)/P n per rank; fine for the baseline role it plays here.
        self._allreduce(x, op)
        a, b = bounds[self.rank]
        return x[a:b]

    def _allgather(self, x, bounds):
        node = self.node
        my_node, first = self._node_of(self.rank)
        # 1. the leader gathers its node's shards (contiguous: block placement)
        if self.is_leader:
            node.wait_all([node.irecv(x[bounds[first + i][0]:bounds[first + i][1]], i)
                           for i in range(1, node.size)])
        else:
            a, b = bounds[self.rank]
            node.send(x[a:b], 0)
        # 2. leaders exchange whole nodes' blocks
        if self.is_leader:
            starts = np.cumsum([0] + self.node_sizes)
            blocks = [span(bounds, int(starts[i]), int(starts[i + 1]))
                      for i in range(len(self.node_sizes))]
            self.outer._allgather(x, blocks)
        # 3. the leader hands everything to its node
        self.inner._broadcast(x, 0)

    def _broadcast(self, x, root):
        root_node, root_first = self._node_of(root)
        my_node, _ = self._node_of(self.rank)
        if my_node == root_node:
            self.inner._broadcast(x, root - root_first)
        if self.is_leader:
            self.outer._broadcast(x, root_node)
        if my_node != root_node:
            self.inner._broadcast(x, 0)
