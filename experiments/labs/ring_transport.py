"""The wire between lab 1's check and a student's rank, and `t`, the only door a
ring gets.

Each rank runs in a process of its own (experiments/labs/ring_sandbox.py) that
reaches nothing but the check, over two pipes.  `t.sendrecv` does not talk to
the neighbour: it hands the chunk to the check, which is the network.  The check
routes each message to the rank it names, refuses any but the right neighbour,
and reads what the message holds before it delivers it
(experiments/labs/ring_network.py).

A message is a fixed header and raw float64 bytes; nothing is pickled, so a
student's process cannot make the check run code of its own.

    header   magic b"RING", version, op, call, dest, source, count, recv_count
    payload  count float64 values (INPUT, SENDRECV, DELIVER, RESULT), or
             count bytes of UTF-8 text (SOURCE, RAISED, REFUSED)
"""
import enum
import os
import struct

import numpy as np

MAGIC, VERSION = b"RING", 1
HEADER = struct.Struct("<4sBBxxiiiqq")
MAX_ELEMENTS = 1 << 24           # no message of the check is longer (128 MiB)
MAX_TEXT = 1 << 20


class Op(enum.IntEnum):
    # check -> rank
    SOURCE = 1        # the student's file, as text, and its path (recv_count: path length)
    INPUT = 2         # this rank's vector for one all-reduce
    DELIVER = 3       # what arrived from the left, for the pending sendrecv
    QUIT = 4
    # rank -> check
    LOADED = 10       # the file loaded; count: 1 if it defines ring_allreduce
    SENDRECV = 11     # call, dest, source, count (sent), recv_count; the sent values
    RESULT = 12       # what ring_allreduce returned
    RAISED = 13       # the ring (or the file's loading) raised: the student's traceback
    REFUSED = 14      # the sandbox refused something: what, in words


class CheckQuit(BaseException):
    """The check has its verdict and stops this rank (not an error of the ring's)."""


class WireError(Exception):
    """Bytes on a pipe that are not a message of this wire."""


class Message:
    """One decoded message: op, call, dest, source, recv_count, and its payload
    (float64 array or text)."""
    __slots__ = ("op", "call", "dest", "source", "recv_count", "payload")

    def __init__(self, op, call=0, dest=-1, source=-1, recv_count=0, payload=None):
        self.op, self.call, self.dest, self.source = op, call, dest, source
        self.recv_count, self.payload = recv_count, payload

    def __repr__(self):
        size = len(self.payload) if self.payload is not None else 0
        return (f"<{self.op.name} call={self.call} dest={self.dest} source={self.source} "
                f"payload={size} recv_count={self.recv_count}>")


TEXT_OPS = {Op.SOURCE, Op.RAISED, Op.REFUSED}


def encode(op, payload=None, call=0, dest=-1, source=-1, recv_count=0):
    """Header and payload bytes (payload: a float64 array, text or None)."""
    if payload is None:
        data, count = b"", 0
    elif isinstance(payload, str):
        data = payload.encode("utf-8", "replace")
        count = len(data)
    else:
        data = memoryview(np.ascontiguousarray(payload, dtype=np.float64)).cast("B")
        count = len(data) // 8
    return HEADER.pack(MAGIC, VERSION, op, call, dest, source, count, recv_count), data


def write(fd, op, payload=None, **fields):
    head, data = encode(op, payload, **fields)
    _write_all(fd, head)
    _write_all(fd, data)


def _write_all(fd, data):
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd, size, into=None):
    """`size` bytes from fd (into the writable buffer `into` if given); None at EOF."""
    buf = memoryview(into).cast("B") if into is not None else memoryview(bytearray(size))
    got = 0
    while got < size:
        n = os.readv(fd, [buf[got:size]])
        if n == 0:
            return None
        got += n
    return buf


def read(fd, into=None):
    """The next Message on fd, None at EOF.  A float64 payload lands in `into`
    when given (it must be exactly as long), else in a new array."""
    head = read_exact(fd, HEADER.size)
    if head is None:
        return None
    magic, version, op, call, dest, source, count, recv_count = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise WireError(f"bytes that are not a lab message (they start {bytes(head[:8])!r})")
    try:
        op = Op(op)
    except ValueError:
        raise WireError(f"a message with an unknown op {op}") from None
    limit = MAX_TEXT if op in TEXT_OPS else MAX_ELEMENTS
    if not 0 <= count <= limit or not 0 <= recv_count <= max(MAX_ELEMENTS, MAX_TEXT):
        raise WireError(f"a {op.name} message of {count} items, more than the wire allows")
    if op in TEXT_OPS:
        data = read_exact(fd, count)
        payload = None if data is None else bytes(data).decode("utf-8", "replace")
    else:
        if into is not None and len(into) != count:
            raise WireError(f"{count} values for a buffer of {len(into)}")
        array = into if into is not None else np.empty(count, np.float64)
        payload = array if read_exact(fd, count * 8, array) is not None else None
    if payload is None and count:
        return None
    return Message(op, call, dest, source, recv_count, payload)


class LabTransport:
    """t: rank, size and sendrecv, nothing else.  Each sendrecv goes to the check,
    which delivers the message to `dest` and sends back what `source` sent."""

    def __init__(self, rank, size, to_check, from_check, on_call=None):
        self.rank, self.size = rank, size
        self._to, self._from, self._on_call = to_check, from_check, on_call
        self.calls = 0

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        """Send sendbuf to rank dest while receiving recvbuf from rank source."""
        self.calls += 1
        for name, buf in (("sendbuf", sendbuf), ("recvbuf", recvbuf)):
            if not (isinstance(buf, np.ndarray) and buf.ndim == 1 and buf.flags.c_contiguous
                    and buf.dtype == np.float64):
                raise TypeError(f"t.sendrecv: {name} must be a 1-D float64 numpy array such as "
                                f"x[a:b], got {type(buf).__name__} {getattr(buf, 'dtype', '')}")
        if not recvbuf.flags.writeable:
            raise ValueError("t.sendrecv: recvbuf is read-only")
        for name, peer in (("dest", dest), ("source", source)):
            if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.size):
                raise ValueError(f"t.sendrecv: {name}={peer!r} is not a rank (0..{self.size - 1})")
        if self._on_call:
            self._on_call(True)
        write(self._to, Op.SENDRECV, sendbuf, call=self.calls, dest=int(dest),
              source=int(source), recv_count=recvbuf.size)
        reply = read(self._from, into=recvbuf)
        if reply is None or reply.op == Op.QUIT:
            raise CheckQuit()
        if self._on_call:
            self._on_call(False)

    def __getattr__(self, name):
        raise AttributeError(f"the lab's transport has no {name!r}: a ring needs only "
                             f"t.rank, t.size and t.sendrecv")
