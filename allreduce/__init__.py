"""Collectives written once as textbook algorithms over a point-to-point transport.

    import allreduce
    coll = allreduce.create("ring")          # over MPI.COMM_WORLD
    coll.allreduce(x)                        # in place, sum; numpy array or torch tensor
    coll.allreduce(x, op="avg")              # also "max", "min"
    shard = coll.reduce_scatter(x)           # this rank's shard (allreduce.shard_bounds)
    whole = coll.allgather(shard)            # shards of all ranks, in rank order
    coll.broadcast(x, root=0)                # in place
    allreduce.create("hierarchical", inner="ring", outer="tree", ranks_per_node=2)
    allreduce.create("ring", transport="torch")   # over torch.distributed instead of MPI
    allreduce.create("ring", comm=sub, transport="torch")   # over a sub-communicator's ranks
    allreduce.create("auto")                 # an algorithm per call from size, P, nodes;
    allreduce.create("auto", calibration="cal.json")   # by the cost model (allreduce/auto.py)
    coll = allreduce.host_staged(coll)       # CUDA tensors through pinned host memory where
                                             # the transport is MPI (not CUDA-aware)

Algorithms: ring, tree, halving_doubling, hierarchical, shm (one node, buffers
from coll.empty); baselines: mpi, torch; auto picks one of them per call.
Errors (errors.py): TransportError from a transport, CollectiveError from a
collective (a transport's error met during one comes back as a CollectiveError
naming the algorithm and the collective); both are AllreduceErrors.

Imports go one way, down: this factory -> auto -> hierarchical -> registry (the
one-level algorithms by name) -> ring, tree, ... -> collective -> transport.
"""
from .auto import Auto
from .buffers import HostStaged
from .collective import Collective
from .errors import (AllreduceError, CollectiveError, CollectiveTimeout, TransportError,
                     TransportTimeout)
from .hierarchical import Hierarchical
from .registry import ONE_LEVEL, TEXTBOOK, build, one_level_class
from .shards import shard_bounds, shard_of
from .transport import MPITransport, Transport

# The order is the one users see in messages and sweeps.
ALGORITHMS = TEXTBOOK + ("hierarchical", "shm", "mpi", "torch", "auto")
# Built on the one-level algorithms (registry.py), which they import themselves.
COMPOSED = {"hierarchical": Hierarchical, "auto": Auto}

__all__ = ["create", "make", "make_transport", "host_staged", "shard_bounds", "shard_of",
           "ALGORITHMS", "TEXTBOOK", "Collective", "Transport", "AllreduceError",
           "CollectiveError", "CollectiveTimeout", "TransportError", "TransportTimeout"]


def make_transport(kind="mpi", comm=None, timeout=None):
    """A transport over `comm`'s ranks.  'mpi': an mpi4py communicator (default
    COMM_WORLD).  'torch': the same, or a list of global ranks or a torch
    ProcessGroup; each runs on a process group of its own (torch_transport.py)."""
    if kind == "mpi":
        return MPITransport(comm, timeout)
    if kind == "torch":
        from .torch_transport import TorchTransport, group_for, init_torch_distributed
        init_torch_distributed(timeout=timeout)
        return TorchTransport(group_for(comm, timeout), timeout)
    raise TransportError(f"unknown transport {kind!r}; choose 'mpi' or 'torch'")


def make(name, transport, **options):
    """The collective `name` over an existing transport."""
    if name in COMPOSED:
        cls = COMPOSED[name]
    elif name in ONE_LEVEL:
        cls = one_level_class(name)
    else:
        raise CollectiveError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    return build(cls, name, transport, **options)


def create(name, comm=None, transport=None, timeout=None, link_latency_us=None, link_gbps=None,
           **options):
    """A collective by name.  `transport` is 'mpi' (default; 'torch' for the torch
    baseline), 'torch', or a Transport object; `comm` an mpi4py communicator (for
    'torch' also a list of global ranks or a ProcessGroup: make_transport).
    `link_latency_us` / `link_gbps` (Gbit/s) emulate a slower interconnect (allreduce.emulate)."""
    if name not in ALGORITHMS:
        raise CollectiveError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    if transport is None or isinstance(transport, str):
        transport = make_transport(transport or ("torch" if name == "torch" else "mpi"),
                                   comm, timeout)
    if link_latency_us or link_gbps:
        if name in ("mpi", "torch"):
            raise CollectiveError(f"link emulation applies to the textbook algorithms, "
                                  f"not the {name!r} baseline")
        from .emulate import EmulatedLink
        transport = EmulatedLink(transport, link_latency_us or 0.0, link_gbps)
    return make(name, transport, **options)


def host_staged(coll):
    """`coll` itself where its transport moves CUDA tensors (NCCL); otherwise `coll`
    with CUDA tensors staged through pinned host memory (buffers.HostStaged).  Host
    buffers go straight through either way."""
    return coll if coll.transport.takes_cuda else HostStaged(coll)
