"""What the collective benchmark settles before any work, the same way on every rank:
its device, whether NCCL can run its ranks, and whether its sizes fit in memory.

Each problem ends the launch on every rank with one line and exit status 2,
before a buffer is allocated or a collective made: a rank that stopped alone
would leave the others waiting in their first collective.  allreduce/bench.py
(a command line, which nothing imports) calls these in this order.
"""
import os
import socket
import sys

from .bench_config import nccl_rows, over_nccl, unallocatable
from .gpus import nccl_sharing_problem


def refuse(comm, message, every_rank=False):
    """Exit 2 on every rank, the reason said in one line (by rank 0, or by every rank
    where it is each rank's own), before any work."""
    if every_rank or comm.rank == 0:
        sys.stderr.write(f"allreduce.bench rank {comm.rank}: error: {message}\n")
        sys.stderr.flush()
    comm.Barrier()                                   # every rank has said it before any exits
    sys.exit(2)


def use_device(args, comm):
    """torch.device for --device, or exit 2 on every rank with the reason (no GPU)."""
    import torch
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        refuse(comm, f"--device cuda but torch sees no GPU (torch {torch.__version__}); "
                     f"use --device cpu", every_rank=True)
    from .torch_world import local_rank
    device = torch.device("cuda", local_rank(comm) % torch.cuda.device_count())
    torch.cuda.set_device(device)                    # NCCL and the pinned copies use it
    return device


def without_shared_gpus(args, comm):
    """args.algos less the NCCL baseline row where ranks of a host would share a GPU
    (gpus.nccl_sharing_problem: NCCL fails with "Duplicate GPU detected" there), said
    in a note; exit 2 where NCCL rows were asked for.  The same answer on every rank."""
    import torch
    from mpi4py import MPI
    if args.device != "cuda" or not over_nccl(args.algos, args.transport):
        return args.algos, None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    visible = node.allgather(os.environ.get("CUDA_VISIBLE_DEVICES"))
    node.Free()
    mine = nccl_sharing_problem(socket.gethostname(), torch.cuda.device_count(), visible)
    problem = next((p for p in comm.allgather(mine) if p), None)
    try:
        return nccl_rows(args.algos, args.transport, args.nccl_added, problem)
    except ValueError as e:
        refuse(comm, str(e))


def available_memory():
    """Bytes of host memory free for new allocations (Linux: MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def refuse_unallocatable(args, comm, device):
    """Exit 2 with one line where the largest size would not fit in memory: the
    ranks of a host share its memory, and those of a GPU share the GPU's."""
    import torch
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    host_ranks = node.size
    node.Free()
    free = available_memory()
    host_free = None if free is None else free // host_ranks
    device_free = None
    if device.type == "cuda":
        per_gpu = -(-host_ranks // torch.cuda.device_count())
        device_free = torch.cuda.mem_get_info(device)[0] // per_gpu
    mine = unallocatable(args.sizes, args.dtype, comm.size, len(args.algos), host_free,
                         args.device, device_free)
    problem = next((p for p in comm.allgather(mine) if p), None)
    if problem:
        refuse(comm, problem)
