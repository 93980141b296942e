"""The CUDA IPC transport's protocol (allreduce/cuda_ipc.py) at P = 3, on the host.

Ranks 0 and 1 "share a GPU"; rank 2 is on one of its own.  The device memory is
a stand-in: blocks are files in the folder given as the first argument, which the
peer maps (torch.from_file, shared), so headers, slots, acks and the staged path
to rank 2 run as they would on a GPU.  Every tensor here stands for a CUDA one.

    mpiexec -n 3 python -m mpi4py tests/mpi/cuda_ipc_protocol.py FOLDER
"""
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import allreduce
from allreduce.cuda_ipc import HANDLE_BYTES, SharedGpuTransport, peers_sharing
from allreduce.errors import TransportError
from allreduce.transport import MPITransport

world = MPI.COMM_WORLD
rank, P = world.rank, world.size
FOLDER = sys.argv[1]


class FileMemory:
    """Bytes in shared files: a handle is the file's name in FOLDER.  A copy is queued, as on a
    GPU's stream, and done only at finished(): a peer that read a block before the
    copy into it was waited for would find the bytes of before."""

    def __init__(self):
        self.made, self.paths, self.queued = 0, {}, []

    def allocate(self, n):
        path = os.path.join(FOLDER, f"block-{rank}-{self.made}")
        self.made += 1
        with open(path, "wb") as f:
            f.truncate(n)
        block = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
        self.paths[block.data_ptr()] = path
        return block, os.path.basename(path).encode().ljust(HANDLE_BYTES, b"\0")

    def open(self, handle, n):
        path = os.path.join(FOLDER, handle.rstrip(b"\0").decode())
        return torch.from_file(path, shared=True, size=n, dtype=torch.uint8)

    def copy(self, dst, src):
        self.queued.append((dst, src.clone()))    # src as it is now, as a stream would read it

    def finished(self):
        for dst, src in self.queued:
            dst.copy_(src)
        self.queued = []

    def free(self, block):
        path = self.paths.pop(block.data_ptr(), None)
        if path:
            os.unlink(path)


class EveryTensorOnTheGpu(SharedGpuTransport):
    def direct(self, buf, peer):
        return torch.is_tensor(buf) and peer in self.peers

    def needs_host(self, x):          # the staged path, to rank 2, as for a CUDA tensor
        return torch.is_tensor(x)


class RefusedToRank1(FileMemory):
    """Memory that rank 1 cannot map (as a container without the host's IPC namespace)."""

    def open(self, handle, n):
        if rank == 1:
            raise TransportError("cudaIpcOpenMemHandle failed: CUDA error 201 (stand-in)")
        return super().open(handle, n)


identities = [b"gpu-a" * 6 + b"..", b"gpu-a" * 6 + b"..", b"gpu-b" * 6 + b".."]
assert peers_sharing(identities, rank) == {0: [1], 1: [0], 2: []}[rank]

# 0. where one rank cannot map its peer's memory, no rank uses CUDA IPC
assert EveryTensorOnTheGpu.among(MPITransport(), RefusedToRank1(), identities[rank]) is None
alone = (b"own gpu %d" % rank).ljust(32, b".")
assert EveryTensorOnTheGpu.among(MPITransport(), FileMemory(), alone) is None   # no one shares
t = EveryTensorOnTheGpu.among(MPITransport(), FileMemory(), identities[rank])
assert sorted(t.peers) == {0: [1], 1: [0], 2: []}[rank], t.peers


def values(n, dtype, r):
    return ((torch.arange(n, dtype=torch.int64) * (r + 1)) % 17).to(dtype)


