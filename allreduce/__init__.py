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
                                             # the transport is MPI (not CUDA-aware); a
                                             # transport (point-to-point) the same way
    allreduce.create("ring", device=gpu)     # made for CUDA tensors: device to device between
                                             # ranks that share the GPU (cuda_ipc.py)

Algorithms: ring, tree, halving_doubling, hierarchical, shm (one node, buffers
from coll.empty); baselines: mpi, torch; auto picks one of them per call.
Errors (errors.py): TransportError from a transport, CollectiveError from a
collective (a transport's error met during one comes back as a CollectiveError
naming the algorithm and the collective); both are AllreduceErrors.

Imports go one way, down: the factory (factory.py) -> auto -> hierarchical -> registry (the
one-level algorithms by name) -> ring, tree, ... -> collective -> transport; the factory
-> cuda_ipc -> staging -> transport.
"""
import importlib

# Each name `import allreduce` offers, and the module that holds it.  They load
# on first use (PEP 562's module __getattr__): the collectives import torch,
# seconds per process, and the torch-free tools (the emulated cluster's
# commands, the lab checkers) import only allreduce.records and the like.
_HOME = {
    "create": "factory", "make": "factory", "make_transport": "factory",
    "host_staged": "factory", "takes_device_buffers": "factory", "ALGORITHMS": "factory",
    "COMPOSED": "factory",
    "Auto": "auto", "HostStaged": "staging", "HostStagedTransport": "staging", "Collective": "collective",
    "AllreduceError": "errors", "CollectiveError": "errors", "CollectiveTimeout": "errors",
    "TransportError": "errors", "TransportTimeout": "errors", "Hierarchical": "hierarchical",
    "ONE_LEVEL": "registry", "TEXTBOOK": "registry", "build": "registry",
    "one_level_class": "registry", "shard_bounds": "shards", "shard_of": "shards",
    "MPITransport": "transport", "Transport": "transport",
}

__all__ = ["create", "make", "make_transport", "host_staged", "shard_bounds", "shard_of",
           "ALGORITHMS", "TEXTBOOK", "Collective", "Transport", "AllreduceError",
           "CollectiveError", "CollectiveTimeout", "TransportError", "TransportTimeout"]


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value            # found once; later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOME))
