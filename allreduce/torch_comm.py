"""A communicator over torch.distributed: the few calls of mpi4py's that a mesh and its
users make, for torchrun launches, which start no MPI world.

    world = TorchComm.world()        the launch (torch's default process group)
    tp = world.Split(color, key)     the ranks of one colour, in key order, on a process
                                     group of their own (collective over the whole world)
    tp.Dup()                         the same ranks on another group (a comm thread's)
    tp.rank, tp.size                 this rank's place, as mpi4py's
    tp.members                       the global ranks, in this communicator's rank order
    tp.allgather(obj), tp.gather(obj, root), tp.barrier()    small Python objects
    make_transport(comm=tp)          point-to-point over its group (torch_transport.py),
    allreduce.create(name, comm=tp)  and so every collective of allreduce/ over it

The mesh (strategies/config/mesh.py) splits a communicator into one per axis and hands
each axis to allreduce/'s transports and collectives and to its control messages; with a
TorchComm world the same code makes torch process groups instead of MPI communicators.
The textbook algorithms run unchanged: they see a TorchTransport.

Why Split and Dup are collective over the whole world, not over the parent's ranks as
MPI's are: torch's new_group must be entered by every rank of the world, for every group,
in the same order (torch_transport.make_groups).  A mesh's axes are split from the world
by every rank in the same order, and its users duplicate an axis on every rank at the
same point (the data-parallel sync's comm thread), so this costs nothing there.  As
with MPI, each communicator of the same ranks gets a group of its own (a channel:
torch_transport.next_channel), so two of them never mix their messages.
"""
import torch.distributed as dist

from .torch_transport import make_groups, next_channel


class TorchComm:
    def __init__(self, members, timeout=None):
        """The communicator of `members` (global ranks, in rank order) on a process group of
        its own: collective over the world (make_groups)."""
        self.members, self.timeout = tuple(int(r) for r in members), timeout
        self.group = make_groups(self.members, timeout, next_channel(self.members))
        self.rank, self.size = self.members.index(dist.get_rank()), len(self.members)

    @classmethod
    def world(cls, timeout=None):
        """The whole launch: the first communicator of all ranks is torch's default group."""
        return cls(range(dist.get_world_size()), timeout)

    def Split(self, color, key=0):
        """The ranks of this communicator with the same `color`, ordered by `key` (ties by
        their rank here), as MPI_Comm_split; collective over the world (module docstring)."""
        table = self.allgather((color, key))
        mine = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        return TorchComm([self.members[r] for _, r in mine], self.timeout)

    def Dup(self):
        return TorchComm(self.members, self.timeout)

    def Free(self):
        """Nothing to do: a process group lives until the world is torn down
        (torch_world.destroy_at_exit), and destroying one is collective again."""

    def allgather(self, obj):
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj, root=0):
        """Every rank's `obj` on `root` (None elsewhere): an allgather, whose extra copies
        are a control message's few bytes."""
        everyone = self.allgather(obj)
        return everyone if self.rank == root else None

    def barrier(self):
        dist.barrier(group=self.group)

    def __repr__(self):
        return f"TorchComm(ranks {list(self.members)}, rank {self.rank})"
