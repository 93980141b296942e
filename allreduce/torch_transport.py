"""Point-to-point over torch.distributed: gloo for CPU tensors, NCCL for CUDA tensors.

torch.distributed's world is always the whole launch: torchrun's ranks, or
MPI.COMM_WORLD under mpiexec (world rank i is torch rank i).  Under torchrun the
usual environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) initialises the
process group.  Under mpiexec there is no such environment, so rank 0 picks a
free port and tells the others over MPI: every rank of the launch makes the
first torch transport, as every rank makes each over part of the world.

A transport over part of the world runs on a process group of its own:

    make_transport("torch")                   the whole world (the default group)
    make_transport("torch", comm)             an mpi4py communicator's ranks, in its rank order
    make_transport("torch", [4, 6, 5])        these global ranks, in this order (torchrun
                                              without MPI: each rank passes its own group's list)
    make_transport("torch", process_group)    a torch ProcessGroup made elsewhere, as it is

How groups are made (`make_groups`).  torch's `new_group` must be entered by
every rank of the world, for every group, in the same order, members or not.
So making the transport of a communicator is collective over the whole launch,
as the communicators of a split are made together: every rank gathers every
rank's member list over the world (gloo) and makes each distinct group, sorted,
keeping it by its member tuple.  (`new_group(use_local_synchronization=True)`,
entered by the members only, names a group after its ranks and the number of
groups the process already has, which differs from member to member when they
belong to different earlier groups: its rendezvous then never meets.)

A transport split from another (`split`, as the hierarchical all-reduce does
on its own ranks, whatever the rest of the world does) cannot make a group of
its own.  It needs none: its messages travel on its parent's group, between
global ranks, and its colours and barrier are exchanged with messages too.  It
shares the parent's channel, so the two are used one after the other (as the
hierarchical all-reduce does), not from two threads; the torch baseline's
collectives need a transport with a group of its own.
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

from .buffers import as_bytes, nbytes
from .errors import TransportError, TransportTimeout
from .transport import Handle, MPITransport, Transport, default_timeout


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


SPLIT_TAG = 7927     # the colours of a split and a split's barrier (allreduce.check: 7919)
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


# member tuple (global ranks, in group-rank order) -> ProcessGroup: every rank
# makes every group, so every rank holds the same keys (torch keeps them too)
_groups = {}


def make_groups(members, timeout=None):
    """The process group of `members` (global ranks; group rank i is members[i]),
    None for the whole world in order.  Collective over the world: every rank
    passes its own group's list, and every distinct group is made."""
    world, me = dist.get_world_size(), dist.get_rank()
    seconds = default_timeout() if timeout is None else float(timeout)
    members = [int(r) for r in members]
    row = torch.full((world + 1,), -1, dtype=torch.int64)    # [count, ranks..., -1 ...]
    row[0] = len(members)
    row[1:1 + min(len(members), world)] = torch.tensor(members[:world], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(world)]
    try:
        dist.all_gather(rows, row, async_op=True).wait(timeout=timedelta(seconds=seconds))
    except RuntimeError as e:
        raise TransportError(
            f"rank {me}: a torch transport over part of the world is made by all {world} "
            f"ranks of the launch together; not all came within {seconds:g} s ({e})") from None
    lists = [tuple(row[1:1 + int(row[0])].tolist()) for row in rows]
    for rank, (ranks, row) in enumerate(zip(lists, rows)):    # the same answer on every rank
        if int(row[0]) > world or rank not in ranks or len(set(ranks)) != len(ranks) or \
                not all(0 <= r < world for r in ranks):
            raise TransportError(f"rank {rank} asked for a torch group of ranks {list(ranks)}: "
                                  f"a group is distinct ranks of the world (0..{world - 1}), "
                                  f"its own among them")
    for ranks in sorted(set(lists) - {tuple(range(world))}):
        if ranks not in _groups:
            options = {}
            if list(ranks) != sorted(ranks):        # keep the communicator's rank order
                if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
                    raise TransportError(
                        f"ranks {list(ranks)} are not in world order, and this torch "
                        f"({torch.__version__}) sorts a group's ranks: split with key=world rank")
                options["sort_ranks"] = False
            _groups[ranks] = dist.new_group(list(ranks), timeout=timedelta(seconds=seconds),
                                            **options)
    return _groups.get(lists[me])


