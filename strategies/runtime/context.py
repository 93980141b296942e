"""Who this process is in the run: the explicit context passed to whoever needs it.

    ctx = RunContext.create(cfg)         # collective: every rank calls it
    ctx.rank, ctx.world_size              # in the whole launch
    ctx.is_server                         # ps / hybrid: a server, as psrv.launch decided
    ctx.mesh                              # mesh.MeshComms over the workers: a communicator
                                          #   per axis of dp x cp x pp x tp and ep (mpi4py's,
                                          #   or under torchrun a TorchComm); None on a server
    ctx.dp_rank, ctx.dp_size              # this worker's place on the mesh's dp axis
    ctx.workers                           # control over every rank that trains (records)
    ctx.control.allgather(obj)            # small control messages (errors, metrics)

There is no global state: two contexts could live in one test.  Every worker's run is
a mesh run, plain data parallelism included (dp = the workers); the servers of ps and
hybrid are a role beside the mesh, not a kind of run.  The mesh is built once, here,
and read everywhere: the context keeps no copy of its axes.

Under torchrun there is no MPI: the world is a TorchComm (allreduce/torch_comm.py),
which the mesh splits into one torch process group per axis as it splits MPI's world
into communicators; the grid's transports and collectives take either.

Control messages (a preflight error, a step's loss, metric records) are small
Python objects, so they go through mpi4py's pickling calls or, under torchrun,
torch.distributed's object collectives (the TorchComm's own); gradients never do.
"""
import os
import socket
import sys
import time
from dataclasses import dataclass

from allreduce.gpus import nccl_sharing_problem, shared_gpu
from allreduce.torch_comm import TorchComm
from allreduce.torch_world import init_torch_distributed, torchrun_world

from ..config.choices import PS_SYNCS, ConfigError
from ..config.mesh import Mesh
from ..config.settings import check_checkpoint_dir
from ..config.validate import check_launcher, check_world
from . import checkpoint


class MPIControl:
    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def barrier(self):
        """Wait for every rank, polling a non-blocking barrier: a rank waiting here still
        runs its Python signal handlers, which a blocking MPI call holds back until it
        returns (the workers' stop on a signal needs them: stopping.py)."""
        request = self.comm.Ibarrier()
        while not request.Test():
            time.sleep(0.001)


def control_of(comm):
    """Control messages over a communicator: MPIControl over mpi4py's; a TorchComm
    (torchrun) makes the same calls itself, over torch.distributed."""
    return comm if isinstance(comm, TorchComm) else MPIControl(comm)


def mesh_of(cfg, workers):
    """The mesh's communicators over `workers` (collective): plain data parallelism is
    dp = all of them."""
    return Mesh(workers.size, cfg.dp if cfg.on_grid else 0, cfg.pp, cfg.tp, cfg.ep,
                cfg.cp).split(workers)


@dataclass
class RunContext:
    rank: int
    world_size: int
    local_rank: int          # index among the ranks on this host (picks the GPU)
    local_size: int
    is_server: bool
    comm: object             # mpi4py communicator of the whole launch (None under torchrun)
    control: object          # control messages over the whole launch (control_of)
    workers: object = None   # ... over the ranks that train (all but the servers)
    role: object = None      # psrv.launch's Role (ps, hybrid)
    host: str = ""
    mesh: object = None      # mesh.MeshComms over the workers (None: a server)
    host_visible_gpus: list = None   # --sync torch on CUDA: each local rank's
                                     #   CUDA_VISIBLE_DEVICES (None: unset), in local order

    @property
    def dp_rank(self):
        """This worker's coordinate on the dp axis."""
        return self.mesh.dp_rank if self.mesh else self.rank

    @property
    def dp_size(self):
        return self.mesh.dp_size if self.mesh else self.world_size

    @classmethod
    def create(cls, cfg):
        """Build the context.  Raises ConfigError for a world that does not fit cfg;
        every rank computes the same answer from the same numbers."""
        host = socket.gethostname()
        if torchrun_world():
            return cls._from_torchrun(cfg, host)
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        check_world(cfg, comm.size)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        local_rank, local_size = local.rank, local.size
        visible = local.allgather(os.environ.get("CUDA_VISIBLE_DEVICES")) \
            if cfg.device == "cuda" and cfg.sync == "torch" else None
        local.Free()
        control = MPIControl(comm)
        role, workers = None, comm
        if cfg.sync in PS_SYNCS:          # psrv.launch decides who serves; we ask it
            # the servers wait for the workers' keys while the workers build their
            # engine (parallelize): within --timeout, and never less than a minute
            role = ps_role(comm, cfg.servers, max(cfg.timeout, KEYS_WAIT_S),
                           **ps_checkpoint_options(cfg, comm))
            workers = role.worker_comm            # None on a server
            if role.is_server:                    # a role beside the mesh's workers
                return cls(comm.rank, comm.size, local_rank, local_size, True, comm,
                           control, None, role=role, host=host, host_visible_gpus=visible)
        # every worker is on a mesh over the workers
        mesh = mesh_of(cfg, workers)
        return cls(comm.rank, comm.size, local_rank, local_size, False, comm, control,
                   MPIControl(workers) if role else control, role=role, host=host,
                   mesh=mesh, host_visible_gpus=visible)

    @classmethod
    def _from_torchrun(cls, cfg, host):
        """Every rank trains, on a mesh of torch process groups (TorchComm)."""
        check_launcher(cfg, torchrun=True)
        init_torch_distributed()
        world = TorchComm.world(cfg.timeout)
        check_world(cfg, world.size)
        return cls(world.rank, world.size, int(os.environ.get("LOCAL_RANK", 0)),
                   int(os.environ.get("LOCAL_WORLD_SIZE", 1)), False, None, world, world,
                   host=host, mesh=mesh_of(cfg, world))

    def set_threads(self, cfg):
        """torch's CPU threads: --threads, else this host's cores shared by its ranks."""
        import torch
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // self.local_size))

    def device(self, cfg):
        import torch
        if cfg.device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("--device cuda but torch sees no GPU", field="device")
            gpus = torch.cuda.device_count()
            if cfg.sync == "torch":                # torchrun gives its local ranks one env
                visible = self.host_visible_gpus or \
                    [os.environ.get("CUDA_VISIBLE_DEVICES")] * self.local_size
                problem = nccl_gpu_conflict(self.host, gpus, visible)
                if problem:
                    raise ConfigError(problem)
            device = torch.device("cuda", self.local_rank % gpus)
            torch.cuda.set_device(device)          # NCCL and pinned copies use the current GPU
            return device
        return torch.device("cpu")


