"""The public face every algorithm shares: argument checks, timeouts, the API.

    coll.allreduce(x, op="sum")     in place; op is sum, avg, max or min
    coll.reduce_scatter(x)          -> this rank's shard of the sum (x is left unchanged)
    coll.allgather(shard, n=None)   -> all shards concatenated in rank order
    coll.broadcast(x, root=0)       in place
    coll.alltoall(x, out=None)      -> block j from rank j (alltoall.py; x is left unchanged)

An algorithm subclasses `Collective` and writes four methods on flat buffers:
`_allreduce(x, op)`, `_reduce_scatter(x, bounds, op)` (in place; x is a scratch
copy), `_allgather(x, bounds)` (own shard already in place) and
`_broadcast(x, root)`.  Shard boundaries always come from `shards.shard_bounds`
(`self.shard_bounds(n)` keeps them per n).  All-to-all is alltoall.py's, over the
transport, for every algorithm; a baseline overrides `_alltoall(x, out, bounds)`.

The call path is kept lean, since a small all-reduce costs a few us in MPI
itself and every microsecond of Python shows: an all-reduce validated once
is kept per (op, dtype, size) and goes straight to the method that runs it
(`_plans`; the array's flags are still read every call), a buffer is
validated once per kind (buffers.Validator), a message of one segment goes
without the pipeline's bookkeeping (`sendrecv_reduce`), and the TOPOLAB_CHECK
exchange runs only when asked for.  allreduce.callpath times the parts.
"""
import numpy as np

from . import check
from .alltoall import alltoall as textbook_alltoall, check_out, received_bounds
from .buffers import (INTEGER_CODES, OPS, Scratch, Validator, copy_into, empty_like, flat,
                      is_numpy, nbytes, numel, reduce_into, scale)
from .errors import CollectiveError, CollectiveTimeout, TransportError, TransportTimeout
from .shards import bounds_from_sizes, shard_bounds

# Below this a message is sent whole; above it, in segments of this size so
# that reducing (or forwarding) one segment overlaps receiving the next.
SEGMENT_BYTES = 1 << 20
# Segments of a pipelined receive in flight at once on the host (sendrecv_reduce):
# two, so one arrives while the other is added; more measured no faster.
WINDOW = 2
# Validated all-reduce calls kept (Collective._plans): a training loop has a
# handful of bucket sizes; a size sweep starts over now and then.
PLANS_KEPT = 256


