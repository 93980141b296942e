"""The grid and the experts on a GPU, checked where they can be without one.

Tier (a): the point-to-point staging of a pipeline's messages
(allreduce.staging.HostStagedTransport) over a real MPI transport of one rank,
CPU tensors standing for CUDA ones (its `needs_host` says yes to every tensor,
as tests/test_cuda_paths.py does for the collectives); the order of its copies
against the simulated GPU of tests/test_cuda_staging.py; the one decision,
gradient_sync.for_device; a checkpoint's host copies.

Tier (c): two ranks train the grid's layouts twice in one launch, as they are and
with for_device answering as on a GPU whose MPI moves host memory only
(tests/mpi/staged_grid.py): every collective and every pipeline message through
host buffers.  Staging only copies, so the runs must agree bit for bit, and each
kind of operation the layout uses must have been staged.  The real GPU runs,
against --device cpu: tests/gpu/test_cuda_layouts.py.
"""
import json

import numpy as np
import pytest
import torch

import allreduce
from allreduce.staging import HostStaged, HostStagedTransport, StagedHandle
from conftest import check_ok, mpirun
from strategies.runtime.checkpoint import on_host
from strategies.sync.gradient_sync import for_device
from test_cuda_staging import SimulatedGPU


class EveryMessage(HostStagedTransport):
    def needs_host(self, x):        # as a CUDA tensor would
        return True


class Recording:
    """The inner transport's calls, kept: which buffers it was handed."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []
        self.rank, self.size, self.timeout, self.traffic = 0, 1, inner.timeout, inner.traffic

    def isend(self, buf, peer, tag=0):
        self.seen.append(("isend", buf))
        return self.inner.isend(buf, peer, tag)

    def irecv(self, buf, peer, tag=0):
        self.seen.append(("irecv", buf))
        return self.inner.irecv(buf, peer, tag)

    def wait_all(self, handles):
        self.inner.wait_all(handles)


@pytest.fixture
def loopback():
    """An MPI transport of one rank: a rank's messages to itself."""
    from mpi4py import MPI
    return allreduce.MPITransport(MPI.COMM_SELF, timeout=10)


def test_messages_travel_through_host_buffers_of_their_own(loopback):
    inner = Recording(loopback)
    p2p = EveryMessage(inner)
    first, second = torch.arange(6.0).view(2, 3) + 1000, torch.arange(4.0) - 7
    sends = [p2p.isend(first, 0, tag=1), p2p.isend(second, 0, tag=2)]   # both in flight
    got_second, got_first = torch.zeros(4), torch.zeros(2, 3)
    late = p2p.irecv(got_second, 0, tag=2)
    early = p2p.irecv(got_first, 0, tag=1)
    early.wait()
    assert torch.equal(got_first, first) and torch.equal(got_second, torch.zeros(4))
    p2p.wait_all([late] + sends)                       # a receive's copy up ends its wait
    assert torch.equal(got_second, second)
    handed = [buf for _, buf in inner.seen]
    given = [first, second, got_second, got_first]
    assert len({b.data_ptr() for b in handed}) == 4    # one buffer a message in flight
    assert all(h.data_ptr() != g.data_ptr() and h.dim() == 1 for h, g in zip(handed, given))
    assert all(isinstance(h, StagedHandle) and h.host is None for h in sends + [late, early])
    assert p2p.bytes_sent == p2p.bytes_received == (6 + 4) * 4   # the inner's counts


def test_host_tensors_pass_straight_through(loopback):
    inner = Recording(loopback)
    p2p = HostStagedTransport(inner)
    x, y = torch.arange(3.0), torch.zeros(3)
    p2p.wait_all([p2p.irecv(y, 0), p2p.isend(x, 0)])
    assert [buf for _, buf in inner.seen] == [y, x] and torch.equal(y, x)


def test_a_send_waits_for_its_producer_and_a_receive_orders_its_readers():
    gpu = SimulatedGPU()

    class Loop:                     # a transport that delivers each message at once
        rank, size, timeout, traffic = 0, 1, 1.0, None
        box = {}

        def isend(self, buf, peer, tag=0):
            self.box[tag] = buf.clone()
            return Done()

        def irecv(self, buf, peer, tag=0):
            return Done(lambda: buf.copy_(self.box[tag]))

    class Done:
        request = None

        def __init__(self, arrive=None):
            self.arrive = arrive

        def wait(self):
            if self.arrive:
                self.arrive()

    p2p = EveryMessage(Loop(), copies=lambda device: gpu)
    x, values = torch.zeros(5), torch.arange(5.0) * 3
    gpu.work("compute", "write x", lambda: x.copy_(values))      # queued, not run
    p2p.isend(x, 0, tag=7).wait()
    assert torch.equal(Loop.box[7], values)            # the copy down waited for the kernel
    into = torch.zeros(5)
    p2p.irecv(into, 0, tag=7).wait()
    assert torch.equal(into, torch.zeros(5))           # the CPU does not wait for the copy up
    read = []
    gpu.work("compute", "read", lambda: read.append(into.clone()))
    gpu.drain("compute")
    assert torch.equal(read[0], values)                # the stream's next reader does
    assert gpu.calls[-1][:2] == ("wait", "compute")


