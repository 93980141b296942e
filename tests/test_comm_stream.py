"""The communication thread's own CUDA stream (strategies/sync/comm_thread.py), tier (a).

Checked against tests/test_cuda_staging.py's simulated GPU, whose streams run
their work only when something waits for it, here with a current stream per
thread as CUDA keeps it.  A bucket's kernel queued on the compute stream, its
event, then the next bucket's kernel: the thread must reduce the first bucket's
values without running the second's (its stream waited for the event, not for
the compute stream, and the CPU waited for neither), and what the compute
stream runs after flush must read the reduced values.  Real streams: tests/gpu/.
"""
import copy
import threading
from contextlib import contextmanager

import torch

from strategies.sync.comm_thread import CommThread
from test_cuda_paths import StageEverything
from test_cuda_staging import Recording, SimulatedGPU


class ThreadedGPU(SimulatedGPU):
    """The simulated GPU with a current stream per thread (torch.cuda.stream sets
    the calling thread's only)."""

    def __init__(self):
        super().__init__(current="compute")
        self.local = threading.local()

    def current(self):
        return getattr(self.local, "stream", self.current_stream)

    @contextmanager
    def using(self, stream):
        self.local.stream = stream
        try:
            yield
        finally:
            del self.local.stream

    def with_side(self, side):
        """The same GPU seen by another owner of a side stream (the thread's)."""
        other = copy.copy(self)
        other.side = side
        return other


def setup():
    gpu = ThreadedGPU()
    inner = Recording()
    coll = StageEverything(inner, copies=lambda device: gpu)   # the staging's side stream
    thread = CommThread("test-comm", streams=gpu.with_side("comm"))
    return gpu, coll, inner, thread


def test_a_bucket_is_reduced_after_its_event_while_the_next_is_computed():
    gpu, coll, inner, thread = setup()
    first, second = torch.zeros(3), torch.zeros(3)
    try:
        gpu.work("compute", "bucket 1", lambda: first.copy_(torch.tensor([1.0, 2.0, 3.0])))
        ready = gpu.record("compute")
        gpu.work("compute", "bucket 2", lambda: second.fill_(7.0))
        thread.submit(lambda: coll.allreduce(first), after=ready)
        thread.flush()
    finally:
        thread.close()
    assert torch.equal(inner.values[0], torch.tensor([1.0, 2.0, 3.0]))  # bucket 1's values
    assert "bucket 2" not in gpu.ran                    # the stream waited for the event only
    # the thread's stream waited for the event; the staging ordered itself on that stream;
    # the CPU waited only for the copy down (MPI reads host memory); flush: the caller's
    # stream waits for the thread's
    assert gpu.calls[1:4] == [("wait", "comm", ready), ("record", "comm", "e2"),
                              ("wait", "side", "e2")]
    assert [c for c in gpu.calls if c[0] == "synchronize"] == [("synchronize", "e3")]
    assert gpu.calls[-2:] == [("record", "comm", "e5"), ("wait", "compute", "e5")]
    read = []
    gpu.work("compute", "read bucket 1", lambda: read.append(first.clone()))
    gpu.drain("compute")
    assert torch.equal(read[0], torch.tensor([102.0, 104.0, 106.0]))
    assert torch.equal(second, torch.full((3,), 7.0))


def test_buckets_keep_the_order_submitted_each_after_its_own_event():
    gpu, coll, inner, thread = setup()
    buckets = [torch.zeros(2) for _ in range(3)]
    try:
        for i, b in enumerate(buckets):
            gpu.work("compute", f"bucket {i}", lambda b=b, i=i: b.fill_(float(i)))
            ready = gpu.record("compute")
            thread.submit(lambda b=b: coll.allreduce(b), after=ready)
        thread.flush()
    finally:
        thread.close()
    assert [v.tolist() for v in inner.values] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    gpu.drain("compute")
    assert [b.tolist() for b in buckets] == [[100.0, 100.0], [102.0, 102.0], [104.0, 104.0]]


def test_a_call_without_an_event_runs_after_the_streams_work_and_on_a_cpu_as_before():
    gpu, coll, inner, thread = setup()
    x = torch.ones(2)
    order = []
    try:
        thread.submit(lambda: coll.allreduce(x), after=gpu.record("compute"))
        thread.submit(lambda: order.append(gpu.current()))     # no event: as before
        thread.flush()
    finally:
        thread.close()
    assert order == ["compute"]                 # the thread's default stream, not its own
    # the copy back is waited for by the thread's stream; the plain call waits for that
    # stream's work, and flush's caller for the same again
    assert [c[1] for c in gpu.calls if c[0] == "wait"] == ["comm", "side", "comm",
                                                           "compute", "compute"]
    plain = CommThread("cpu")                   # no event, no stream: nothing CUDA
    try:
        plain.submit(lambda: order.append("ran"))
        plain.flush()
        assert order[-1] == "ran" and plain.streams is None
    finally:
        plain.close()


def test_a_buckets_event_comes_after_its_flat_gradient_is_made(monkeypatch):
    """ZeRO 2 and 3 keep no flat gradient: the bucket's gradients are concatenated when
    it is handed over, a kernel of its own on the compute stream.  The event the
    thread's stream waits for must follow that kernel, or the copy down may read the
    buffer before it is written (on an H200: losses off by 1e-3 from the third step)."""
    from strategies.compression.casts import make_compressor
    from strategies.sync.buckets import GradBuckets

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    made_before_event = []

    def ready(bucket):              # the flat exists once every .grad was let go
        made_before_event.append(all(p.grad is None for p in bucket.params))
        return None

    monkeypatch.setattr(GradBuckets, "_ready", staticmethod(ready))
    buckets = GradBuckets(list(model.parameters()), lambda bucket, flat: 0, cap_bytes=64,
                          compressor=make_compressor("none"), overlap=False, keep_flat=False)
    try:
        buckets.zero_()
        model(torch.ones(3, 4)).sum().backward()
        buckets.wait()
    finally:
        buckets.close()
    assert made_before_event and all(made_before_event), made_before_event
