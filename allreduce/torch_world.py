"""torch.distributed's world: started once for the launch, from torchrun's environment
or over MPI, and torn down at a normal exit.

torch.distributed's world is always the whole launch: torchrun's ranks, or
MPI.COMM_WORLD under mpiexec (world rank i is torch rank i).  Under torchrun the
usual environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) initialises the
process group.  Under mpiexec there is no such environment, so rank 0 picks a
free port and tells the others over MPI: every rank of the launch makes the
first torch transport, as every rank makes each over part of the world.

Point-to-point transports over it, and their process groups: torch_transport.py.
"""
import atexit
import os
import socket
import sys
import zlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .errors import TransportError
from .transport import Handle, MPITransport, default_timeout

_exit = {"registered": False, "crashed": False}


def under_torchrun():
    return all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))


def torchrun_world():
    """Launched by torchrun with more than one process: torch.distributed is the only
    world (torchrun starts no MPI one)."""
    return under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1


def init_torch_distributed(comm=None, backend=None, timeout=None):
    """Initialise torch.distributed once over the whole launch: from torchrun's
    environment, or over MPI.COMM_WORLD (`comm`, if given, must span it).  Under
    mpiexec every rank must call it; one that never does ends the others' wait
    with a TransportTimeout after `timeout` seconds instead of a hang."""
    if dist.is_initialized():
        return
    # One process group, two backends: gloo moves CPU tensors, NCCL CUDA ones.
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    seconds = default_timeout() if timeout is None else float(timeout)
    if under_torchrun():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank() % torch.cuda.device_count())
        dist.init_process_group(backend, timeout=timedelta(seconds=seconds))
        destroy_at_exit()
        return
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if comm is not None and comm.size != world.size:
        raise TransportError(
            f"torch.distributed spans the whole launch ({world.size} ranks), not a "
            f"communicator of {comm.size}: initialise it over MPI.COMM_WORLD and pass the "
            f"communicator to make_transport('torch', comm)")
    mpi = MPITransport(world, seconds)
    # All ranks on one host (the usual case here): use loopback, so nothing
    # depends on how the host name resolves.  Across hosts: rank 0's address.
    hosts = np.zeros(world.size, dtype=np.int64)
    mine = np.array([zlib.crc32(socket.gethostname().encode())], dtype=np.int64)
    mpi.wait_all([Handle(mpi, world.Iallgather(mine, hosts), -1)])
    one_host = len(set(hosts.tolist())) == 1
    address = np.zeros(64, dtype=np.uint8)
    port = np.zeros(1, dtype=np.int64)
    if world.rank == 0:
        host = os.environ.get("TOPOLAB_MASTER_ADDR") or (
            "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname()))
        with socket.socket() as s:
            s.bind((host, 0))
            port[0] = s.getsockname()[1]
        encoded = host.encode()
        address[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    mpi.wait_all([Handle(mpi, world.Ibcast(address, root=0), -1),
                  Handle(mpi, world.Ibcast(port, root=0), -1)])
    host = bytes(address).rstrip(b"\0").decode()
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if torch.cuda.is_available():                  # every rank is here: a blocking split is safe
        torch.cuda.set_device(local_rank(world) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{host}:{int(port[0])}",
                            rank=world.rank, world_size=world.size,
                            timeout=timedelta(seconds=seconds))
    destroy_at_exit()




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
