"""The dp x pp x tp process grid: who is which stage, which tensor shard, which replica.

    grid = ProcessGrid(world_size=8, dp=2, pp=2, tp=2)     # pure arithmetic, no MPI
    grid.coords_of(5)      -> (1, 0, 1)                    # (dp, pp, tp) of rank 5
    grid.stage_of(5)       -> 0
    grid.group_of(5, "dp") -> [1, 5]                       # ranks that differ only in dp
    comms = grid.split(MPI.COMM_WORLD)                     # GridComms: dp, pp, tp communicators

The layout is one reshape, as in Megatron-LM and torchtitan's ParallelDims:

    ranks = arange(world).reshape(dp, pp, tp)

    world 8 = dp(2) x pp(2) x tp(2)        pp 0        pp 1
                              dp 0:       [0  1]      [2  3]     <- tp pairs side by side
                              dp 1:       [4  5]      [6  7]

tp is the fastest-varying axis, so a tensor-parallel group (the chattiest: two
all-reduces per layer) holds neighbouring ranks, which a hostfile places on
the same node; pipeline stages talk once per micro-batch; dp replicas once a step.

There is no global grid: build one per test or per run and pass it around.
"""
from dataclasses import dataclass

import numpy as np

from .choices import ConfigError

AXES = ("dp", "pp", "tp")


def needs_grid(config):
    """Whether a run of these settings (a mapping of TrainConfig's fields: its own, or a
    record's "config") needs the dp x pp x tp worker (parallel.py), not the plain loop."""
    return bool(config.get("dp") or config.get("pp", 1) > 1 or config.get("tp", 1) > 1 or
                config.get("zero") or config.get("micro_batches", 1) > 1)


@dataclass(frozen=True)
class ProcessGrid:
    world_size: int
    dp: int = 0          # 0: whatever is left, world / (pp * tp)
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in ("pp", "tp"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"--{axis} must be >= 1, got {getattr(self, axis)}")
        if self.dp < 0:
            raise ConfigError(f"--dp must be >= 0 (0: what is left), got {self.dp}")
        if self.dp == 0:
            if self.world_size % (self.pp * self.tp):
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by pp({self.pp}) x "
                    f"tp({self.tp}) = {self.pp * self.tp}: no whole dp size is left")
            object.__setattr__(self, "dp", self.world_size // (self.pp * self.tp))
        if self.dp * self.pp * self.tp != self.world_size:
            raise ConfigError(f"dp({self.dp}) x pp({self.pp}) x tp({self.tp}) = "
                              f"{self.dp * self.pp * self.tp} != world size {self.world_size}")

    @property
    def ranks(self):
        return np.arange(self.world_size).reshape(self.dp, self.pp, self.tp)

    def coords_of(self, rank):
        """(dp, pp, tp) coordinates of a rank."""
        return tuple(int(c) for c in np.unravel_index(rank, (self.dp, self.pp, self.tp)))

    def rank_of(self, dp=0, pp=0, tp=0):
        return int(self.ranks[dp, pp, tp])

    def stage_of(self, rank):
        return self.coords_of(rank)[1]

    def group_of(self, rank, axis):
        """The ranks that share every coordinate with `rank` except `axis`, in axis order."""
        d, p, t = self.coords_of(rank)
        index = {"dp": (slice(None), p, t), "pp": (d, slice(None), t), "tp": (d, p, slice(None))}
        return [int(r) for r in self.ranks[index[axis]]]

    def describe(self):
        return f"dp({self.dp}) x pp({self.pp}) x tp({self.tp}) = {self.world_size}"

    def split(self, comm):
        """Sub-communicators of `comm` (collective: every rank calls it)."""
        if comm.size != self.world_size:
            raise ConfigError(f"{self.describe()} but the communicator has {comm.size} ranks")
        return GridComms(self, comm)


class GridComms:
    """This rank's place in the grid and one mpi4py communicator per axis.

    The colour of a split is the rank's coordinates on the other two axes, the
    key its coordinate on this axis, so rank i of `comms.pp` is stage i."""

    def __init__(self, grid, comm):
        self.grid, self.world = grid, comm
        self.rank = comm.rank
        self.dp_rank, self.pp_rank, self.tp_rank = grid.coords_of(comm.rank)
        coords = {"dp": self.dp_rank, "pp": self.pp_rank, "tp": self.tp_rank}
        for axis in AXES:
            others = [coords[a] for a in AXES if a != axis]
            color = others[0] * grid.world_size + others[1]
            setattr(self, axis, comm.Split(color, coords[axis]))
        self.dp_size, self.pp_size, self.tp_size = grid.dp, grid.pp, grid.tp

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp_size - 1

    def free(self):
        for axis in AXES:
            getattr(self, axis).Free()
