"""Point-to-point over torch.distributed: gloo for CPU tensors, NCCL for CUDA tensors.

torch.distributed's world is always the whole launch: torchrun's ranks, or
MPI.COMM_WORLD under mpiexec (world rank i is torch rank i).  Under torchrun the
usual environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) initialises the
process group.  Under mpiexec there is no such environment, so rank 0 picks a
free port and tells the others over MPI: every rank of the launch must create
the first torch transport (later ones only their members).

A transport over part of the world runs on a process group of its own:

    make_transport("torch")                   the whole world (the default group)
    make_transport("torch", comm)             an mpi4py communicator's ranks, in its rank order
    make_transport("torch", [4, 6, 5])        these global ranks, in this order (torchrun:
                                              every member passes the same list)
    make_transport("torch", process_group)    a torch ProcessGroup made elsewhere, as it is

How a group is made (`group_of`).  torch's plain `new_group` must be entered by
every rank of the world, for every group, in the same order, members or not.
The members of a communicator cannot ask that of the others: its parent may be
COMM_WORLD (then every rank is splitting too) or only part of it (the workers
of a parameter-server run, a node inside a hierarchical all-reduce on a
sub-group), whose outsiders never call.  So groups are made with
`use_local_synchronization=True`: only the members enter, and they meet in a
rendezvous of their own, named after the member list.  That cannot deadlock
here: the members enter right after a collective over exactly those members
(or, for a communicator, right after making the transport, which all of them
do at the same point), with nothing in between.  Each process makes a group
once and keeps it by its member tuple, as torch keeps its groups: two
transports over the same ranks share one group, so use them from one thread.
"""
import atexit
import inspect
import os
import socket
import sys
import time
import zlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .buffers import CollectiveError, as_bytes, is_tensor, nbytes
from .transport import Handle, MPITransport, Transport, TransportTimeout, default_timeout


