"""The all-reduce call path: what it keeps between calls, and that a change is still seen.

A validated call is kept per (op, dtype, size) (Collective._plans) and goes
straight to the method that runs it, for auto its choice's.  These tests change
each thing a kept call depends on, on the same array and on new ones, and check
that the change is validated again and the result is still right.  Two ranks
run as two threads over in-memory queues (`ThreadPair`), so the pipelined
receive window (Collective.sendrecv_reduce) is checked here without MPI too.
"""
import queue
import threading

import numpy as np
import pytest
import torch

import allreduce
from allreduce.buffers import as_bytes
from allreduce.collective import PLANS_KEPT
from allreduce.errors import CollectiveError, TransportTimeout
from allreduce.transport import Handle, Transport
from conftest import check_ok, mpirun


class ThreadPair(Transport):
    """Rank `rank` of two ranks in one process: a message is a copy of its bytes
    in the queue of its (source, destination, tag); a receive takes it on wait."""

    size = 2

    def __init__(self, rank, queues):
        super().__init__(timeout=10)
        self.rank, self.queues = rank, queues

    def isend(self, buf, peer, tag=0):
        self.queues[self.rank, peer, tag].put(as_bytes(buf).copy())
        return Handle(self, None, peer)

    def irecv(self, buf, peer, tag=0):
        return Handle(self, (buf, tag), peer)

    def _wait_all(self, handles):
        for h in handles:
            if h.request is not None:
                buf, tag = h.request
                try:
                    data = self.queues[h.peer, self.rank, tag].get(timeout=self.timeout)
                except queue.Empty:
                    raise TransportTimeout(self.rank, [h.peer], self.timeout) from None
                as_bytes(buf)[:] = data
                h.request = None

    def barrier(self):
        pass

    def node_id(self):
        return 0

    def world_rank(self, rank):
        return rank


def on_two_ranks(body):
    """body(rank, transport) on two threads; their results, rank by rank."""
    queues = {(s, d, t): queue.Queue() for s in range(2) for d in range(2)
              for t in (0, 7919)}
    results, errors = [None, None], []

    def run(rank):
        try:
            results[rank] = body(rank, ThreadPair(rank, queues))
        except Exception as e:          # noqa: BLE001 - handed to the test below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def values(rank, n, dtype):
    """Rank- and position-dependent, exact in every dtype used here."""
    return ((np.arange(n) % 13) - 6 + 10 * rank).astype(dtype)


def expected(n, dtype, op):
    a, b = values(0, n, dtype), values(1, n, dtype)
    if op == "max":
        return np.maximum(a, b)
    if op == "min":
        return np.minimum(a, b)
    total = (a.astype(np.float64) + b)
    return (total / 2 if op == "avg" else total).astype(dtype)


# (shape, dtype, op), in an order that changes one thing at a time
CALLS = [((10,), np.float32, "sum"), ((10,), np.float32, "sum"), ((10,), np.float64, "sum"),
         ((7,), np.float32, "sum"), ((2, 5), np.float32, "sum"), ((10,), np.float32, "avg"),
         ((10,), np.float32, "max"), ((10,), np.int32, "sum"), ((10,), np.float32, "min"),
         ((3000,), np.float32, "sum"), ((2999,), np.int64, "max"), ((10,), np.float32, "sum")]


@pytest.mark.parametrize("algo", ["ring", "halving_doubling", "tree", "auto"])
def test_each_changed_call_is_right(algo):
    def body(rank, transport):
        coll = allreduce.make(algo, transport, segment_bytes=256)   # many segments at 3000
        kept = np.zeros(10, np.float32)              # one array, called with again and again
        out = []
        for shape, dtype, op in CALLS:
            n = int(np.prod(shape))
            if (shape, dtype) == ((10,), np.float32):
                kept[:] = values(rank, n, dtype)
                x = kept
            else:
                x = values(rank, n, dtype).reshape(shape)
            assert coll.allreduce(x, op=op) is x
            out.append(x.reshape(-1).copy())
        return out
    for result in on_two_ranks(body):
        for (shape, dtype, op), got in zip(CALLS, result):
            np.testing.assert_array_equal(got, expected(int(np.prod(shape)), dtype, op),
                                          err_msg=f"{shape} {np.dtype(dtype)} {op}")


