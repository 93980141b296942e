"""The order of the host staging's copies on CUDA streams, checked without a GPU.

Tier (a).  allreduce.staging writes its ordering once, against the interface
of CudaCopies (the current stream, a side stream, record / wait / copy / keep /
synchronize).  Here that interface is a simulated GPU whose streams run their
work only when the CPU waits for it, as a busy GPU may leave it queued.  So a
copy that did not wait for the kernel that writes its source reads the old
values, and a reader that did not wait for the copy back does too: an ordering
mistake shows as a wrong value, not as a timing.  The real streams: tests/gpu/.
"""
import pytest
import torch

from test_cuda_paths import StageEverything, StandIn


class SimulatedGPU:
    """Streams as queues of pending work; an event is a mark in a queue."""

    def __init__(self, current="compute"):
        self.current_stream, self.side = current, "side"
        self.queues, self.event_stream, self.passed = {}, {}, set()
        self.calls = []            # what the staging asked for, in order
        self.ran = []              # the work that ran, in order

    # ------------------------------------------- the CudaCopies interface
    def current(self):
        return self.current_stream

    def record(self, stream):
        event = f"e{len(self.event_stream) + 1}"
        self.event_stream[event] = stream
        self.queue(stream).append(("event", event))
        self.calls.append(("record", stream, event))
        return event

    def wait(self, stream, event):
        self.queue(stream).append(("wait", event))
        self.calls.append(("wait", stream, event))

    def copy(self, dst, src, stream):
        self.work(stream, "copy", lambda: dst.copy_(src))
        self.calls.append(("copy", stream))

    def keep(self, tensor, stream):
        self.calls.append(("keep", stream))

    def synchronize(self, event):
        self.calls.append(("synchronize", event))
        self.run_until(event)

    # ------------------------------------------------ the test's side
    def queue(self, stream):
        return self.queues.setdefault(stream, [])

    def work(self, stream, name, fn):
        """Queue a kernel (or a copy) on a stream; it runs when something waits past it."""
        self.queue(stream).append(("run", name, fn))

    def run_until(self, event):
        queue = self.queue(self.event_stream[event])
        while event not in self.passed:
            self.step(queue)

    def drain(self, stream):
        queue = self.queue(stream)
        while queue:
            self.step(queue)

    def step(self, queue):
        kind, *rest = queue.pop(0)
        if kind == "event":
            self.passed.add(rest[0])
        elif kind == "wait":
            if rest[0] not in self.passed:
                self.run_until(rest[0])
        else:
            name, fn = rest
            fn()
            self.ran.append(name)


class Recording(StandIn):
    """The stand-in collective, keeping a copy of the values it was handed."""

    def __init__(self):
        super().__init__()
        self.values = []

    def allreduce(self, x, op="sum"):
        self.values.append(x.clone())
        return super().allreduce(x, op)


def staged(gpu, inner=None):
    inner = inner or Recording()
    return StageEverything(inner, copies=lambda device: gpu), inner


def test_the_copies_wait_for_the_producer_and_the_consumer_for_the_copy_back():
    gpu = SimulatedGPU()
    coll, inner = staged(gpu)
    x, values = torch.zeros(6), torch.arange(6.0) - 2
    gpu.work("compute", "write x", lambda: x.copy_(values))       # queued, not run
    assert coll.allreduce(x) is x
    # the collective was handed the kernel's values: the copy waited for it
    assert torch.equal(inner.values[0], values)
    # the CPU did not wait for the copy back, so x is not written yet ...
    assert torch.equal(x, values) and gpu.ran == ["write x", "copy"]
    # ... but what the current stream runs next reads the reduced values
    read = []
    gpu.work("compute", "read x", lambda: read.append(x.clone()))
    gpu.drain("compute")
    assert torch.equal(read[0], values * 2 + 100)
    assert gpu.ran == ["write x", "copy", "copy", "read x"]


def test_the_order_of_the_calls():
    """On the current stream an event where x is complete; the side stream waits
    for it, copies down, and the CPU waits for that copy alone; the copy back is
    queued on the side stream, and the current stream, not the CPU, waits for it."""
    gpu = SimulatedGPU()
    coll, _ = staged(gpu)
    coll.allreduce(torch.ones(4))
    assert gpu.calls == [
        ("record", "compute", "e1"), ("wait", "side", "e1"),
        ("copy", "side"), ("keep", "side"),
        ("record", "side", "e2"), ("synchronize", "e2"),
        ("copy", "side"), ("keep", "side"),
        ("record", "side", "e3"), ("wait", "compute", "e3")]


def test_a_bucket_leaves_while_the_next_one_is_computed():
    """A communication stream made current (as a gradient-sync thread would) that
    waits for bucket 1's event: bucket 1 goes down to the host while bucket 2's
    kernel, queued after that event on the compute stream, has still not run."""
    gpu = SimulatedGPU(current="comm")
    coll, inner = staged(gpu)
    first, second = torch.zeros(3), torch.zeros(3)
    gpu.work("compute", "bucket 1", lambda: first.copy_(torch.tensor([1.0, 2.0, 3.0])))
    ready = gpu.record("compute")
    gpu.work("compute", "bucket 2", lambda: second.fill_(7.0))
    gpu.wait("comm", ready)
    coll.allreduce(first)
    assert torch.equal(inner.values[0], torch.tensor([1.0, 2.0, 3.0]))
    assert "bucket 2" not in gpu.ran
    gpu.drain("compute")
    gpu.drain("comm")
    assert torch.equal(first, torch.tensor([102.0, 104.0, 106.0]))
    assert torch.equal(second, torch.full((3,), 7.0))


@pytest.mark.parametrize("collective", ["broadcast", "reduce_scatter", "allgather"])
def test_every_collective_returns_values_ordered_for_the_consumer(collective):
    gpu = SimulatedGPU()
    coll, _ = staged(gpu)
    x, values = torch.zeros(5, dtype=torch.float64), torch.arange(5.0, dtype=torch.float64)
    gpu.work("compute", "write x", lambda: x.copy_(values))
    if collective == "broadcast":
        result, expected = coll.broadcast(x, root=1), values + 100
    elif collective == "reduce_scatter":
        result, expected = coll.reduce_scatter(x), (2 * values + 100)[:3]
    else:
        result, expected = coll.allgather(x), torch.cat([values, values + 100])
    gpu.drain("compute")
    assert torch.equal(result, expected)
    assert gpu.calls[-1][:2] == ("wait", "compute")             # the consumer's wait, last