def test_for_device_is_the_one_decision(monkeypatch, loopback):
    import allreduce.transport as transport
    monkeypatch.setattr(transport, "mpi_takes_cuda", lambda MPI: False)
    coll = allreduce.make("ring", loopback)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")   # a device object needs no GPU
    assert for_device(coll, cpu) is coll and for_device(loopback, cpu) is loopback
    assert for_device(coll, None) is coll
    assert isinstance(for_device(coll, cuda), HostStaged)
    assert isinstance(for_device(loopback, cuda), HostStagedTransport)
    staged = for_device(coll, cuda)
    assert for_device(staged, cuda) is staged                # once is enough
    monkeypatch.setattr(transport, "mpi_takes_cuda", lambda MPI: True)   # CUDA-aware MPI
    assert for_device(coll, cuda) is coll and for_device(loopback, cuda) is loopback


def test_a_checkpoint_holds_host_tensors_in_the_same_structure():
    state = {"model": {"w": torch.ones(2, requires_grad=True)},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                           "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
             "sync": {"shards": [torch.arange(3.0)], "compressor_step": 4}}
    host = on_host(state)
    assert not host["model"]["w"].requires_grad
    assert host["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert isinstance(host["optimizer"]["param_groups"][0]["betas"], tuple)
    assert torch.equal(host["sync"]["shards"][0], torch.arange(3.0))
    assert host["sync"]["compressor_step"] == 4


# -- tier (c): two ranks, every tensor staged, against the same runs unstaged ---------
COMMON = ["--steps", "2", "--threads", "1", "--no-progress", "--sync", "ring",
          "--lr", "0.05", "--momentum", "0.9", "--dataset-size", "64", "--global-batch", "8"]
MLP = ["--model", "mlp", "--width", "16", "--depth", "2", "--in-dim", "8", "--classes", "4"]
GPT = ["--model", "gpt", "--layers", "2", "--d-model", "16", "--heads", "2", "--vocab", "12",
       "--seq-len", "8"]
MOE = ["--model", "moe", "--experts", "4", "--layers", "1", "--d-model", "16", "--heads", "2",
       "--vocab", "12", "--seq-len", "8", "--top-k", "2", "--capacity-factor", "1.0"]
# (name, flags, the operations the layout must have staged)
RUNS = [
    ("pp2_zero1", MLP + ["--pp", "2", "--micro-batches", "2", "--zero", "1"],
     {"isend", "irecv", "allgather"}),
    ("tp2_sp", GPT + ["--tp", "2", "--sequence-parallel"], {"allreduce", "allgather",
                                                            "reduce_scatter"}),
    ("zero3", MLP + ["--zero", "3"], {"broadcast", "allgather", "reduce_scatter"}),
    ("ep2_zero1", MOE + ["--ep", "2", "--zero", "1"], {"alltoall", "reduce_scatter",
                                                      "allgather"}),
]


@pytest.mark.timeout(300)
def test_staging_every_tensor_leaves_every_layout_unchanged(tmp_path):
    runs = [(name, COMMON + flags) for name, flags, _ in RUNS]
    check_ok(mpirun(2, ["tests/mpi/staged_grid.py", tmp_path, json.dumps(runs)], timeout=240))
    for rank in range(2):
        ops = json.loads((tmp_path / f"ops-rank-{rank}.json").read_text())
        for name, _, used in RUNS:
            staged = {op for op, n in ops[name].items() if n > 0}
            assert used <= staged, (name, rank, ops[name])
    for name, _, _ in RUNS:
        plain, staged = (np.load(tmp_path / f"{name}-{kind}.npz") for kind in ("plain", "staged"))
        assert sorted(plain) == sorted(staged), name
        for key in plain:
            np.testing.assert_array_equal(plain[key], staged[key], err_msg=f"{name}: {key}")
        losses = [[(r["rank"], r["loss"]) for r in map(json.loads, open(
            tmp_path / f"{name}-{kind}.jsonl")) if r["kind"] == "step"]
            for kind in ("plain", "staged")]
        assert losses[0] == losses[1] and losses[0], name