# 1. the textbook collectives, awkward sizes, several dtypes: exact (small integers)
for name in ("ring", "tree", "halving_doubling"):
    coll = allreduce.make(name, t)
    coll.segment_bytes = t.segment_bytes
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        for n in (1, 2, 7, 1000003):
            x = values(n, dtype, rank)
            coll.allreduce(x)
            expected = sum(values(n, torch.float64, r) for r in range(P)).to(dtype)
            assert torch.equal(x, expected), (name, dtype, n)
    shard = coll.reduce_scatter(values(1001, torch.float32, rank))
    whole = coll.allgather(shard, 1001)
    assert torch.equal(whole, sum(values(1001, torch.float32, r) for r in range(P))), name
    y = values(5, torch.float32, rank)
    coll.broadcast(y, root=2)
    assert torch.equal(y, values(5, torch.float32, 2)), name
world.Barrier()

# 2. several messages in flight before any receive: a send never waits for its receiver
t.close()
t = EveryTensorOnTheGpu.among(MPITransport(), FileMemory(), identities[rank])   # no slots yet
sizes = {1: 10, 2: 3 << 18, 3: 10}          # elements of float32
go = np.zeros(1)
if rank == 0:
    t.wait_all([t.isend(values(n, torch.float32, k), 1, tag=k) for k, n in sizes.items()])
    assert len(t.slots[1]) == 3
    world.Recv(go, 1, tag=99)                   # rank 1 has taken the last one only
    assert [s.free() for s in t.slots[1]] == [False, False, True]   # each ack frees its own
    world.Send(go, 1, tag=99)
    got = torch.empty(7, dtype=torch.float32)
    t.recv(got, 1)
    assert torch.equal(got, values(7, torch.float32, 9))
elif rank == 1:
    time.sleep(0.2)
    got = {k: torch.empty(n, dtype=torch.float32) for k, n in sizes.items()}
    for k in (3, 2, 1):                         # in the reverse order
        t.recv(got[k], 0, tag=k)
        assert torch.equal(got[k], values(sizes[k], torch.float32, k)), k
        if k == 3:
            time.sleep(0.2)                     # its ack has arrived
            world.Send(go, 0, tag=99)
            world.Recv(go, 0, tag=99)
    t.send(values(7, torch.float32, 9), 0)      # the other way, meanwhile
world.Barrier()
if rank == 0:                   # the acks are in: the same three slots serve again
    t.wait_all([t.isend(values(n, torch.float32, k), 1, tag=k) for k, n in sizes.items()])
    assert len(t.slots[1]) == 3, len(t.slots[1])
elif rank == 1:
    for k, n in sizes.items():
        buf = torch.empty(n, dtype=torch.float32)
        t.recv(buf, 0, tag=k)
        assert torch.equal(buf, values(n, torch.float32, k))
world.Barrier()

# 3. a tensor that requires grad (an expert layer's, inside its autograd.Function)
if rank in (0, 1):
    leaf = values(6, torch.float32, rank).requires_grad_()
    into = torch.zeros(6).requires_grad_()
    t.sendrecv(leaf, 1 - rank, into, 1 - rank)
    assert torch.equal(into.detach(), values(6, torch.float32, 1 - rank))
world.Barrier()

# 4. the traffic is the payload's bytes, not the headers'
before = t.traffic.sent
if rank in (0, 1):
    t.sendrecv(values(1000, torch.float32, rank), 1 - rank,
               torch.empty(1000, dtype=torch.float32), 1 - rank)
    assert t.traffic.sent - before == 4000, t.traffic.sent - before
world.Barrier()

# 5. a receive of the wrong size names both sizes
if rank == 0:
    t.send(torch.zeros(2, dtype=torch.float32), 1)
elif rank == 1:
    try:
        t.recv(torch.empty(4, dtype=torch.float32), 0)
        raise AssertionError("a receive of the wrong size went through")
    except TransportError as e:
        assert "rank 0 sent 8 bytes where rank 1 expected 16" in str(e), e
world.Barrier()

t.close()
world.Barrier()
left = os.listdir(FOLDER)             # every block freed: every file gone
assert not left, left
print(f"OK rank {rank}", flush=True)
