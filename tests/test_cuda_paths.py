"""The CUDA paths, checked where they can be on a machine without a GPU.

Tier (a): the host staging that carries CUDA tensors to transports that move
host memory only (allreduce.staging.HostStaging, HostStaged).  Its copying is
device-independent, so it is checked with CPU tensors: a HostStaged that
stages every tensor (standing for a CUDA one) over a stand-in collective that
records what it was handed and changes it the way a reduction over two ranks
would.  The order of its copies on CUDA streams is checked against a simulated
GPU in tests/test_cuda_staging.py; which collectives take CUDA buffers as they
are (NCCL, a CUDA-aware MPI) here.  The real thing, CUDA tensors through MPI,
is in tests/gpu/.

Tier (c): a run that asks for a GPU where torch sees none stops before
training, with one line naming --device on every rank, and no traceback.
"""
import pytest
import torch

import allreduce
from allreduce.errors import CollectiveError
from allreduce.staging import HostStaged, HostStaging
from conftest import mpirun


def test_to_host_reuses_one_buffer_per_dtype_and_grows():
    staging = HostStaging()
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 1.5 - 4
    host = staging.to_host(x)
    assert host.shape == (12,) and torch.equal(host, x.reshape(-1))
    assert host.data_ptr() != x.data_ptr()                  # a copy, not a view
    first = host.data_ptr()
    small = staging.to_host(torch.full((5,), 7.0))
    assert small.data_ptr() == first and torch.equal(small, torch.full((5,), 7.0))
    wide = staging.to_host(torch.arange(40, dtype=torch.float64))   # another dtype
    assert wide.dtype == torch.float64
    assert torch.equal(wide, torch.arange(40, dtype=torch.float64))
    assert staging.to_host(torch.ones(3)).data_ptr() == first    # float32's is still there
    grown = staging.to_host(torch.arange(100, dtype=torch.float32))
    assert grown.numel() == 100 and torch.equal(grown, torch.arange(100, dtype=torch.float32))
    empty = staging.to_host(torch.empty(0, dtype=torch.bfloat16))
    assert empty.numel() == 0 and empty.dtype == torch.bfloat16


class StandIn:
    """A collective of two ranks whose peer holds `peer_offset + ours`; records the
    buffers it is handed (they must be staging buffers, never the caller's)."""
    name, counts_traffic, rank, size = "stand-in", True, 0, 2

    def __init__(self, takes_cuda=False, peer_offset=100):
        self.transport = type("T", (), {"takes_cuda": takes_cuda})()
        self.peer_offset, self.seen = peer_offset, []

    def allreduce(self, x, op="sum"):
        self.seen.append(x)
        x.mul_(2).add_(self.peer_offset)
        return x

    def broadcast(self, x, root=0):
        self.seen.append(x)
        if root == 1:
            x.add_(self.peer_offset)
        return x

    def reduce_scatter(self, x, op="sum"):
        self.seen.append(x)
        return (2 * x + self.peer_offset)[: (x.numel() + 1) // 2]

    def allgather(self, shard, n=None):
        self.seen.append(shard)
        return torch.cat([shard, shard + self.peer_offset])

    def barrier(self):
        pass


class StageEverything(HostStaged):
    def needs_host(self, x):        # as a CUDA tensor would
        return True


def test_staged_collectives_move_values_through_the_host_and_back():
    inner = StandIn()
    coll = StageEverything(inner)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert coll.allreduce(x) is x
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3) * 2 + 100)
    y = torch.arange(5, dtype=torch.bfloat16)
    coll.broadcast(y, root=1)
    assert torch.equal(y, torch.arange(5, dtype=torch.bfloat16) + 100)
    z = torch.arange(5, dtype=torch.float64)
    shard = coll.reduce_scatter(z)
    assert torch.equal(shard, torch.tensor([100.0, 102.0, 104.0], dtype=torch.float64))
    assert torch.equal(z, torch.arange(5, dtype=torch.float64))           # input untouched
    whole = coll.allgather(torch.tensor([1, 2], dtype=torch.int64))
    assert torch.equal(whole, torch.tensor([1, 2, 101, 102]))
    for given, seen in zip([x, y, z], inner.seen):
        assert seen.data_ptr() != given.data_ptr() and seen.dim() == 1
    assert coll.transport is inner.transport and coll.size == 2 and coll.name == "stand-in"