def nccl_gpu_conflict(host, gpus, visible):
    """Why NCCL cannot run the ranks of this host, or None.

    NCCL (--sync torch on CUDA) needs a GPU of its own per rank, and without one fails
    only at its first collective, mid-run; allreduce.gpus decides which local ranks
    would share one (`visible[i]`: local rank i's CUDA_VISIBLE_DEVICES).  The MPI syncs
    stage CUDA tensors through host memory, so their ranks may share a GPU."""
    problem = nccl_sharing_problem(host, gpus, visible)
    if problem is None:
        return None
    taken = shared_gpu(gpus, visible)[2]
    return (f"--sync torch --device cuda: {problem} and would fail at its first call.  "
            f"Start at most {taken} ranks per host, or use an MPI --sync (ring, tree, "
            f"halving_doubling, hierarchical, mpi): it stages CUDA tensors through host "
            f"memory, and ranks may share a GPU")


# The least a server of --sync ps / hybrid waits for the workers to declare their keys
# (ps_role): their engine's construction, with no collective a --timeout would bound.
KEYS_WAIT_S = 60.0


def ps_checkpoint_options(cfg, comm):
    """With --checkpoint-dir the servers save their shards (parameters and optimizer
    state) under DIR/ps when the workers ask, as parts of a checkpoint set
    (checkpoint/resume.py); a signal makes them serve on until the workers have written the
    set of the step they stop at ("drain").  --resume: rank 0 (a worker) picks the set,
    every rank says so if it is not the newest on disk, and every server loads its part
    (collective over `comm`; every rank raises the same ConfigError if there is none)."""
    if not cfg.checkpoint_dir:
        return {}
    check_checkpoint_dir(cfg)
    ps_dir = checkpoint.ps_folder(cfg)
    os.makedirs(ps_dir, mode=0o700, exist_ok=True)     # psrv does not make it
    options = {"checkpoint_dir": ps_dir, "on_signal": "drain"}
    if not cfg.resume:
        return options
    found = None
    if comm.rank == 0:
        try:
            found = (*checkpoint.ps_set_to_resume(cfg), None)
        except ConfigError as e:
            found = (None, "", str(e))
    step, note, problem = comm.bcast(found)
    if problem:
        raise ConfigError(problem, field="resume")
    if note:                                   # one write, so that ranks do not interleave
        sys.stderr.write(f"strategies.train rank {comm.rank}: note: {note}\n")
        sys.stderr.flush()
    return {**options, "resume": True, "resume_step": step}


def ps_role(comm, servers, keys_timeout, **server_options):
    """psrv.launch's Role of this rank over `comm` (collective): psrv decides which ranks
    serve, everyone here asks it.  Servers listen on loopback when every rank shares
    this host, else on all interfaces (where psrv authenticates workers by CURVE keys).
    The servers bind once the workers have cut their buckets (await_keys: the buckets
    are the keys, sync/server_buckets.py declares them), so that each shard queues one
    step's messages of a worker; they wait keys_timeout seconds for that.  A server that
    cannot start is a ConfigError on every rank, naming it."""
    psrv = require_psrv()
    one_host = len(set(comm.allgather(socket.gethostname()))) == 1
    try:
        return psrv.launch.mpi_roles(comm, num_servers=servers,
                                     bind_host="127.0.0.1" if one_host else "0.0.0.0",
                                     await_keys=True, keys_timeout=keys_timeout,
                                     **server_options)
    except psrv.PSError as e:
        raise ConfigError(str(e), field="servers") from None


def require_psrv():
    """The parameter-server package, or a clear error if it cannot be imported."""
    try:
        import psrv
        import psrv.launch
        psrv.Client, psrv.launch.mpi_roles, psrv.Consistency, psrv.OptimizerConfig  # noqa: B018
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--sync ps / hybrid: cannot import the psrv package ({e})",
                          field="sync") from None
    return psrv
