"""The wire format of psrv: the one place it is written down.

A message is one ZeroMQ multipart message (after the ROUTER's identity frame):

    frame 0          HEADER, then num_entries ENTRY records, nothing else
    extra frames     how many depends on the op (EXTRA_FRAMES): INIT carries the
                     config struct and the parameter names, and with flag GROUP a
                     third, the int32 worker ids that push its keys (its group:
                     a pipeline stage's or a tp rank's data-parallel replicas; without
                     it every one of the W workers); ERROR a utf-8 text;
                     STATS_REPLY an int64 array of (staleness, count) pairs;
                     CHECKPOINT the step to save as one int64 (CHECKPOINT_STEP; -1:
                     the shard's own file, not a step of a set: checkpoints.py)
    payload frames   raw little-endian array bytes, entry after entry, each entry
                     in `nframes` chunks (~1 MiB: ZeroMQ moves 1-4 MiB frames at
                     3-4 GB/s here and one 64 MiB frame at 1.5 GB/s), sent zero-copy

    HEADER <4s B B B B I I I Q   (28 bytes)
        magic b"TLPS", version, op, flags (GROUP on an INIT, else 0), reserved=0,
        sender (worker id, or shard id in replies), request id (echoed in the reply),
        num_entries, payload_bytes (sum of the payload frames' sizes)

    ENTRY  <I B B H I Q Q q q i 4I   (64 bytes), one per key slice
        key, dtype code (DTYPES), ndim, param (PowerSGD's rank r; else 0), nframes,
        offset, length (elements of the slice),
        step (the worker's clock for this key in a push; its clock in a reply),
        version (updates applied to the values in a reply),
        staleness (of the update this request applied; -1 if none),
        shape (the whole parameter's shape, ndim <= 4, the rest 0)

A push's payload: how a slice of L float32 gradients travels, by the entry's dtype
code.  The server turns each into a dense float32 slice (to_float32) before it sums
and steps, exactly as for a float32 push; pulls and INIT's values are float32.
Compressed pushes are BytePS's (Jiang et al., OSDI 2020): compressed from the worker
to the server, decompressed there, so each worker's own encoding is added in float32.

    code  encoding  the payload, back to back                          bytes
    0     FLOAT32   L float32                                          4L
    2     FLOAT16   L float16                                          2L
    6     BFLOAT16  L bfloat16 (the upper 16 bits of each float32)     2L
    7     FP8       L e4m3 bytes q | the slice's scale s as float32:   L + 4
                    x = e4m3(q) / s, s finite and > 0 (FP8 Formats
                    for Deep Learning, Micikevicius et al. 2022)
    8     TOPK      k int32 indices | k float32 values: x = 0 but      8k
                    x[index] = value; 1 <= k <= L, indices distinct,
                    in [0, L)
    9     POWERSGD  P (n x r) | Q (m x r), float32, row-major: x = the  4r(n + m)
                    first L entries of P Qᵀ read row by row, with
                    (n, m) = matrix_shape(L) (n = ceil(sqrt L), m =
                    ceil(L / n), the slice zero-padded to n x m), r the
                    entry's param, 1 <= r <= min(n, m) (Vogels et al.,
                    NeurIPS 2019)

Nothing is pickled or evaluated.  `decode` checks every structural field and
raises ProtocolError naming the first bad one; it never allocates from a number
a header claims, only views the frames that actually arrived.  Whether a key
exists and has that shape is the server's check (store.py).  No frame is larger
than MAX_FRAME_BYTES (the servers set it as ZeroMQ's MAXMSGSIZE), and no payload
entry has more frames than `most_frames` of its slice (the server's check, once it
knows its keys).  Neither bounds a message before it has arrived: libzmq hands a
multipart message over only once its last frame is in, and counts whole messages
(RCVHWM) and single frames (MAXMSGSIZE), never a message's frames.

Connections: a worker has two sockets to each server, whose ZeroMQ routing
ids are twins: b"w" + 15 random bytes for its requests (fixed, so a reconnect
after a network blip is the same connection to the server) and b"h" + the same
15 bytes for its HEARTBEATs (routing_ids).  Without keys (on loopback) a
heartbeat refreshes worker w only when it comes from the twin of the connection
that registered w (request_twin), so no other local process can keep a dead
worker alive; with keys the client key says who speaks.

Authentication and encryption are not in the format: they are ZeroMQ's CURVE
(auth.py), below it, so a message that reaches `decode` on an authenticated
server came from a known key over a connection no one else can write to.
"""
import math
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

