"""A live server fed random, garbled and truncated messages keeps serving everyone else.

After each bad message we send a valid STATS request on the same connection;
ZeroMQ keeps one connection's messages in order, so every reply before the STATS
reply answers the bad message: it must be a well-formed ERROR (or a valid reply,
if the garbling happened to produce a valid request).  Nothing is waited for
that may never come.

A connection speaks for one worker id (the server ties them together), so the
raw sockets speak for workers 1 and 2 of W=3; the real client is worker 0.
"""
import struct

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

import psrv
from psrv import protocol as P

SHAPES = {"w": (40, 30), "b": (30,)}


W = 3
FUZZER, PROBER = 1, 2          # the worker ids the two raw sockets speak for


@pytest.fixture(scope="module")
def live():
    # W=3 with a long worker timeout: workers 1 and 2 are raw sockets, so a garbled
    # BYE cannot end the server, and nobody is declared dead
    with psrv.launch.start_local_servers(1, worker_timeout=600) as servers:
        client = psrv.Client(servers.endpoints, 0, W, timeout=10,
                             consistency=psrv.Consistency("asp"))
        params = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s) for n, s in SHAPES.items()}
        client.init(params, psrv.OptimizerConfig("sgd", lr=0.1))
        ctx = zmq.Context()
        raws = {}
        for worker in (FUZZER, PROBER):
            raw = raws[worker] = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(servers.endpoints[0])
            exchange(raw, [], worker)        # a first STATS ties the connection to its worker
        yield servers, client, raws, params
        client.close()
        for raw in raws.values():
            raw.close()
        ctx.term()


def valid_messages(client, params, worker=FUZZER):
    """A valid INIT, PULL and PUSH_PULL from worker, and fp8 and top-k pushes of the
    first key (protocol.py's codes 7 and 8), as frame lists of bytes."""
    from psrv.config import pack_config
    sl = client.placement.slices
    entries, payload = client._entries(sl, params, step=0)
    grads = client._entries(sl, params, step=10**6)
    cfg = pack_config(psrv.OptimizerConfig("sgd", lr=0.1), psrv.Consistency("asp"), W)
    names = "\n".join(s.name for s in sl).encode()
    first = sl[0]
    fp8 = P.compressed_payload(P.FP8, np.arange(first.length) % 100, 4.0)
    topk = P.compressed_payload(P.TOPK, [0, first.length - 1], [0.5, -0.25])
    msgs = [P.encode(P.Op.INIT, worker, 9, entries, [cfg, names], payload),
            P.encode(P.Op.PULL, worker, 9, client._entries(sl, {}, 0)[0]),
            P.encode(P.Op.PUSH_PULL, worker, 9, *grads[:1], payload=grads[1]),
            compressed_push(first, P.FP8, 0, fp8, worker),
            compressed_push(first, P.TOPK, 0, topk, worker)]
    return [[bytes(memoryview(f).cast("B")) for f in m] for m in msgs]


def compressed_push(sl, dtype, param, payload, worker, step=0):
    """A PUSH of slice `sl`'s gradient encoded as `dtype` (protocol.py's table)."""
    parts = P.chunks(payload)
    entry = P.Entry(sl.key, sl.offset, sl.length, sl.shape, dtype=dtype, nframes=len(parts),
                    step=step, param=param)
    return P.encode(P.Op.PUSH, worker, 6, [entry], payload=parts)


