"""The device mesh: every parallel degree of a run in one validated object, built once.

    mesh = Mesh(world_size=8, dp=2, pp=2, tp=2)     # pure arithmetic, no MPI
    mesh.coords_of(5)      -> (1, 0, 1)              # (dp, pp, tp) of rank 5
    mesh.stage_of(5)       -> 0
    mesh.group_of(5, "dp") -> [1, 5]                 # ranks that differ only in dp
    comms = mesh.split(MPI.COMM_WORLD)               # MeshComms: a communicator per axis
    comms = mesh.split(TorchComm.world())            # the same under torchrun, no MPI
    comms.dp_cp                                      # the replicas: the gradients' axis

The layout is one reshape, as in Megatron-LM and torchtitan's ParallelDims:

    ranks = arange(world).reshape(dp, pp, tp)

    world 8 = dp(2) x pp(2) x tp(2)        pp 0        pp 1
                              dp 0:       [0  1]      [2  3]     <- tp pairs side by side
                              dp 1:       [4  5]      [6  7]

tp is the fastest-varying axis, so a tensor-parallel group (the chattiest: two
all-reduces per layer) holds neighbouring ranks, which a hostfile places on
the same node; pipeline stages talk once per micro-batch; dp replicas once a step.

Expert parallelism borrows its ranks from dp, as torchtitan's ParallelDims does:
the dp ranks are cut into expert groups of ep consecutive ones, each holding every
expert once (the tokens' all-to-alls run inside a group), and the ranks at the same
place of every group hold the same experts (an expert's replicas, over which its
gradient is averaged).  World 4, dp 4, ep 2:

    dp rank        0    1    2    3
    expert group   0    0    1    1        axis "ep":          {0, 1}, {2, 3}
    ep rank        0    1    0    1        axis "ep_replicas": {0, 2}, {1, 3}

Context parallelism borrows its ranks from dp too, as torchtitan's ParallelDims does
(its dp_shard_cp): the first axis of the reshape holds the replicas of the parameters,
dp x cp of them, cut into context groups of cp consecutive ones.  The ranks of a group
see the same samples, each its T / cp of their positions (--cp-order: one contiguous
slice, or the zig-zag pair of chunks, parallel/context_order.py), and hold the same
parameters, so a gradient is averaged over all dp x cp replicas.  World 4, dp 2, cp 2:

    replica          0    1    2    3
    dp rank          0    0    1    1        axis "cp":    {0, 1}, {2, 3}
    cp rank          0    1    0    1        axis "dp":    {0, 2}, {1, 3}
                                             axis "dp_cp": {0, 1, 2, 3}  (the gradients)

    ranks = arange(world).reshape(dp * cp, pp, tp)       replica = dp rank * cp + cp rank

Why carved out of the replicas, not an axis of its own between pp and tp: the grid's
reshape, every (dp, pp, tp) coordinate and every dp x pp x tp run stay as they are,
and the replicas axis is at once ZeRO's and the gradients' group.  The price, stated:
where pp x tp > 1 a context group's ranks are pp x tp apart, so on a hostfile of
nodes tp's groups are filled first and cp's ring may cross nodes sooner than tp's.

With both, the expert groups are cut out of the same dp x cp replicas: ep consecutive
replicas form a group, and an expert's replicas are every ep-th one (its gradient is
averaged over dp x cp / ep of them).  World 4, cp 2, ep 2: the expert groups {0, 1},
{2, 3} are the context groups, the experts' replicas {0, 2}, {1, 3}.  A rank gates and
dispatches its own positions' tokens, so which replicas share a group is free; these
are the consecutive ones, as without cp.

There is no global mesh: build one per test or per run and pass it around.
"""
from dataclasses import dataclass

import numpy as np

from .choices import DEGREES, ConfigError, check_values

AXES = ("dp", "pp", "tp")
CONTEXT_AXES = ("cp", "dp_cp")
EXPERT_AXES = ("ep", "ep_replicas")


def needs_grid(config):
    """Whether a run of these settings (a mapping of TrainConfig's fields: its own, or a
    record's "config") cut the model into layers over a dp x pp x tp grid (engine/
    parallelize.py), not keep it whole on every rank.  Micro-batches alone do not: the
    whole model runs them through the trivial schedule (engine/accumulation.py)."""
    return bool(config.get("dp") or config.get("pp", 1) > 1 or config.get("tp", 1) > 1 or
                config.get("zero"))


