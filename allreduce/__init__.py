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
"""
from .buffers import CollectiveError, HostStaged
from .collective import Collective, CollectiveTimeout
from .shards import shard_bounds, shard_of
from .transport import MPITransport, Transport, TransportTimeout

TEXTBOOK = ("ring", "tree", "halving_doubling")
ALGORITHMS = TEXTBOOK + ("hierarchical", "shm", "mpi", "torch", "auto")

__all__ = ["create", "make", "make_transport", "host_staged", "shard_bounds", "shard_of",
           "ALGORITHMS", "Collective", "CollectiveError", "CollectiveTimeout", "Transport",
           "TransportTimeout"]


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
    raise CollectiveError(f"unknown transport {kind!r}; choose 'mpi' or 'torch'")


def make(name, transport, **options):
    """The collective `name` over an existing transport."""
    if name == "ring":
        from .ring import Ring as cls
    elif name == "tree":
        from .tree import Tree as cls
    elif name == "halving_doubling":
        from .halving_doubling import HalvingDoubling as cls
    elif name == "hierarchical":
        from .hierarchical import Hierarchical as cls
    elif name == "shm":
        from .shm import SharedMemory as cls
    elif name == "mpi":
        from .native import MPINative as cls
    elif name == "torch":
        from .native import TorchNative as cls
    elif name == "auto":
        from .auto import Auto as cls
    else:
        raise CollectiveError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    try:
        return cls(transport, **options)
    except TypeError as e:
        raise CollectiveError(f"{name}: bad option ({e})") from None


def create(name, comm=None, transport=None, timeout=None, link_latency_us=None, link_gbps=None,
           **options):
    """A collective by name.  `transport` is 'mpi' (default; 'torch' for the torch
    baseline), 'torch', or a Transport object; `comm` an mpi4py communicator (for
    'torch' also a list of global ranks or a ProcessGroup: make_transport).
    `link_latency_us` / `link_gbps` emulate a slower interconnect (allreduce.emulate)."""
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
