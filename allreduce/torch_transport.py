"""Point-to-point over torch.distributed: gloo for CPU tensors, NCCL for CUDA tensors.

Under torchrun the usual environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE) initialises the process group.  Under mpiexec there is no such
environment, so rank 0 picks a free port and tells the others over MPI.
"""
import atexit
import os
import socket
import sys
import time
import zlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .buffers import as_bytes, is_tensor, nbytes
from .transport import Handle, Transport, TransportTimeout, default_timeout


def under_torchrun():
    return all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))


def init_torch_distributed(comm=None, backend=None, timeout=None):
    """Initialise torch.distributed once; from torchrun's environment or from MPI ranks."""
    if dist.is_initialized():
        return
    # One process group, two backends: gloo moves CPU tensors, NCCL CUDA ones.
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank(comm) % torch.cuda.device_count())
    wait = timedelta(seconds=timeout or default_timeout())
    if under_torchrun():
        dist.init_process_group(backend, timeout=wait)
        destroy_at_exit()
        return
    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    # All ranks on one host (the usual case here): use loopback, so nothing
    # depends on how the host name resolves.  Across hosts: rank 0's address.
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1
    address = np.zeros(64, dtype=np.uint8)
    port = np.zeros(1, dtype=np.int64)
    if comm.rank == 0:
        host = os.environ.get("TOPOLAB_MASTER_ADDR") or (
            "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname()))
        with socket.socket() as s:
            s.bind((host, 0))
            port[0] = s.getsockname()[1]
        encoded = host.encode()
        address[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    comm.Bcast(address, root=0)
    comm.Bcast(port, root=0)
    host = bytes(address).rstrip(b"\0").decode()
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://{host}:{int(port[0])}",
                            rank=comm.rank, world_size=comm.size, timeout=wait)
    destroy_at_exit()


_exit = {"registered": False, "crashed": False}


def destroy_at_exit():
    """Tear the process group down when the program ends normally.  Left to
    interpreter shutdown, gloo's threads are destroyed unjoined and a rank can
    abort after its work is done ("terminate called without an active
    exception", seen once in CI under torchrun).  After an uncaught exception
    it is left alone: destroying waits for the collectives in flight, and the
    peers of a crashed rank may never finish theirs."""
    if _exit["registered"]:
        return
    _exit["registered"] = True
    previous_hook = sys.excepthook

    def note_crash(*exc_info):
        _exit["crashed"] = True
        previous_hook(*exc_info)

    def destroy():
        if dist.is_initialized() and not _exit["crashed"]:
            dist.destroy_process_group()

    sys.excepthook = note_crash
    atexit.register(destroy)


def local_rank(comm=None):
    """This process's rank among those on its host (which GPU it takes)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    rank = node.Get_rank()
    node.Free()
    return rank


def _as_tensor(buf):
    """The bytes of buf as a uint8 tensor, sharing memory."""
    b = as_bytes(buf)
    return torch.from_numpy(b) if isinstance(b, np.ndarray) else b


class _Done:
    def wait(self, timeout=None):
        return True


class TorchTransport(Transport):
    """torch.distributed point-to-point over a process group (None: the world)."""

    def __init__(self, group=None, timeout=None, traffic=None):
        super().__init__(timeout, traffic)
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r
                             for r in range(self.size)]

    def isend(self, buf, peer, tag=0):
        self.traffic.sent += nbytes(buf)
        if nbytes(buf) == 0:  # gloo rejects empty messages; the peer skips them too
            return Handle(self, _Done(), peer)
        return Handle(self, dist.isend(_as_tensor(buf), self.global_ranks[peer], tag=tag), peer)

    def irecv(self, buf, peer, tag=0):
        self.traffic.received += nbytes(buf)
        if nbytes(buf) == 0:
            return Handle(self, _Done(), peer)
        return Handle(self, dist.irecv(_as_tensor(buf), self.global_ranks[peer], tag=tag), peer)

    def _wait_all(self, handles):
        # gloo's point-to-point work makes progress only inside wait(), so we
        # cannot poll is_completed(); wait(timeout) ends the wait instead.
        deadline = time.monotonic() + self.timeout
        for h in handles:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                h.request.wait(timeout=timedelta(seconds=left))
            except RuntimeError as e:
                peer = self.world_rank(h.peer)
                if "imed out" in str(e) or "imeout" in str(e):
                    raise TransportTimeout(self.world_rank(self.rank), [peer], self.timeout) from None
                raise RuntimeError(f"rank {self.world_rank(self.rank)}: torch.distributed failed "
                                   f"talking to rank {peer}: {e}") from None

    def barrier(self):
        work = dist.barrier(group=self.group, async_op=True)
        self._wait_all([Handle(self, work, -1)])

    def split(self, color):
        # new_group must be called by every rank for every group, in the same order.
        colors = torch.zeros(self.size, dtype=torch.int64)
        colors[self.rank] = color
        dist.all_reduce(colors, group=self.group)
        mine = None
        for c in sorted(set(colors.tolist())):
            members = [self.global_ranks[r] for r in range(self.size) if colors[r] == c]
            group = dist.new_group(members)
            if c == color:
                mine = group
        return TorchTransport(mine, self.timeout, self.traffic)

    def world_rank(self, rank):
        return self.global_ranks[rank] if rank >= 0 else rank

    def node_id(self):
        """Equal on ranks that share a host."""
        return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def is_cuda(x):
    return is_tensor(x) and x.device.type == "cuda"