def group_for(where=None, timeout=None):
    """The process group of `where`: None (the world), an mpi4py communicator, a
    list of global ranks or a ProcessGroup (see the module docstring)."""
    if where is None or isinstance(where, dist.ProcessGroup):
        return where
    if isinstance(where, (list, tuple, range)):
        return make_groups(where, timeout)
    from mpi4py import MPI
    if not isinstance(where, MPI.Comm):
        raise TransportError(f"a torch transport runs over None, an mpi4py communicator, a "
                              f"list of ranks or a ProcessGroup, not {type(where).__name__}")
    # The communicator's ranks in COMM_WORLD (= torch's ranks), in its own rank order.
    members = MPI.Group.Translate_ranks(where.Get_group(), list(range(where.size)),
                                        MPI.COMM_WORLD.Get_group())
    return make_groups(members, timeout)


def _as_tensor(buf):
    """The bytes of buf as a uint8 tensor, sharing memory."""
    b = as_bytes(buf)
    return torch.from_numpy(b) if isinstance(b, np.ndarray) else b


class _Done:
    def wait(self, timeout=None):
        return True


class _Batch:
    """Held sends and receives, posted together (`TorchTransport.holds`).  Waiting
    for one of them waits for the whole batch, once: gloo's receive, waited for a
    second time, waits for another message."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        while self.works:
            self.works[0].wait(timeout=timeout)
            self.works.pop(0)
        return True


class _Held:
    """The request of a held message: its batch, once posted."""
    batch = None

    def wait(self, timeout=None):
        return self.batch.wait(timeout)


class TorchTransport(Transport):
    """torch.distributed point-to-point among `members` (global ranks, in rank
    order; default: the group's own), over a process group (None: the world)."""

    def __init__(self, group=None, timeout=None, traffic=None, members=None):
        super().__init__(timeout, traffic)
        self.group = group
        if group is not None and dist.get_rank(group) < 0:
            raise TransportError(f"rank {dist.get_rank()} is not a member of the process "
                                  f"group it was given")
        group_ranks = [dist.get_global_rank(group, r) if group is not None else r
                       for r in range(dist.get_world_size(group))]
        self.global_ranks = group_ranks if members is None else [int(r) for r in members]
        self.own_group = self.global_ranks == group_ranks    # False for a split: see above
        self.rank = self.global_ranks.index(dist.get_rank())
        self.size = len(self.global_ranks)
        # NCCL moves CUDA tensors; with gloo alone they must travel through host memory.
        self.takes_cuda = "nccl" in str(dist.get_backend(group)).lower()
        self._held = []
        if self.takes_cuda and self.own_group:
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
        if self.holds(tensor):
            request = _Held()
            self._held.append((dist.P2POp(op, tensor, self.global_ranks[peer], self.group, tag),
                               request))
            return Handle(self, request, peer)
        return Handle(self, op(tensor, self.global_ranks[peer], group=self.group, tag=tag), peer)

    def holds(self, tensor):
        """Whether a message waits for the next wait, to be posted with the others
        held by then in one batch.  CUDA ones do: NCCL runs one pair's sends and
        receives in order on one stream, so a receive posted before the matching
        send on both ranks deadlocks; posted together in one group
        (batch_isend_irecv -> ncclGroupStart/End), they progress together."""
        return tensor.is_cuda

    def _post_held(self):
        if self._held:
            held, self._held = self._held, []
            batch = _Batch(dist.batch_isend_irecv([op for op, _ in held]))
            for _, request in held:
                request.batch = batch

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
                raise TransportError(f"rank {self.world_rank(self.rank)}: torch.distributed failed "
                                   f"talking to rank {peer}: {e}") from None

    def barrier(self):
        if not self.own_group:
            self._allgather_int(0)
            return
        work = dist.barrier(group=self.group, async_op=True)
        self._wait_all([Handle(self, work, -1)])

    def split(self, color):
        """A transport over this transport's ranks of the same colour, in this order,
        on the same group (see the module docstring): only these ranks call it."""
        colors = self._allgather_int(color)
        members = [self.global_ranks[r] for r in range(self.size) if colors[r] == color]
        return type(self)(self.group, self.timeout, self.traffic, members)

    def _allgather_int(self, value):
        """Every rank's `value`, by messages (rank 0 gathers, then tells everyone), so
        that it works among any members of a group; the bytes are not counted."""
        table = np.zeros(self.size, dtype=np.int64)
        table[self.rank] = value
        before = self.traffic.sent, self.traffic.received
        if self.rank == 0:
            self.wait_all([self.irecv(table[r:r + 1], r, SPLIT_TAG) for r in range(1, self.size)])
            self.wait_all([self.isend(table, r, SPLIT_TAG) for r in range(1, self.size)])
        else:
            self.send(table[self.rank:self.rank + 1], 0, SPLIT_TAG)
            self.recv(table, 0, SPLIT_TAG)
        self.traffic.sent, self.traffic.received = before
        return table.tolist()

    def world_rank(self, rank):
        return self.global_ranks[rank] if rank >= 0 else rank

    def node_id(self):
        """Equal on ranks that share a host."""
        return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