def under_torchrun():
    return all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))


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
        raise CollectiveError(
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


# member tuple (global ranks, in group-rank order) -> ProcessGroup; torch keeps
# every group for the life of the process as well (see the module docstring)
_groups = {}


def group_of(members, timeout=None):
    """The process group of `members` (global ranks, group rank i = members[i]);
    None for the whole world in order.  Every member calls it, nobody else."""
    members = tuple(int(r) for r in members)
    world, me = dist.get_world_size(), dist.get_rank()
    if members == tuple(range(world)):
        return None
    if len(set(members)) != len(members) or not all(0 <= r < world for r in members):
        raise CollectiveError(f"a torch group needs distinct ranks of the world "
                              f"(0..{world - 1}), got {list(members)}")
    if me not in members:
        raise CollectiveError(f"rank {me} asked for the group of ranks {list(members)}, "
                              "which it is not one of: only members create a group")
    if members not in _groups:
        options = {}
        if list(members) != sorted(members):      # keep the communicator's rank order
            if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
                raise CollectiveError(
                    f"ranks {list(members)} are not in world order, and this torch "
                    f"({torch.__version__}) sorts a group's ranks: split with key=world rank")
            options["sort_ranks"] = False
        seconds = default_timeout() if timeout is None else float(timeout)
        _groups[members] = dist.new_group(list(members), timeout=timedelta(seconds=seconds),
                                          use_local_synchronization=True, **options)
    return _groups[members]


def group_for(where=None, timeout=None):
    """The process group of `where`: None (the world), an mpi4py communicator, a
    list of global ranks or a ProcessGroup (see the module docstring)."""
    if where is None or isinstance(where, dist.ProcessGroup):
        return where
    if isinstance(where, (list, tuple, range)):
        return group_of(where, timeout)
    from mpi4py import MPI
    if not isinstance(where, MPI.Comm):
        raise CollectiveError(f"a torch transport runs over None, an mpi4py communicator, a "
                              f"list of ranks or a ProcessGroup, not {type(where).__name__}")
    # The communicator's ranks in COMM_WORLD (= torch's ranks), in its own rank order.
    members = MPI.Group.Translate_ranks(where.Get_group(), list(range(where.size)),
                                        MPI.COMM_WORLD.Get_group())
    return group_of(members, timeout)


def _as_tensor(buf):
    """The bytes of buf as a uint8 tensor, sharing memory."""
    b = as_bytes(buf)
    return torch.from_numpy(b) if isinstance(b, np.ndarray) else b


class _Done:
    def wait(self, timeout=None):
        return True


class _Batched:
    """A CUDA send or receive held until the next wait, then posted in one batch."""

    def __init__(self):
        self.works = None

    def wait(self, timeout=None):
        for work in self.works:
            work.wait(timeout=timeout)
        return True


class TorchTransport(Transport):
    """torch.distributed point-to-point over a process group (None: the world)."""

    def __init__(self, group=None, timeout=None, traffic=None):
        super().__init__(timeout, traffic)
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise CollectiveError(f"rank {dist.get_rank()} is not a member of the process "
                                  f"group it was given")
        self.size = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r
                             for r in range(self.size)]
        # NCCL moves CUDA tensors; with gloo alone they must travel through host memory.
        self.takes_cuda = "nccl" in str(dist.get_backend(group)).lower()
        self._held = []
        if self.takes_cuda:
            # NCCL makes a group's communicator at its first CUDA call, which every
            # member must join; a batch of sends and receives need not involve all.
            warm = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
            self._wait_all([Handle(self, dist.all_reduce(warm, group=group, async_op=True), -1)])

    def isend(self, buf, peer, tag=0):
        self.traffic.sent += nbytes(buf)
        return self._post(dist.isend, buf, peer, tag)

    def irecv(self, buf, peer, tag=0):
        self.traffic.received += nbytes(buf)
        return self._post(dist.irecv, buf, peer, tag)

    def _post(self, op, buf, peer, tag):
        if nbytes(buf) == 0:  # gloo rejects empty messages; the peer skips them too
            return Handle(self, _Done(), peer)
        tensor = _as_tensor(buf)
        if tensor.is_cuda:
            # NCCL runs one pair's sends and receives in order on one stream: a
            # receive posted before the matching send on both ranks deadlocks.
            # Held and posted together in one group (batch_isend_irecv ->
            # ncclGroupStart/End), they progress together.
            request = _Batched()
            self._held.append((dist.P2POp(op, tensor, self.global_ranks[peer], self.group, tag),
                               request))
            return Handle(self, request, peer)
        return Handle(self, op(tensor, self.global_ranks[peer], group=self.group, tag=tag), peer)

    def _post_held(self):
        if self._held:
            held, self._held = self._held, []
            works = dist.batch_isend_irecv([op for op, _ in held])
            for _, request in held:
                request.works = works

    def _wait_all(self, handles):
        self._post_held()
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
                    raise TransportTimeout(self.world_rank(self.rank), [peer],
                                           self.timeout) from None
                raise RuntimeError(f"rank {self.world_rank(self.rank)}: torch.distributed failed "
                                   f"talking to rank {peer}: {e}") from None

    def barrier(self):
        work = dist.barrier(group=self.group, async_op=True)
        self._wait_all([Handle(self, work, -1)])

    def split(self, color):
        """A transport over this group's ranks of the same colour, in this group's order."""
        colors = torch.zeros(self.size, dtype=torch.int64)
        colors[self.rank] = color
        self._wait_all([Handle(self, dist.all_reduce(colors, group=self.group, async_op=True),
                               -1)])
        members = [self.global_ranks[r] for r in range(self.size) if colors[r] == color]
        return TorchTransport(group_of(members, self.timeout), self.timeout, self.traffic)

    def world_rank(self, rank):
        return self.global_ranks[rank] if rank >= 0 else rank

    def node_id(self):
        """Equal on ranks that share a host."""
        return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def is_cuda(x):
    return is_tensor(x) and x.device.type == "cuda"