@dataclass(frozen=True)
class Mesh:
    world_size: int
    dp: int = 0          # 0: whatever is left, world / (pp * tp)
    pp: int = 1
    tp: int = 1
    ep: int = 1          # expert groups of ep replicas (carved out of dp x cp)
    cp: int = 1          # context groups of cp replicas (carved out of dp x cp)

    def __post_init__(self):
        check_values(self, at_least=DEGREES)          # the flags' own rule
        cp = f"cp({self.cp}) x " if self.cp > 1 else ""
        if self.dp == 0:
            rest = self.cp * self.pp * self.tp
            if self.world_size % rest:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by {cp}pp({self.pp}) x "
                    f"tp({self.tp}) = {rest}: no whole dp size is left", field="world_size")
            object.__setattr__(self, "dp", self.world_size // rest)
        if self.dp * self.cp * self.pp * self.tp != self.world_size:
            raise ConfigError(f"dp({self.dp}) x {cp}pp({self.pp}) x tp({self.tp}) = "
                              f"{self.dp * self.cp * self.pp * self.tp} != world size "
                              f"{self.world_size}", field="world_size")
        replicas = self.dp * self.cp
        if replicas % self.ep:
            of = f"dp({self.dp}) x cp({self.cp}) = {replicas}" if self.cp > 1 else \
                f"dp({self.dp})"
            raise ConfigError(f"world {self.world_size} is not a multiple of ep({self.ep}): "
                              f"the expert groups are cut out of {of}, "
                              f"{replicas} % {self.ep} = {replicas % self.ep}", field="ep")

    @property
    def dp_enabled(self):
        return self.dp > 1

    @property
    def pp_enabled(self):
        return self.pp > 1

    @property
    def tp_enabled(self):
        return self.tp > 1

    @property
    def ep_enabled(self):
        return self.ep > 1

    @property
    def cp_enabled(self):
        return self.cp > 1

    @property
    def ranks(self):
        """The grid, replicas first: ranks[replica, pp, tp] (replica = dp x cp + cp rank)."""
        return np.arange(self.world_size).reshape(self.dp * self.cp, self.pp, self.tp)

    def place_of(self, rank):
        """(replica, pp, tp) of a rank: its index in `ranks`."""
        return tuple(int(c) for c in
                     np.unravel_index(rank, (self.dp * self.cp, self.pp, self.tp)))

    def coords_of(self, rank):
        """(dp, pp, tp) coordinates of a rank (the dp of its context group)."""
        replica, p, t = self.place_of(rank)
        return replica // self.cp, p, t

    def context_coords_of(self, rank):
        """(dp rank, cp rank) of a rank: its replica cut into groups of cp."""
        return divmod(self.place_of(rank)[0], self.cp)

    def rank_of(self, dp=0, pp=0, tp=0, cp=0):
        return int(self.ranks[dp * self.cp + cp, pp, tp])

    def stage_of(self, rank):
        return self.coords_of(rank)[1]

    def expert_coords_of(self, rank):
        """(expert group, ep rank) of a rank: its replica (dp rank x cp + cp rank) cut
        into groups of ep."""
        return divmod(self.place_of(rank)[0], self.ep)

    def group_of(self, rank, axis):
        """The ranks that share every coordinate with `rank` except `axis`, in axis order;
        "ep": its expert group, "ep_replicas": the ranks holding its experts; "cp": its
        context group, "dp_cp": every replica of its parameters (dp x cp)."""
        replica, p, t = self.place_of(rank)
        d, c = self.context_coords_of(rank)
        if axis in CONTEXT_AXES:
            replicas = range(d * self.cp, (d + 1) * self.cp) if axis == "cp" else \
                range(self.dp * self.cp)
        elif axis in EXPERT_AXES:
            group, place = divmod(replica, self.ep)
            replicas = range(group * self.ep, (group + 1) * self.ep) if axis == "ep" else \
                range(place, self.dp * self.cp, self.ep)
        else:
            index = {"dp": (slice(c, None, self.cp), p, t), "pp": (replica, slice(None), t),
                     "tp": (replica, p, slice(None))}
            return [int(r) for r in self.ranks[index[axis]]]
        return [int(self.ranks[r, p, t]) for r in replicas]

    def describe(self):
        ep = f", ep({self.ep}) of dp" + (" x cp" if self.cp_enabled else "") \
            if self.ep_enabled else ""
        cp = f" x cp({self.cp})" if self.cp_enabled else ""
        return f"dp({self.dp}){cp} x pp({self.pp}) x tp({self.tp}) = {self.world_size}{ep}"

    def split(self, comm):
        """Sub-communicators of `comm` (collective: every rank calls it)."""
        if comm.size != self.world_size:
            raise ConfigError(f"{self.describe()} but the communicator has {comm.size} ranks",
                              field="world_size")
        return MeshComms(self, comm)


class MeshComms:
    """This rank's place in the mesh and one communicator per axis: mpi4py's, or under
    torchrun allreduce/torch_comm.py's TorchComm, a torch process group per axis, which
    makes the same Split (and which every user of an axis takes as it takes MPI's).

    The colour of a split is the lowest rank of the group (the same for every member),
    the key its place in the group, so rank i of `comms.pp` is stage i."""

    def __init__(self, mesh, comm):
        self.mesh, self.world = mesh, comm
        self.rank = comm.rank
        self.dp_rank, self.pp_rank, self.tp_rank = mesh.coords_of(comm.rank)
        self.expert_group, self.ep_rank = mesh.expert_coords_of(comm.rank)
        self.cp_rank = mesh.context_coords_of(comm.rank)[1]
        self.axes = AXES + CONTEXT_AXES + EXPERT_AXES
        for axis in self.axes:
            group = mesh.group_of(comm.rank, axis)
            setattr(self, axis, comm.Split(group[0], group.index(comm.rank)))
        self.dp_size, self.pp_size, self.tp_size = mesh.dp, mesh.pp, mesh.tp
        self.ep_size, self.cp_size = mesh.ep, mesh.cp

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp_size - 1

    def free(self):
        for axis in self.axes:
            getattr(self, axis).Free()
