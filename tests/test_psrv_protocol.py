"""Tier (a): the wire format without processes: round trips, and every validation rule."""
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from psrv import protocol as P
from psrv.config import Consistency, OptimizerConfig, pack_config, unpack_config


def push_message(length=300_000):
    g = (np.arange(length, dtype=np.float32) + 1000).reshape(-1)
    parts = P.chunks(g)
    e = P.Entry(key=3, offset=100, length=length, shape=(length + 200,), nframes=len(parts), step=7)
    return g, P.encode(P.Op.PUSH_PULL, 2, 41, [e], payload=parts)


@pytest.mark.timeout(30)
def test_round_trip_keeps_every_field_and_byte():
    g, frames = push_message()
    assert len(frames) == 1 + 2                               # 1.2 MB in 1 MiB chunks
    assert max(memoryview(f).nbytes for f in frames) <= P.MAX_FRAME_BYTES
    msg = P.decode(frames)
    assert (msg.op, msg.sender, msg.request) == (P.Op.PUSH_PULL, 2, 41)
    (e, parts), = list(msg.entry_frames())
    assert (e.key, e.offset, e.length, e.shape, e.step, e.staleness) == (3, 100, 300_000, (300_200,), 7, -1)
    np.testing.assert_array_equal(np.concatenate([np.frombuffer(p, np.float32) for p in parts]), g)
    assert "PUSH_PULL from 2 req 41" in repr(msg) and "\n" not in repr(msg)


@pytest.mark.timeout(30)
def test_config_round_trip_and_validation():
    opt = OptimizerConfig("adam", lr=1e-3, betas=(0.8, 0.99), weight_decay=0.01)
    assert unpack_config(pack_config(opt, Consistency("ssp", 3), 4)) == (opt, Consistency("ssp", 3), 4)
    with pytest.raises(ValueError, match="optimizer name"):
        OptimizerConfig("rmsprop")
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="consistency mode"):
        Consistency("eventual")
    with pytest.raises(ValueError, match="config frame"):
        unpack_config(b"\0" * 5)


def corrupt_header(frames, offset, fmt, value):
    head = bytearray(frames[0])
    struct.pack_into(fmt, head, offset, value)
    return [bytes(head)] + frames[1:]


CASES = [  # (what, mutate(frames) -> frames, words expected in the error)
    ("empty", lambda f: [], "empty"),
    ("truncated header", lambda f: [f[0][:10]] + f[1:], "shorter than"),
    ("bad magic", lambda f: corrupt_header(f, 0, "4s", b"HTTP"), "magic"),
    ("wrong version", lambda f: corrupt_header(f, 4, "B", 9), "version 9"),
    ("unknown op", lambda f: corrupt_header(f, 5, "B", 200), "unknown op"),
    ("unknown flags", lambda f: corrupt_header(f, 6, "B", 0x80), "flags"),
    ("too many entries", lambda f: corrupt_header(f, 16, "I", 1 << 30), "num_entries"),
    ("entry count vs size", lambda f: corrupt_header(f, 16, "I", 2), "expected header"),
    ("missing frame", lambda f: f[:-1], "payload frames"),
    ("extra frame", lambda f: f + [b"xx"], "payload frames"),
    ("payload_bytes lie", lambda f: corrupt_header(f, 20, "Q", 5), "payload_bytes"),
    ("unknown dtype", lambda f: corrupt_header(f, P.HEADER.size + 4, "B", 77), "dtype"),
    ("ndim too big", lambda f: corrupt_header(f, P.HEADER.size + 5, "B", 9), "ndim"),
    ("slice outside shape", lambda f: corrupt_header(f, P.HEADER.size + 12, "Q", 10**9), "outside shape"),
    ("odd frame size", lambda f: f[:1] + [bytes(f[1])[:-1], bytes(f[2]) + b"\0"], "payload bytes"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what,mutate,words", CASES, ids=[c[0] for c in CASES])
def test_malformed_messages_are_named(what, mutate, words):
    _, frames = push_message()
    frames = [bytes(memoryview(f).cast("B")) for f in frames]
    with pytest.raises(P.ProtocolError, match=words):
        P.decode(mutate(frames))


@pytest.mark.timeout(30)
def test_abort_carries_its_reason_and_the_largest_frame_is_bounded():
    msg = P.decode(P.encode(P.Op.ABORT, 1, 3, extras=[b"RuntimeError: boom"]))
    assert (msg.op, msg.sender, bytes(msg.extras[0])) == (P.Op.ABORT, 1, b"RuntimeError: boom")
    entries = [P.Entry(k, 0, 1, (1,)) for k in range(P.MAX_ENTRIES)]
    assert len(P.encode(P.Op.PULL, 0, 1, entries)[0]) == P.MAX_FRAME_BYTES


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=5))
def test_random_frames_decode_or_raise_protocol_error(frames):
    try:
        P.decode(frames)
    except P.ProtocolError:
        pass


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 3))
def test_one_garbled_byte_decodes_or_raises_protocol_error(pos, value, which):
    _, frames = push_message(length=1000)
    frames = [bytearray(memoryview(f).cast("B")) for f in frames]
    frame = frames[min(which, len(frames) - 1)]
    if frame:
        frame[pos % len(frame)] = value
    try:
        P.decode([bytes(f) for f in frames])
    except P.ProtocolError:
        pass


@pytest.mark.timeout(30)
def test_frame_zero_alone_tells_what_frames_follow():
    """decode_head: what a reader that receives each payload frame into place needs first."""
    g, frames = push_message()
    head = P.decode_head(frames[0])
    assert (head.op, head.request, head.payload_bytes) == (P.Op.PUSH_PULL, 41, g.nbytes)
    assert [e.nframes for e in head.entries] == [2] and head.payload == []
    pull = P.encode(P.Op.PULL, 0, 1, [P.Entry(0, 0, 4, (4,), nframes=1)])
    with pytest.raises(P.ProtocolError, match="PULL carries no payload"):
        P.decode_head(pull[0])