MAGIC = b"TLPS"
VERSION = 5     # 2: no HMAC flag; ABORT.  3: CHECKPOINT names its step.  4: INIT's GROUP.
                # 5: compressed pushes (FP8, TOPK, POWERSGD) and the entry's param
HEADER = struct.Struct("<4sBBBBIIIQ")
ENTRY = struct.Struct("<IBBHIQQqqi4I")
CHUNK_BYTES = 1 << 20
MAX_ENTRIES = 1 << 16
MAX_NDIM = 4
MAX_ELEMENTS = 1 << 34            # one parameter: 64 GiB of float32 at most
MAX_TEXT = 4096                   # ERROR/ABORT text and, x256, the INIT names frame
# the largest legal frame: frame 0 with MAX_ENTRIES entries (4 MiB + 28 B); payload
# chunks are CHUNK_BYTES, the INIT names frame 256 * MAX_TEXT
MAX_FRAME_BYTES = max(HEADER.size + MAX_ENTRIES * ENTRY.size, CHUNK_BYTES, 256 * MAX_TEXT)


class Op(IntEnum):
    INIT = 1          # entries (+ worker 0's values): declare keys, set config
    PUSH = 2          # entries + gradients; reply OK once recorded
    PULL = 3          # entries; reply VALUES when the consistency model allows
    PUSH_PULL = 4     # entries + gradients; reply VALUES with the updated values
    HEARTBEAT = 5     # no reply: "I am alive" while the worker computes
    BYE = 6           # the worker finished cleanly; reply OK
    STATS = 7         # reply STATS_REPLY: histogram of applied-update staleness
    CHECKPOINT = 8    # the step to save (CHECKPOINT_STEP); reply OK with the file written
    ABORT = 9         # the worker stops on an error (its text): a crash, not a finish; reply OK
    OK = 64
    VALUES = 65
    ERROR = 66
    STATS_REPLY = 67


_OPS = {int(op): op for op in Op}     # code -> Op without Enum's slower call
EXTRA_FRAMES = {Op.INIT: 2, Op.ERROR: 1, Op.STATS_REPLY: 1, Op.OK: 1, Op.ABORT: 1,
                Op.CHECKPOINT: 1}
GROUP = 1                         # flag: an INIT names the workers that push its keys
MAX_GROUP = 1 << 16               # worker ids in a GROUP frame (MAX_WORKERS's order)
CHECKPOINT_STEP = struct.Struct("<q")      # -1: the shard's own file; else a set's step
CARRIES_PAYLOAD = {Op.INIT, Op.PUSH, Op.PUSH_PULL, Op.VALUES}

# The dtype table: the order is the contract.  The server stores float32 only; a push
# may carry a gradient in 16 bits (FLOAT16, or BFLOAT16: bfloat16's bits as <u2) or
# compressed (codes 7-9, the table above; their entry here is the size every payload
# frame is a multiple of), which it turns into float32 on arrival, before it sums or
# applies it (to_float32).
DTYPES = (np.dtype("<f4"), np.dtype("<f8"), np.dtype("<f2"), np.dtype("<i4"),
          np.dtype("<i8"), np.dtype("u1"), np.dtype("<u2"),
          np.dtype("u1"), np.dtype("<i4"), np.dtype("<f4"))
FLOAT32, FLOAT16, BFLOAT16 = 0, 2, 6
FP8, TOPK, POWERSGD = 7, 8, 9
WIRE_DTYPES = {"fp32": FLOAT32, "fp16": FLOAT16, "bf16": BFLOAT16}   # a push's casts
COMPRESSED = {"fp8": FP8, "topk": TOPK, "powersgd": POWERSGD}          # and encodings
PUSH_DTYPES = (*WIRE_DTYPES.values(), *COMPRESSED.values())


class ProtocolError(ValueError):
    """A message that breaks the format; the text names the field."""


@dataclass
class Entry:
    key: int
    offset: int
    length: int
    shape: tuple = ()
    dtype: int = FLOAT32
    nframes: int = 0
    step: int = 0
    version: int = 0
    staleness: int = -1
    param: int = 0        # POWERSGD: the rank of the factors

    def __repr__(self):
        return f"k{self.key}[{self.offset}:{self.offset + self.length}]@{self.step}"


