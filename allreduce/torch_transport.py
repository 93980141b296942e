"""Point-to-point over torch.distributed: gloo for CPU tensors, NCCL for CUDA tensors.

torch.distributed's world is the whole launch, started once (torch_world.py).
A transport over part of the world runs on a process group of its own:

    make_transport("torch")                   the whole world (the default group)
    make_transport("torch", comm)             an mpi4py communicator's ranks, in its rank order
    make_transport("torch", [4, 6, 5])        these global ranks, in this order (torchrun
                                              without MPI: each rank passes its own group's list)
    make_transport("torch", process_group)    a torch ProcessGroup made elsewhere, as it is
    make_transport(comm=torch_comm)           a TorchComm's group (torchrun's mesh axes:
                                              torch_comm.py)

How groups are made (`make_groups`).  torch's `new_group` must be entered by
every rank of the world, for every group, in the same order, members or not.
So making the transport of a communicator is collective over the whole launch,
as the communicators of a split are made together: every rank gathers every
rank's member list over the world (gloo) and makes each distinct group, sorted,
keeping it by its member tuple and its channel: two communicators of the same ranks
get two groups (channel_of), as MPI keeps their messages apart, so a comm thread
on a duplicate never meets the main thread in one group.  (`new_group(use_local_synchronization=True)`,
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
import inspect
import socket
import time
import zlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .buffers import as_bytes, nbytes
from .errors import TransportError, TransportTimeout
from .transport import Handle, Transport, default_timeout

SPLIT_TAG = 7927     # the colours of a split and a split's barrier (allreduce.check: 7919)


# member tuple (global ranks, in group-rank order) -> ProcessGroup: every rank
# makes every group, so every rank holds the same keys (torch keeps them too)
_groups = {}


def make_groups(members, timeout=None, channel=0):
    """The process group of `members` (global ranks; group rank i is members[i]) on
    `channel` (the how-manieth communicator of these ranks it is: channel_of); None for
    the whole world in order on channel 0.  Collective over the world: every rank
    passes its own group's list, and every distinct group is made."""
    world, me = dist.get_world_size(), dist.get_rank()
    seconds = default_timeout() if timeout is None else float(timeout)
    members = [int(r) for r in members]
    row = torch.full((world + 2,), -1, dtype=torch.int64)    # [count, channel, ranks..., -1]
    row[0], row[1] = len(members), int(channel)
    row[2:2 + min(len(members), world)] = torch.tensor(members[:world], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(world)]
    try:
        dist.all_gather(rows, row, async_op=True).wait(timeout=timedelta(seconds=seconds))
    except RuntimeError as e:
        raise TransportError(
            f"rank {me}: a torch transport over part of the world is made by all {world} "
            f"ranks of the launch together; not all came within {seconds:g} s ({e})") from None
    lists = [(tuple(row[2:2 + int(row[0])].tolist()), int(row[1])) for row in rows]
    for rank, ((ranks, _), row) in enumerate(zip(lists, rows)):  # the same answer everywhere
        if int(row[0]) > world or rank not in ranks or len(set(ranks)) != len(ranks) or \
                not all(0 <= r < world for r in ranks):
            raise TransportError(f"rank {rank} asked for a torch group of ranks {list(ranks)}: "
                                  f"a group is distinct ranks of the world (0..{world - 1}), "
                                  f"its own among them")
    for ranks, chan in sorted(set(lists) - {(tuple(range(world)), 0)}):
        if (ranks, chan) not in _groups:
            options = {}
            if list(ranks) != sorted(ranks):        # keep the communicator's rank order
                if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
                    raise TransportError(
                        f"ranks {list(ranks)} are not in world order, and this torch "
                        f"({torch.__version__}) sorts a group's ranks: split with key=world rank")
                options["sort_ranks"] = False
            _groups[ranks, chan] = dist.new_group(list(ranks), timeout=timedelta(seconds=seconds),
                                                  **options)
    return _groups.get(lists[me])


_made = {}           # member tuple -> how many communicators of those ranks have a channel
_keyval = []         # the MPI attribute that caches a communicator's channel on it


def channel_of(comm, members):
    """The channel of an mpi4py communicator: 0 for the first communicator of these
    ranks, 1 for the next (a Dup for the comm thread, or another axis of the same
    ranks), ...  MPI keeps two communicators' messages apart; so does this, with a
    torch group each, where one group would have two threads' collectives meet in it
    out of order.  Cached on the communicator (an MPI attribute, which a Dup does not
    copy), so one communicator always gets the same group.  Every member counts alike:
    a communicator is made by all its members together, and so is its transport."""
    from mpi4py import MPI
    if not _keyval:
        _keyval.append(MPI.Comm.Create_keyval())
    channel = comm.Get_attr(_keyval[0])
    if channel is None:
        channel = next_channel(members)
        comm.Set_attr(_keyval[0], channel)
    return channel


def next_channel(members):
    """The channel of a new communicator of `members` (a tuple of global ranks): how many
    communicators of those ranks had one before it, mpi4py's (channel_of) or torchrun's
    (torch_comm.py)."""
    channel = _made.get(members, 0)
    _made[members] = channel + 1
    return channel


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
    members = tuple(MPI.Group.Translate_ranks(where.Get_group(), list(range(where.size)),
                                              MPI.COMM_WORLD.Get_group()))
    return make_groups(members, timeout, channel_of(where, members))


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
