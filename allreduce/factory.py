"""The factory behind `allreduce.create`: a collective by name, over a transport
made here or given.  The package's __init__ hands these names out on first use.
"""
import os
import sys

from .auto import Auto
from .cuda_ipc import SharedGpuTransport
from .errors import CollectiveError, TransportError
from .hierarchical import Hierarchical
from .registry import ONE_LEVEL, TEXTBOOK, build, one_level_class
from .staging import HostStaged, HostStagedTransport
from .transport import MPITransport, Transport

# The order is the one users see in messages and sweeps.
ALGORITHMS = TEXTBOOK + ("hierarchical", "shm", "mpi", "torch", "auto")
# Built on the one-level algorithms (registry.py), which they import themselves.
COMPOSED = {"hierarchical": Hierarchical, "auto": Auto}


def make_transport(kind=None, comm=None, timeout=None):
    """A transport over `comm`'s ranks.  'mpi': an mpi4py communicator (default
    COMM_WORLD).  'torch': the same, or a list of global ranks, a torch ProcessGroup
    or a TorchComm (torchrun's mesh axes: torch_comm.py); each runs on a process group
    of its own (torch_transport.py).  None: the communicator's own (kind_of)."""
    kind = kind or kind_of(comm)
    if kind == "mpi":
        return MPITransport(comm, timeout)
    if kind == "torch":
        from .torch_transport import TorchTransport, group_for
        from .torch_world import init_torch_distributed
        init_torch_distributed(timeout=timeout)
        group = comm.group if kind_of(comm) == "torch" else group_for(comm, timeout)
        return TorchTransport(group, timeout)
    raise TransportError(f"unknown transport {kind!r}; choose 'mpi' or 'torch'")


def kind_of(comm):
    """The transport a communicator takes: 'torch' for a TorchComm, 'mpi' for an mpi4py
    communicator (or None, COMM_WORLD).  A TorchComm exists only once its module is
    loaded, so asking does not load torch into an MPI run."""
    torch_comm = sys.modules.get(f"{__package__}.torch_comm")
    return "torch" if torch_comm is not None and isinstance(comm, torch_comm.TorchComm) \
        else "mpi"


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
           device=None, **options):
    """A collective by name.  `transport` is 'mpi' (default; 'torch' for the torch
    baseline and over a TorchComm), 'torch', or a Transport object; `comm` an mpi4py
    communicator or a TorchComm (for 'torch' also a list of global ranks or a
    ProcessGroup: make_transport).
    `link_latency_us` / `link_gbps` (Gbit/s) emulate a slower interconnect (allreduce.emulate).
    `device`: where the buffers will live, if a GPU: then a textbook algorithm over an
    MPI that moves host memory only runs over CUDA IPC between the ranks that share a
    GPU (cuda_ipc.py; a collective call), and host_staged passes it through."""
    if name not in ALGORITHMS:
        raise CollectiveError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    if transport is None or isinstance(transport, str):
        transport = make_transport(transport or ("torch" if name == "torch" else None),
                                   comm, timeout)
    if link_latency_us or link_gbps:
        if name in ("mpi", "torch"):
            raise CollectiveError(f"link emulation applies to the textbook algorithms, "
                                  f"not the {name!r} baseline")
        from .emulate import EmulatedLink
        transport = EmulatedLink(transport, link_latency_us or 0.0, link_gbps)
    elif name in TEXTBOOK:
        shared = device_transport(transport, device)
        if shared is not None:
            coll = make(name, shared, **options)
            coll.segment_bytes = max(coll.segment_bytes, shared.segment_bytes)
            return coll
    return make(name, transport, **options)


def device_transport(transport, device):
    """`transport` with CUDA IPC between the ranks that share a GPU, where it is an
    MPI transport that moves host memory only and `device` a GPU that two of its
    ranks share; None otherwise (and where TOPOLAB_CUDA_IPC=0 asks for the staging, to
    compare).  Collective: every rank of `transport` calls it."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    if os.environ.get("TOPOLAB_CUDA_IPC", "1") == "0":
        return None
    if not isinstance(transport, MPITransport) or transport.takes_cuda:
        return None
    return SharedGpuTransport.over(transport, device)


def takes_device_buffers(coll):
    """Whether `coll` moves CUDA tensors itself.  Over NCCL every collective does.
    Over a CUDA-aware MPI, those whose bytes all go through the transport's
    point-to-point calls: the textbook algorithms, and hierarchical built of them;
    not the MPI library's own collectives (mpi; auto, which may pick them), which
    native.py hands host views, nor shm, whose buffers live in a host window."""
    transport = coll.transport
    if not transport.takes_cuda:
        return False
    if not isinstance(transport, MPITransport):
        return True
    return all(level in TEXTBOOK for level in getattr(coll, "levels", (coll.name,)))


def host_staged(coll, device=None):
    """`coll` itself where it moves CUDA tensors (takes_device_buffers); otherwise
    `coll` with CUDA tensors staged through pinned host memory (staging.HostStaged),
    the fallback.  Host buffers go straight through either way.  A point-to-point
    Transport (a pipeline's) that is not CUDA-aware goes device to device between
    ranks that share `device` (device_transport; a collective call), staged the same
    way between the others (staging.HostStagedTransport)."""
    if isinstance(coll, (HostStaged, HostStagedTransport)):
        return coll                                # staged already: once is enough
    if isinstance(coll, Transport):
        if coll.takes_cuda:
            return coll
        return device_transport(coll, device) or HostStagedTransport(coll)
    return coll if takes_device_buffers(coll) else HostStaged(coll)
