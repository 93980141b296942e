"""Which way CUDA tensors travel: the GPUs a host's ranks take, and whether MPI reads device memory.

    mpi_takes_cuda(MPI)             is the MPI library CUDA-aware?  (then the
                                    textbook algorithms hand it device buffers)
    shared_gpu(gpus, visible)       the GPU that two local ranks would both take, or None
    nccl_sharing_problem(...)       why NCCL cannot run this host's ranks, or None

NCCL needs a GPU of its own per rank ("Duplicate GPU detected" at its first
call otherwise); MPI, CUDA-aware or staging through host memory, does not.
"""
import ctypes
import functools

# MPI 4.1's portable answer: COMM_WORLD's info key lists the memory kinds the
# library supports, "cuda:device" among them where it reads device memory.
MEMORY_KINDS_KEY = "mpi_memory_alloc_kinds"
MPIX_GPU_SUPPORT_CUDA = 0        # MPICH's mpi.h


def kinds_take_cuda(kinds):
    """Whether a memory-kinds value ("mpi,system,cuda:device") names CUDA device memory."""
    return "cuda:device" in [k.strip() for k in (kinds or "").split(",")]


def library_takes_cuda(lib):
    """The MPIX query of a loaded MPI library (a ctypes.CDLL), False where it has none.

    mpi4py wraps neither query (they are extensions, not the standard), so they
    are called here.  MPICH (4.0 on): MPIX_GPU_query_support, which also answers
    on a build without GPU support (its MPIX_Query_cuda_support asserts there
    before 4.0).  Open MPI and MVAPICH: MPIX_Query_cuda_support, whose answer
    covers the runtime too (a CUDA build with CUDA switched off says 0)."""
    if hasattr(lib, "MPIX_GPU_query_support"):
        supported = ctypes.c_int(0)
        code = lib.MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(supported))
        return code == 0 and supported.value == 1
    if hasattr(lib, "MPIX_Query_cuda_support"):
        return lib.MPIX_Query_cuda_support() == 1
    return False


def loaded_mpi_library():
    """The MPI library this process loaded (mpi4py's) that has an MPIX query, as a
    ctypes.CDLL, or None.  Found in the process's memory map: mpi4py may load it
    privately, where ctypes.CDLL(None) does not see its symbols."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if "/libmpi" in line and ".so" in line})
    except OSError:                      # not Linux: no map to read
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)      # already loaded: the same handle, not a second copy
        except OSError:
            continue
        if hasattr(lib, "MPIX_GPU_query_support") or hasattr(lib, "MPIX_Query_cuda_support"):
            return lib
    return None


@functools.lru_cache(maxsize=None)
def mpi_takes_cuda(MPI):
    """Whether this MPI library moves CUDA device buffers itself (once per process).
    Asked after MPI_Init, as both queries require."""
    info = MPI.COMM_WORLD.Get_info()
    try:
        if kinds_take_cuda(info.Get(MEMORY_KINDS_KEY)):
            return True
    finally:
        info.Free()
    lib = loaded_mpi_library()
    return lib is not None and library_takes_cuda(lib)


def shared_gpu(gpus, visible):
    """(gpu, [local ranks], number of GPUs the ranks take) for the first GPU that
    two ranks of a host would take, or None where each takes its own.

    Local rank i takes the (i mod n)-th of the n GPUs it sees: `visible[i]` is
    its CUDA_VISIBLE_DEVICES, None where unset (then it sees all `gpus`); ranks
    bound to a GPU each (Slurm's --gpus-per-task, say) take different ones."""
    taken = {}
    for i, names in enumerate(visible):
        names = [str(g) for g in range(gpus)] if names is None else \
            [n.strip() for n in names.split(",") if n.strip()]
        if names:                        # none: that rank reports that it sees no GPU
            taken.setdefault(names[i % len(names)], []).append(i)
    for gpu, ranks in taken.items():
        if len(ranks) > 1:
            return gpu, ranks, len(taken)
    return None


def nccl_sharing_problem(host, gpus, visible):
    """Why NCCL cannot run the ranks of `host` (one line), or None."""
    shared = shared_gpu(gpus, visible)
    if shared is None:
        return None
    gpu, ranks, taken = shared
    return (f"{len(visible)} ranks on host {host or '?'} but {taken} GPU"
            f"{'s' if taken != 1 else ''} for them (local ranks {', '.join(map(str, ranks))} "
            f"would share GPU {gpu}); NCCL needs a GPU per rank")


def device_ready(buf):
    """Wait until the kernels queued on the current stream of buf's GPU are done:
    MPI reads and writes device memory outside torch's streams, so a send must not
    read a buffer still being written, nor a receive overwrite one still being read."""
    import torch
    torch.cuda.current_stream(buf.device).synchronize()