@dataclass
class Message:
    op: Op
    sender: int
    request: int
    entries: list
    extras: list          # buffers
    payload: list         # buffers, entry after entry
    flags: int = 0
    payload_bytes: int = 0

    def __repr__(self):
        nbytes = sum(len(memoryview(p)) for p in self.payload)
        keys = " ".join(map(repr, self.entries[:4])) + (" ..." if len(self.entries) > 4 else "")
        return (f"<{self.op.name} from {self.sender} req {self.request} [{keys}] "
                f"{nbytes} B in {len(self.payload)} frames>")

    def entry_frames(self):
        """Yield (entry, [its payload frames]) in order."""
        at = 0
        for e in self.entries:
            yield e, self.payload[at:at + e.nframes]
            at += e.nframes


def chunks(flat, chunk_bytes=CHUNK_BYTES):
    """Split a 1-D array into views of about chunk_bytes (no copy)."""
    step = max(1, chunk_bytes // flat.itemsize)
    return [flat[i:i + step] for i in range(0, len(flat), step)] or [flat[:0]]


def matrix_shape(length):
    """(n, m): a POWERSGD slice of `length` elements seen as a matrix, as near square as
    whole rows allow (n = ceil(sqrt L), m = ceil(L / n), n m - L < n zeros of padding);
    a square's rank-r factors cost 2 r sqrt(L) floats, the least for L elements."""
    n = math.isqrt(length - 1) + 1 if length > 0 else 0
    return n, -(-length // n) if n else 0


def largest_payload(length, dtype=FLOAT32, param=0):
    """The most bytes a payload entry of `length` elements of `dtype` may carry."""
    if dtype == FP8:
        return length + 4
    if dtype == TOPK:
        return 8 * length
    if dtype == POWERSGD:
        return 4 * param * sum(matrix_shape(length))
    return length * DTYPES[dtype].itemsize


def payload_fits(entry, nbytes):
    """Whether `nbytes` of payload are what `entry`'s encoding carries for its slice."""
    if entry.dtype == TOPK:        # k pairs, k from the bytes
        return nbytes % 8 == 0 and 0 < nbytes <= 8 * entry.length
    return nbytes == largest_payload(entry.length, entry.dtype, entry.param)


def most_frames(length, dtype=FLOAT32, param=0):
    """The frames `chunks` cuts the largest payload of `length` elements of `dtype` into:
    the most a payload entry of that slice may have.  A receiver that knows its keys (a
    configured shard) refuses more: each frame costs libzmq a message of its own, so
    4-byte frames would make a 4 MiB key cost 64 MiB of bookkeeping."""
    per_frame = max(1, CHUNK_BYTES // DTYPES[dtype].itemsize) * DTYPES[dtype].itemsize
    return max(1, -(-largest_payload(length, dtype, param) // per_frame))


def encode(op, sender, request, entries=(), extras=(), payload=(), flags=0):
    """-> list of frames.  Entries' nframes must already count their payload frames."""
    payload = list(payload)
    body = [ENTRY.pack(e.key, e.dtype, len(e.shape), e.param, e.nframes, e.offset, e.length,
                       e.step, e.version, e.staleness, *(tuple(e.shape) + (0,) * (4 - len(e.shape))))
            for e in entries]
    nbytes = sum(memoryview(p).nbytes for p in payload)
    head = HEADER.pack(MAGIC, VERSION, int(op), flags, 0, sender, request, len(body), nbytes)
    return [head + b"".join(body), *extras, *payload]


def decode_head(frame0):
    """Frame 0 alone -> Message without extras or payload (they have not been read yet),
    with `payload_bytes` set; ProtocolError naming what is wrong.  A reader that places
    payload frames itself (recv_into) checks each against the entries."""
    buf = memoryview(frame0)
    if buf.nbytes < HEADER.size:
        raise ProtocolError(f"frame 0 is {buf.nbytes} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, op, flags, reserved, sender, request, n, nbytes = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this server speaks {VERSION}")
    if op not in _OPS:
        raise ProtocolError(f"unknown op {op}")
    if reserved or flags & ~GROUP or (flags and op != Op.INIT):
        raise ProtocolError(f"unknown flags {flags:#x} for op {op} or reserved byte {reserved}")
    if n > MAX_ENTRIES:
        raise ProtocolError(f"num_entries {n} above the limit {MAX_ENTRIES}")
    if buf.nbytes != HEADER.size + n * ENTRY.size:
        raise ProtocolError(f"frame 0 is {buf.nbytes} bytes, expected header + {n} entries = "
                            f"{HEADER.size + n * ENTRY.size}")
    op = _OPS[op]
    entries = [_entry(buf, HEADER.size + i * ENTRY.size, i) for i in range(n)]
    if op not in CARRIES_PAYLOAD and any(e.nframes for e in entries):
        raise ProtocolError(f"{op.name} carries no payload, entries announce "
                            f"{sum(e.nframes for e in entries)} frames")
    return Message(op, sender, request, entries, [], [], flags=flags, payload_bytes=nbytes)


def decode(frames):
    """list of buffers (bytes, zmq.Frame, memoryview) -> Message, or ProtocolError naming
    what is wrong.  The payload stays in the frames: views, no copy."""
    if not frames:
        raise ProtocolError("empty message")
    bufs = [memoryview(f) for f in frames]
    msg = decode_head(bufs[0])
    extra = EXTRA_FRAMES.get(msg.op, 0) + (msg.flags & GROUP)
    if len(bufs) < 1 + extra:
        raise ProtocolError(f"{msg.op.name} needs {extra} extra frames, message has {len(bufs) - 1}")
    msg.extras, msg.payload = bufs[1:1 + extra], bufs[1 + extra:]
    want = sum(e.nframes for e in msg.entries)
    if len(msg.payload) != want:
        raise ProtocolError(f"entries announce {want} payload frames, message has {len(msg.payload)}")
    got = sum(p.nbytes for p in msg.payload)
    if got != msg.payload_bytes:
        raise ProtocolError(f"payload_bytes {msg.payload_bytes} != {got} received")
    for e, parts in msg.entry_frames():
        size = DTYPES[e.dtype].itemsize
        got = sum(p.nbytes for p in parts)
        if parts and (not payload_fits(e, got) or any(p.nbytes % size for p in parts)):
            raise ProtocolError(f"key {e.key}: {got} payload bytes in {len(parts)} frames for "
                                f"{e.length} elements of dtype code {e.dtype}")
    return msg


def to_wire(flat, dtype):
    """A float32 slice as a push of `dtype` carries it (a copy, unless float32).  bfloat16
    rounds to nearest, ties to even, as torch's cast does: the upper 16 bits of
    x + 0x7FFF + (bit 16 of x)."""
    if dtype == FLOAT32:
        return flat
    if dtype == FLOAT16:
        return flat.astype("<f2")
    bits = flat.view("<u4").astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def to_float32(entry, frames):
    """A pushed entry's frames as float32 arrays: views where they are float32 already,
    widened copies of 16-bit ones (exact: every fp16 and bf16 value is a float32), and
    a compressed one decoded into one dense slice (the table in the docstring).  A
    compressed payload whose values break its encoding (an index out of range or twice,
    a scale that is not finite and positive) is a ProtocolError.  Call it once the
    entry's slice is known to be the key's (store.check_entry): a dense slice is as
    large as the key, never as a header claims."""
    if entry.dtype == FLOAT32:
        return [np.frombuffer(f, np.float32) for f in frames]
    if entry.dtype == FLOAT16:
        return [np.frombuffer(f, "<f2").astype(np.float32) for f in frames]
    if entry.dtype == BFLOAT16:
        return [(np.frombuffer(f, "<u2").astype(np.uint32) << 16).view(np.float32)
                for f in frames]
    if not frames:
        return []
    payload = np.frombuffer(frames[0], np.uint8) if len(frames) == 1 else \
        np.concatenate([np.frombuffer(f, np.uint8) for f in frames])
    length, where = entry.length, f"key {entry.key}"
    if entry.dtype == FP8:
        scale = payload[length:].view("<f4")[0]
        if not (np.isfinite(scale) and scale > 0):
            raise ProtocolError(f"{where}: fp8 scale {scale}, not a finite number > 0")
        return [E4M3[payload[:length]] / scale]
    if entry.dtype == TOPK:
        k = len(payload) // 8
        indices = payload[:4 * k].view("<i4")
        if len(indices) and (indices.min() < 0 or indices.max() >= length):
            raise ProtocolError(f"{where}: a top-k index outside the slice's [0, {length})")
        if len(np.unique(indices)) != k:
            raise ProtocolError(f"{where}: a top-k index named twice")
        dense = np.zeros(length, np.float32)
        dense[indices] = payload[4 * k:].view("<f4")
        return [dense]
    n, m = matrix_shape(length)
    r = entry.param
    factors = payload.view("<f4")
    p, q = factors[:n * r].reshape(n, r), factors[n * r:].reshape(m, r)
    return [(p @ q.T).reshape(-1)[:length]]


def compressed_payload(dtype, *parts):
    """The payload of a compressed push as one byte array, its parts in the table's order:
    FP8 (e4m3 bytes as uint8, scale), TOPK (indices, values), POWERSGD (P, Q)."""
    if dtype == FP8:
        q, scale = parts
        parts = (np.asarray(q, np.uint8), np.array([scale], "<f4"))
    elif dtype == TOPK:
        indices, values = parts
        parts = (np.asarray(indices, "<i4"), np.asarray(values, "<f4"))
    elif dtype == POWERSGD:
        parts = tuple(np.asarray(f, "<f4") for f in parts)
    else:
        raise ValueError(f"dtype code {dtype} is not a compressed push")
    return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in parts])


def _e4m3_table():
    """float32 of each of the 256 e4m3 bytes (the fn variant: no infinities, S.1111.111
    is NaN): sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 subnormal."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                         (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    table = (sign * magnitude).astype(np.float32)
    table[(b & 0x7F) == 0x7F] = np.nan
    return table


E4M3 = _e4m3_table()


def group_of(msg):
    """An INIT's group: the sorted worker ids that push its keys (a tuple), or None
    (no GROUP flag: all W workers); ProtocolError for a frame that is not one."""
    if not msg.flags & GROUP:
        return None
    frame = msg.extras[2]
    if frame.nbytes % 4 or not 0 < frame.nbytes // 4 <= MAX_GROUP:
        raise ProtocolError(f"GROUP frame of {frame.nbytes} bytes: 1 to {MAX_GROUP} int32 ids")
    ids = np.frombuffer(frame, "<i4")
    if (ids < 0).any() or len(set(ids.tolist())) != len(ids):
        raise ProtocolError("GROUP names a negative or a repeated worker id")
    return tuple(sorted(ids.tolist()))


def _entry(buf, at, i):
    key, dtype, ndim, param, nframes, offset, length, step, version, stale, *shape = \
        ENTRY.unpack_from(buf, at)
    where = f"entry {i} (key {key})"
    if dtype >= len(DTYPES):
        raise ProtocolError(f"{where}: unknown dtype code {dtype}")
    if ndim > MAX_NDIM or any(shape[ndim:]):
        raise ProtocolError(f"{where}: ndim {ndim} (max {MAX_NDIM}) or reserved fields not zero")
    numel = math.prod(shape[:ndim])
    if length > MAX_ELEMENTS or offset + length > numel:
        raise ProtocolError(f"{where}: slice [{offset}:{offset + length}] outside shape {tuple(shape[:ndim])}")
    if step < 0 or nframes > length + 1:
        raise ProtocolError(f"{where}: negative step {step} or {nframes} frames for {length} elements")
    if dtype == POWERSGD and not 1 <= param <= min(matrix_shape(length)):
        raise ProtocolError(f"{where}: PowerSGD rank {param} does not fit the "
                            f"{' x '.join(map(str, matrix_shape(length)))} matrix of its slice")
    if param and dtype != POWERSGD:
        raise ProtocolError(f"{where}: param {param} on dtype code {dtype}, which takes none")
    return Entry(key, offset, length, tuple(shape[:ndim]), dtype, nframes, step, version, stale,
                 param)


def routing_ids(token):
    """A worker's 15 random bytes -> (request socket's routing id, heartbeat socket's)."""
    return b"w" + token, b"h" + token


def request_twin(heartbeat_id):
    """The routing id of the request socket that a heartbeat socket's id is the twin of."""
    return b"w" + heartbeat_id[1:] if heartbeat_id[:1] == b"h" else None


def error_message(sender, request, text):
    return encode(Op.ERROR, sender, request, extras=[text.encode()[:MAX_TEXT]])


def peek_request(frames):
    """Best-effort request id of a message that failed to decode (0 if unreadable)."""
    try:
        return HEADER.unpack_from(memoryview(frames[0]))[6]
    except Exception:   # any garbage: the error reply just carries request 0
        return 0