def test_staged_collective_names_bad_input():
    coll = StageEverything(StandIn())
    with pytest.raises(CollectiveError, match="not contiguous"):
        coll.allreduce(torch.zeros(4, 4).t())
    with pytest.raises(CollectiveError, match="requires grad"):
        coll.broadcast(torch.zeros(3, requires_grad=True))


def test_host_buffers_pass_straight_through_and_nccl_is_not_staged():
    inner = StandIn()
    x = torch.ones(4)
    allreduce.host_staged(inner).allreduce(x)
    assert inner.seen[0] is x                               # a CPU tensor is not copied
    nccl = StandIn(takes_cuda=True)
    assert allreduce.host_staged(nccl) is nccl


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@no_gpu
@pytest.mark.timeout(150)
@pytest.mark.parametrize("args", [
    ["-m", "strategies.train", "--sync", "ring", "--steps", "1", "--no-progress"],
    ["-m", "strategies.train", "--sync", "torch", "--steps", "1", "--no-progress"],
    ["-m", "allreduce.bench", "--sizes", "4K", "--iters", "1"],
], ids=["train-ring", "train-torch", "bench"])
def test_cuda_without_a_gpu_stops_every_rank_before_any_work(args):
    result = mpirun(2, args + ["--device", "cuda"], timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [ln for ln in result.stderr.splitlines() if "error: --device cuda" in ln]
    assert sorted(ln.split(":")[0] for ln in lines) == [f"{args[1]} rank 0", f"{args[1]} rank 1"]
    assert "Traceback" not in result.stderr
    assert "loss" not in result.stdout and "algbw" not in result.stdout


# -- which collectives take CUDA buffers as they are ----------------------------------
def test_memory_kinds_and_the_mpix_queries_say_whether_mpi_reads_device_memory():
    from allreduce.gpus import MPIX_GPU_SUPPORT_CUDA, kinds_take_cuda, library_takes_cuda
    assert kinds_take_cuda("mpi,system,cuda:device") and kinds_take_cuda("system, cuda:device")
    assert not kinds_take_cuda("mpi,system") and not kinds_take_cuda(None)
    assert not kinds_take_cuda("cuda:host")             # pinned host memory is not the GPU's

    class MPICH:                                         # MPIX_GPU_query_support(kind, &flag)
        def __init__(self, flag, code=0):
            self.flag, self.code = flag, code

        def MPIX_GPU_query_support(self, kind, flag):
            assert kind == MPIX_GPU_SUPPORT_CUDA
            flag._obj.value = self.flag
            return self.code

    class OpenMPI:
        def __init__(self, answer):
            self.MPIX_Query_cuda_support = lambda: answer

    assert library_takes_cuda(MPICH(1)) and not library_takes_cuda(MPICH(0))
    assert not library_takes_cuda(MPICH(1, code=15))    # an error code: not supported
    assert library_takes_cuda(OpenMPI(1)) and not library_takes_cuda(OpenMPI(0))
    assert not library_takes_cuda(object())              # neither query: staging


def test_this_mpi_library_is_asked():
    from mpi4py import MPI
    from allreduce.gpus import loaded_mpi_library, mpi_takes_cuda
    lib = loaded_mpi_library()
    assert lib is not None and (hasattr(lib, "MPIX_GPU_query_support")
                                or hasattr(lib, "MPIX_Query_cuda_support"))
    assert mpi_takes_cuda(MPI) in (True, False)


@pytest.fixture
def cuda_aware(monkeypatch):
    """An MPITransport over COMM_SELF whose MPI library says it is CUDA-aware."""
    from mpi4py import MPI
    import allreduce.transport as transport
    monkeypatch.setattr(transport, "mpi_takes_cuda", lambda MPI: True)
    return transport.MPITransport(MPI.COMM_SELF)


def collective(transport, name, levels=None):
    coll = type("Coll", (), {"transport": transport, "name": name})()
    if levels:
        coll.levels = levels
    return coll


@pytest.mark.parametrize("name, levels, direct", [
    ("ring", None, True), ("tree", None, True), ("halving_doubling", None, True),
    ("hierarchical", ("ring", "tree"), True),
    ("hierarchical", ("ring", "mpi"), False),          # the leaders' MPI_Iallreduce: host views
    ("mpi", None, False), ("auto", None, False), ("shm", None, False)])
def test_a_cuda_aware_mpi_takes_the_textbook_algorithms_buffers(cuda_aware, name, levels, direct):
    coll = collective(cuda_aware, name, levels)
    assert allreduce.takes_device_buffers(coll) is direct
    assert (allreduce.host_staged(coll) is coll) is direct


def test_without_cuda_awareness_every_mpi_collective_is_staged(monkeypatch):
    from mpi4py import MPI
    import allreduce.transport as transport
    monkeypatch.setattr(transport, "mpi_takes_cuda", lambda MPI: False)
    coll = collective(transport.MPITransport(MPI.COMM_SELF), "ring")
    assert isinstance(allreduce.host_staged(coll), HostStaged)


def test_the_mpi_transport_hands_device_buffers_over_once_their_kernels_are_done(
        cuda_aware, monkeypatch):
    import allreduce.transport as transport
    ready = []
    monkeypatch.setattr(transport, "device_ready", ready.append)
    x = torch.empty(6, dtype=torch.float32, device="meta")     # a tensor off the host
    message = cuda_aware._message(x)
    assert ready == [x] and message.dtype == torch.uint8 and message.numel() == 24
    monkeypatch.setattr(transport, "mpi_takes_cuda", lambda MPI: False)
    with pytest.raises(allreduce.TransportError, match="not CUDA-aware.*host_staged"):
        cuda_aware._message(x)


def test_a_steps_clock_on_a_gpu_records_events_and_waits_for_the_last_only(monkeypatch):
    """runtime/metrics.StepClock with a stand-in for CUDA events: one wait a step (the
    last mark's), the times the events' differences; host times where asked for."""
    from strategies.runtime import metrics

    waited, ticks = [], iter(range(100))

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = next(ticks)           # one "millisecond" a mark

        def synchronize(self):
            waited.append(self.at)

        def elapsed_time(self, other):
            return float(other.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    hosts = []
    monkeypatch.setattr(metrics, "now", lambda device: hosts.append(device) or 7.0)
    clock = metrics.StepClock(torch.device("cuda"))
    marks = [clock.mark() for _ in range(4)]
    assert clock.seconds(*marks) == (0.0, 0.001, 0.002, 0.003)
    assert waited == [3] and hosts == []
    traced = metrics.StepClock(torch.device("cuda"), host_times=True)
    assert traced.seconds(traced.mark(), traced.mark()) == (7.0, 7.0) and len(hosts) == 2
    assert metrics.StepClock(torch.device("cpu")).events is False


def test_the_steps_host_reads_give_what_item_gives():
    """StepClock.read: the loss and fp16's counters come back as .item() gives them
    (float64 holds a float32 and an int64 counter exactly); what is no tensor, as it
    is.  On a GPU the tensors are copied to pinned memory behind the update
    (tests/gpu/test_step_waits.py: no host read after the clock's wait)."""
    from strategies.runtime.metrics import StepClock

    loss = torch.tensor(0.1234567, dtype=torch.float32)
    scale, skips = torch.tensor(65536.0), torch.tensor(3, dtype=torch.int64)
    values = StepClock.read(loss, None, 2.5, scale, skips).values()
    assert values == [loss.item(), None, 2.5, 65536.0, 3]
    assert type(values[0]) is float and type(values[4]) is int


def test_a_gpus_optimizer_is_fused_and_a_cpus_stays_the_reference():
    from types import SimpleNamespace

    from strategies.sync.gradient_sync import fused_fits
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), is_floating_point=lambda: True)
    assert fused_fits([on_gpu, on_gpu]) is True
    assert fused_fits([torch.zeros(2)]) is None            # torch's default: not fused
    assert fused_fits([on_gpu, torch.zeros(2)]) is None
    assert fused_fits([]) is None