def exchange(raw, frames, worker, timeout_ms=10_000):
    """Send frames, then STATS; return the decoded replies that came before the STATS reply
    (which is an ERROR once a garbled BYE closed the worker)."""
    if frames:
        raw.send_multipart(frames)
    raw.send_multipart(P.encode(P.Op.STATS, worker, 424242))
    replies = []
    while True:
        assert raw.poll(timeout_ms), "server stopped answering"
        msg = P.decode(raw.recv_multipart())          # must be well-formed
        if msg.request == 424242 and msg.op in (P.Op.STATS_REPLY, P.Op.ERROR):
            return replies
        replies.append(msg)


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_garbled_frames_never_crash_the_server(live, data):
    servers, client, raws, params = live
    kind = data.draw(st.sampled_from(["random", "flip", "truncate", "drop", "header"]))
    base = data.draw(st.sampled_from(valid_messages(client, params)))
    if kind == "random":
        frames = data.draw(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
    elif kind == "flip":
        i = data.draw(st.integers(0, len(base) - 1))
        f = bytearray(base[i])
        if f:
            f[data.draw(st.integers(0, len(f) - 1))] = data.draw(st.integers(0, 255))
        frames = base[:i] + [bytes(f)] + base[i + 1:]
    elif kind == "truncate":
        i = data.draw(st.integers(0, len(base) - 1))
        frames = base[:i] + [base[i][:data.draw(st.integers(0, max(0, len(base[i]) - 1)))]] + base[i + 1:]
    elif kind == "drop":
        frames = base[:-1] or [b""]
    else:   # a well-formed header whose fields lie
        field = data.draw(st.sampled_from([(5, "B"), (8, "I"), (16, "I"), (20, "Q")]))
        head = bytearray(base[0])
        struct.pack_into("<" + field[1], head, field[0],
                         data.draw(st.integers(0, 2 ** (8 * struct.calcsize(field[1])) - 1)))
        frames = [bytes(head)] + base[1:]
    for msg in exchange(raws[FUZZER], frames or [b""], FUZZER):
        assert msg.op in (P.Op.ERROR, P.Op.OK, P.Op.VALUES), msg
        if msg.op == P.Op.ERROR:
            assert bytes(msg.extras[0]).decode()       # names the problem


@pytest.mark.timeout(60)
def test_semantic_errors_are_named_and_others_still_served(live):
    servers, client, raws, params = live
    raw = raws[PROBER]
    sl = client.placement.slices[0]
    good = P.Entry(sl.key, sl.offset, sl.length, sl.shape)
    cases = [
        (P.Entry(999, 0, 4, (4,)), "unknown key 999"),
        (P.Entry(sl.key, sl.offset, sl.length, sl.shape, dtype=1), "dtype"),
        (P.Entry(sl.key, 0, 1, sl.shape), "message says"),
    ]
    for entry, words in cases:
        (reply,) = exchange(raw, P.encode(P.Op.PULL, PROBER, 5, [entry]), PROBER)
        assert reply.op == P.Op.ERROR and words in bytes(reply.extras[0]).decode()
    (reply,) = exchange(raw, P.encode(P.Op.PULL, 7, 5, [good]), PROBER)
    assert "not a worker id" in bytes(reply.extras[0]).decode()
    (reply,) = exchange(raw, P.encode(P.Op.PULL, 0, 5, [good]), PROBER)   # worker 0's id
    assert "speaks for worker 2, not worker 0" in bytes(reply.extras[0]).decode()
    (reply,) = exchange(raw, P.encode(P.Op.OK, PROBER, 5, extras=[b"hello"]), PROBER)
    assert "reply, not a request" in bytes(reply.extras[0]).decode()
    # the server logged the refusals and still serves the real worker
    out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
    for name in SHAPES:
        client.pull(name, out[name])
    assert servers.procs[0].poll() is None
    assert "refused a message" in servers.log(0)


@pytest.mark.timeout(60)
def test_malformed_compressed_pushes_are_refused_and_others_still_served(live):
    """A compressed push whose values break its encoding (tests/test_ps_compress.py has
    every case against the decoder) is an ERROR naming it, nothing applied; the same
    worker's well-formed push of that step is then taken."""
    servers, client, raws, params = live
    raw, sl = raws[PROBER], client.placement.slices[0]
    n = sl.length
    rows, cols = P.matrix_shape(n)
    cases = [
        (P.FP8, 0, P.compressed_payload(P.FP8, np.zeros(n), np.nan), "fp8 scale nan"),
        (P.FP8, 0, P.compressed_payload(P.FP8, np.zeros(n), 0.0), "fp8 scale 0.0"),
        (P.TOPK, 0, P.compressed_payload(P.TOPK, [1, n], [1.0, 1.0]), "outside the slice"),
        (P.TOPK, 0, P.compressed_payload(P.TOPK, [4, 4], [1.0, 1.0]), "named twice"),
        (P.TOPK, 0, P.compressed_payload(P.TOPK, np.arange(n + 1) % n, np.ones(n + 1)),
         "payload bytes"),
        (P.POWERSGD, min(rows, cols) + 1, np.zeros(4, "<f4"), "does not fit"),
        (P.POWERSGD, 1, np.zeros(rows + cols + 1, "<f4"), "payload bytes"),
        # a NaN among the values: the server's finite check (store.check_finite)
        (P.TOPK, 0, P.compressed_payload(P.TOPK, [2], [np.nan]), "NaN or inf"),
    ]
    for dtype, param, payload, words in cases:
        (reply,) = exchange(raw, compressed_push(sl, dtype, param, payload, PROBER), PROBER)
        assert reply.op == P.Op.ERROR and words in bytes(reply.extras[0]).decode(), \
            (words, reply)
    good = P.compressed_payload(P.TOPK, [0, 3], [1.0, -1.0])
    (reply,) = exchange(raw, compressed_push(sl, P.TOPK, 0, good, PROBER), PROBER)
    assert reply.op == P.Op.OK, bytes(reply.extras[0])
    out = {name: np.empty(s, np.float32) for name, s in SHAPES.items()}
    for name in SHAPES:
        client.pull(name, out[name])
    assert servers.procs[0].poll() is None
