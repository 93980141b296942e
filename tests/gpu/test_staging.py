"""GPU tier (a): the host staging's copies on real CUDA streams (allreduce.staging).

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  One process, a stand-in
collective (tests/test_cuda_paths.py), real streams and events: the stream
that writes the input is kept busy (torch.cuda._sleep) so that a copy that did
not wait for it would read the values from before.  The order itself is
checked everywhere, against a simulated GPU (tests/test_cuda_staging.py).
"""
import pytest

from test_cuda_paths import StandIn

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no GPU: torch.cuda.is_available() is False")
BUSY_CYCLES = 50_000_000            # some tens of milliseconds of a GPU's clock


def busy_then_write(x, values):
    """On the current stream: a long wait, then x = values (both queued, not done)."""
    torch.cuda._sleep(BUSY_CYCLES)
    x.copy_(values, non_blocking=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "reduce_scatter", "allgather"])
def test_staged_values_are_the_producers_and_reach_the_consumer(collective):
    import allreduce
    coll = allreduce.host_staged(StandIn())
    values = torch.arange(1 << 20, dtype=torch.float32).remainder(977).cuda()
    x = torch.zeros_like(values)
    busy_then_write(x, values)
    if collective == "allreduce":
        result, expected = coll.allreduce(x), values * 2 + 100
    elif collective == "broadcast":
        result, expected = coll.broadcast(x, root=1), values + 100
    elif collective == "reduce_scatter":
        result, expected = coll.reduce_scatter(x), (values * 2 + 100)[: (values.numel() + 1) // 2]
    else:
        result, expected = coll.allgather(x), torch.cat([values, values + 100])
    assert result.is_cuda and torch.equal(result, expected)   # read on the current stream


@pytest.mark.timeout(120)
def test_buckets_staged_from_a_communication_stream_keep_their_order():
    """A gradient-sync thread's pattern: a stream of its own, waiting for each
    bucket's event; the compute stream goes on with the next bucket meanwhile."""
    import allreduce
    coll = allreduce.host_staged(StandIn())
    comm = torch.cuda.Stream()
    buckets = [torch.zeros(1 << 18, device="cuda") for _ in range(4)]
    events = []
    for i, b in enumerate(buckets):
        busy_then_write(b, torch.full_like(b, float(i)))
        events.append(torch.cuda.current_stream().record_event())
    with torch.cuda.stream(comm):
        for b, ready in zip(buckets, events):
            comm.wait_event(ready)
            coll.allreduce(b)
    torch.cuda.current_stream().wait_stream(comm)
    for i, b in enumerate(buckets):
        assert torch.equal(b, torch.full_like(b, 2.0 * i + 100))


@pytest.mark.timeout(120)
def test_the_comm_threads_stream_waits_for_each_buckets_event():
    """The same through strategies' CommThread: submit(call, after=event) from the
    main thread, which neither waits for the kernels nor for the thread; flush makes
    the main stream wait for the thread's."""
    import allreduce
    from strategies.sync.comm_thread import CommThread
    coll = allreduce.host_staged(StandIn())
    buckets = [torch.zeros(1 << 18, device="cuda") for _ in range(4)]
    thread = CommThread("gpu-test")
    try:
        for i, b in enumerate(buckets):
            busy_then_write(b, torch.full_like(b, float(i)))
            thread.submit(lambda b=b: coll.allreduce(b),
                          after=torch.cuda.current_stream().record_event())
        thread.flush()
    finally:
        thread.close()
    assert thread.streams.side != torch.cuda.current_stream()
    for i, b in enumerate(buckets):
        assert torch.equal(b, torch.full_like(b, 2.0 * i + 100))

