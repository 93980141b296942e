"""Under torchrun (no MPI at all): torch transports over groups given as lists of
global ranks, each rank passing its own group's list.

    torchrun --standalone --nproc-per-node 3 tests/mpi/torchrun_groups.py

Ranks 0 and 2 form the group [2, 0] (out of world order: group rank 0 is world
rank 2), rank 1 the group [1].  The ring, the tree split from it (hierarchical,
one rank a node) and the torch baseline all-reduce and broadcast over the
group only, against a reference computed locally.  Then every rank asks for a
group with a rank that does not exist: every rank must refuse, naming it.
"""
import os

import numpy as np
import torch

import allreduce

rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
members = [2, 0] if rank in (0, 2) else [1]
colls = [allreduce.create("ring", comm=members, transport="torch"),
         allreduce.create("hierarchical", comm=members, transport="torch", ranks_per_node=1),
         allreduce.create("torch", comm=members)]
n = 1001


def values(world_rank):
    return np.sin(np.arange(n) * 0.37 + 1.3 * world_rank).astype(np.float32)


for coll in colls:
    assert coll.rank == members.index(rank) and coll.size == len(members), coll
    x = torch.from_numpy(values(rank))
    coll.allreduce(x)
    assert np.allclose(x.numpy(), sum(values(r) for r in members), atol=1e-5), coll
    x = torch.from_numpy(values(rank))
    coll.broadcast(x, root=0)                     # group rank 0: world rank members[0]
    assert np.array_equal(x.numpy(), values(members[0])), coll
print(f"rank {rank} ok in group {members}", flush=True)

try:
    allreduce.make_transport("torch", [rank, P])      # P is not a rank of the world
    print(f"rank {rank} made a group with rank {P}", flush=True)
except allreduce.TransportError as e:
    assert f"ranks [0, {P}]" in str(e) and "distinct ranks of the world" in str(e), e
    print(f"rank {rank} refused a bad group", flush=True)