def test_a_kept_call_still_reads_the_arrays_flags_and_dtype():
    coll = allreduce.make("ring", Transport())      # one rank
    x = np.zeros(16, np.float32)
    coll.allreduce(x)
    coll.allreduce(x)                                  # kept now
    x.flags.writeable = False
    with pytest.raises(CollectiveError, match="read-only"):
        coll.allreduce(x)
    x.flags.writeable = True
    strided = np.zeros(32, np.float32)[::2]            # same dtype and size, not contiguous
    with pytest.raises(CollectiveError, match="not C-contiguous"):
        coll.allreduce(strided)
    x.dtype = np.int32                                 # the same memory, another dtype
    coll.allreduce(x)
    with pytest.raises(CollectiveError, match="floating dtype"):
        coll.allreduce(x, op="avg")
    x.dtype = np.complex64                             # 8 elements, unsupported
    with pytest.raises(CollectiveError, match="unsupported dtype complex64"):
        coll.allreduce(x)
    x.dtype = np.float32
    for op in ("mean", ["sum"]):                       # unknown; unhashable
        with pytest.raises(CollectiveError, match="unknown op"):
            coll.allreduce(x, op=op)
    coll.allreduce(x)                                  # and the kept call still runs


def test_tensors_and_subclasses_are_validated_every_call():
    coll = allreduce.make("ring", Transport())
    t = torch.zeros(8)
    coll.allreduce(t)
    t.requires_grad_(True)
    with pytest.raises(CollectiveError, match="requires grad"):
        coll.allreduce(t)
    assert not coll._plans                             # only numpy arrays are kept


def test_checked_calls_are_not_kept():
    coll = allreduce.make("ring", Transport())
    coll.check = True                                  # TOPOLAB_CHECK compares every call
    coll.allreduce(np.zeros(4, np.float32))
    assert not coll._plans


def test_kept_calls_are_bounded():
    coll = allreduce.make("ring", Transport())
    for n in range(PLANS_KEPT + 10):
        coll.allreduce(np.zeros(n, np.float32))
    assert 0 < len(coll._plans) <= PLANS_KEPT


def test_auto_keeps_its_choice_method():
    def body(rank, transport):
        auto = allreduce.make("auto", transport)
        small, large = np.ones(16, np.float32), np.ones(1 << 19, np.float32)
        for x in (small, large, small):
            auto.allreduce(x)
        return {x.nbytes: auto._plans["sum", x.dtype, x.nbytes] for x in (small, large)}
    for kept in on_two_ranks(body):
        for size, run in kept.items():
            assert run.__self__.name != "auto"         # the choice itself, not auto again
        assert kept[64].__self__.name == "halving_doubling"
        assert kept[2 << 20].__self__.name == "ring"


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_the_receive_window_adds_every_segment(n, kind):
    """More segments than the window's slots, uneven last segments, both buffer kinds."""
    def body(rank, transport):
        ring = allreduce.make("ring", transport, segment_bytes=64)
        x = values(rank, n, np.float32)
        ring.allreduce(torch.from_numpy(x) if kind == "torch" else x)
        return x
    for got in on_two_ranks(body):
        np.testing.assert_array_equal(got, expected(n, np.float32, "sum"))


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_callpath_times_every_part_on_one_rank_only():
    result = check_ok(mpirun(1, ["-m", "allreduce.callpath", "--calls", "100", "--repeat", "1"],
                             timeout=120))
    lines = result.stdout.splitlines()
    for part in ("raw Allreduce", "raw Iallreduce + Test", "full validation", "mpi", "mpi avg",
                 "auto", "ring"):
        assert any(line.split()[:-1] and " ".join(line.split()[:-1]).startswith(part)
                   for line in lines[1:]), part
    for args in (["--calls", "5"], ["--repeat", "0"]):
        bad = mpirun(1, ["-m", "allreduce.callpath", *args], timeout=60)
        assert bad.returncode == 2 and "--calls must be >= 10 and --repeat >= 1" in bad.stderr
        assert "Traceback" not in bad.stderr
    two = mpirun(2, ["-m", "allreduce.callpath"], timeout=60)
    assert two.returncode == 2 and "run on one rank" in two.stderr