class Collective:
    name = "?"
    counts_traffic = True   # False where a library moves the bytes out of our sight

    def __init__(self, transport, segment_bytes=SEGMENT_BYTES):
        self.transport = transport
        self.scratch = Scratch()
        self.segment_bytes = int(segment_bytes)
        self.check = check.enabled()
        self.validator = Validator()
        self._bounds = {}
        self._plans = {}        # (op, dtype, nbytes) -> the validated call's method

    @property
    def rank(self):
        return self.transport.rank

    @property
    def size(self):
        return self.transport.size

    # this rank's traffic so far; None where a library (the mpi and torch baselines, MPI's
    # own all-to-all) or shared memory moves the bytes out of our sight
    @property
    def bytes_sent(self):
        return self.transport.bytes_sent if self.counts_traffic else None

    @property
    def bytes_received(self):
        return self.transport.bytes_received if self.counts_traffic else None

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r} rank {self.rank}/{self.size}>"

    # ----------------------------------------------------------- public API
    def empty(self, n, dtype=np.float32):
        """A new buffer of n elements that this collective reduces fastest: np.empty
        here; shared memory (shm, auto on one host) puts it in a window.  Call it on
        every rank alike, in the same order: for those it is collective."""
        return np.empty(n, dtype)

    def allreduce(self, x, op="sum"):
        # The path of every training step.  A numpy buffer whose (op, dtype,
        # size) an earlier call validated goes straight to the method that runs
        # it (`_plans`); its flags, which can change on the same array, are read
        # on every call.  Anything else, or every call under TOPOLAB_CHECK, is
        # validated in full first (`_plan`).
        run = None
        if type(x) is np.ndarray and not self.check:
            flags = x.flags
            if flags.c_contiguous and flags.writeable:
                try:
                    run = self._plans.get((op, x.dtype, x.nbytes))
                except TypeError:     # an op that is no string: _begin names it
                    pass
                buf = x if x.ndim == 1 else x.reshape(-1)
        if run is None:
            run, buf = self._plan(x, op)
        try:                          # _guarded, inline
            run(buf, op)
        except TransportError as e:
            raise self._named(e, "allreduce") from None
        if op == "avg":
            scale(x, self.size)
        return x

    def _plan(self, x, op):
        """Validate an all-reduce of x in full (and, with TOPOLAB_CHECK, compare
        ranks); returns the method that runs it, kept for numpy buffers, and x flat."""
        buf = self._begin("allreduce", x, op=op)
        run = self._allreduce_runner(x, op)
        if type(x) is np.ndarray and not self.check:
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            self._plans[op, x.dtype, x.nbytes] = run
        return run, buf

    def _allreduce_runner(self, x, op):
        """What all-reduces buffers like x (its dtype and size) with op, as
        run(flat_x, op): our _allreduce; auto's choice's; a baseline's call with
        its library's op looked up once."""
        return self._allreduce

    def reduce_scatter(self, x, op="sum"):
        x_flat = self._begin("reduce_scatter", x, op=op, writable=False)
        n = numel(x)
        bounds = self.shard_bounds(n)
        work = self.scratch.get("reduce_scatter", x_flat, n)
        copy_into(work, x_flat)
        shard = self._guarded("reduce_scatter", self._reduce_scatter, work, bounds, op)
        out = empty_like(x, numel(shard))
        copy_into(out, shard)
        if op == "avg":
            scale(out, self.size)
        return out

    def allgather(self, shard, n=None):
        """Concatenate every rank's shard.  With `n` (the total), shard r must have
        the size `shard_bounds(n, size)[r]` gives; without it, sizes are exchanged
        first, so any sizes work."""
        shard_flat = self._begin("allgather", shard, count=-1 if n is None else n,
                                 writable=False)
        if n is None:
            sizes = np.zeros(self.size, dtype=np.int64)
            sizes[self.rank] = numel(shard)
            self._guarded("allgather", self._allgather, sizes, shard_bounds(self.size, self.size))
            bounds = bounds_from_sizes(int(s) for s in sizes)
        else:
            bounds = self.shard_bounds(n)
            start, stop = bounds[self.rank]
            if stop - start != numel(shard):
                raise CollectiveError(
                    f"{self.name} allgather: rank {self.rank} passed {numel(shard)} elements, "
                    f"but shard {self.rank} of n={n} over {self.size} ranks has {stop - start}")
        out = empty_like(shard, bounds[-1][1])
        start, stop = bounds[self.rank]
        copy_into(out[start:stop], shard_flat)
        self._guarded("allgather", self._allgather, out, bounds)
        return out

    def broadcast(self, x, root=0):
        if not 0 <= root < self.size:
            raise CollectiveError(f"{self.name} broadcast: root {root} is not a rank "
                                  f"(world size {self.size})")
        buf = self._begin("broadcast", x, root=root)
        self._guarded("broadcast", self._broadcast, buf, root)
        return x

    def alltoall(self, x, out=None):
        """Rank r's block j (shard_bounds of x) goes to rank j; returns out, whose
        block j is rank j's block r: P blocks of shard r's size (alltoall.py)."""
        x_flat = self._begin("alltoall", x, writable=False, out=out)
        bounds = self.shard_bounds(numel(x))
        if out is None:
            out = empty_like(x, received_bounds(bounds, self.rank)[-1][1])
        self._guarded("alltoall", self._alltoall, x_flat, flat(out), bounds)
        return out

    def _alltoall(self, x, out, bounds):
        textbook_alltoall(self.transport, x, out, bounds, self.scratch)

    def barrier(self):
        self._guarded("barrier", self.transport.barrier)

    # ------------------------------------------------------------ plumbing
    def _begin(self, collective, x, op=None, root=-1, count=None, writable=True, out=None):
        """Validate arguments (`out`: an all-to-all's) before any message is sent;
        with TOPOLAB_CHECK, compare ranks.  Returns x as a flat buffer."""
        problem = code = None
        try:
            if op is not None and op not in OPS:
                raise CollectiveError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
            code = self.validator.check(x, writable, self.name, collective)
            if op == "avg" and code in INTEGER_CODES:
                raise CollectiveError(f"op 'avg' needs a floating dtype, got {x.dtype}")
            if out is not None:
                check_out(x, out, self.rank, self.size, f"{self.name} {collective}")
        except CollectiveError as e:
            problem = e
        if self.check:
            if problem is None:
                n = numel(x) if count is None else count
            else:
                code, n = -1, -1
            sig = check.signature(collective, n, code, op, root, problem is not None)
            self._guarded(collective, check.verify, self.transport, sig, self.name,
                          problem and str(problem))
        if problem is not None:
            raise problem
        return flat(x)

    def _guarded(self, collective, fn, *args):
        try:
            return fn(*args)
        except TransportError as e:
            raise self._named(e, collective) from None

    def _named(self, error, collective):
        """The collective layer's error for a transport's, naming who met it."""
        cls = CollectiveTimeout if isinstance(error, TransportTimeout) else CollectiveError
        return cls(f"{self.name} {collective}: {error}")

    def segments(self, x, n):
        """[start, stop) segments of a run of n elements of x, SEGMENT_BYTES each."""
        per = max(1, self.segment_bytes // x.itemsize)
        if n <= per:
            return ((0, n),)
        return [(a, min(a + per, n)) for a in range(0, n, per)]

    def shard_bounds(self, n):
        """shard_bounds(n, size), kept per n: a training loop all-reduces the same
        bucket sizes step after step."""
        bounds = self._bounds.get(n)
        if bounds is None:
            if len(self._bounds) >= 64:
                self._bounds.clear()
            bounds = self._bounds[n] = shard_bounds(n, self.size)
        return bounds

    def sendrecv_reduce(self, send, dest, dst, source, op):
        """Send `send` to dest while receiving as many elements as `dst` has from
        source, and reduce them into dst: one step of a reduce-scatter.

        A message of one segment is exchanged whole, then added.  A longer one
        is pipelined, so that adding segment k overlaps receiving segment k+1.
        On the host, segments arrive in a window of WINDOW slots, reused in
        turn, and each is added while it is still in cache: a whole-message
        scratch would be written to memory and read back, 4 of the 14 bytes
        an element costs a rank of the ring at P = 2 (docs/performance.md).
        On a GPU every receive is posted at once (NCCL posts what a transport
        held until a wait as one group, which a later receive could not join).
        Both ends cut a message into the same segments, since what one sends
        is what its peer receives."""
        t = self.transport
        per = self.segment_bytes // dst.itemsize
        if len(dst) <= per and len(send) <= per:     # the same test on both ends
            incoming = self.scratch.get("incoming", dst, len(dst))
            t.sendrecv(send, dest, incoming, source)
            reduce_into(dst, incoming, op)
            return
        segments = self.segments(dst, len(dst))
        window = WINDOW if is_numpy(dst) or dst.device.type == "cpu" else len(segments)
        slots = self.scratch.get("incoming", dst, min(window, len(segments)) * per)

        def slot(k):                  # where segment k arrives
            start = (k % window) * per
            return slots[start:start + segments[k][1] - segments[k][0]]
        recvs = [t.irecv(slot(k), source) for k in range(min(window, len(segments)))]
        sends = [t.isend(send[a:b], dest) for a, b in self.segments(send, len(send))]
        for k, (a, b) in enumerate(segments):
            recvs[k].wait()
            reduce_into(dst[a:b], slot(k), op)
            if k + window < len(segments):           # its slot is free again
                recvs.append(t.irecv(slot(k + window), source))
        t.wait_all(sends)
