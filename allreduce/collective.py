"""The public face every algorithm shares: argument checks, timeouts, the API.

    coll.allreduce(x, op="sum")     in place; op is sum, avg, max or min
    coll.reduce_scatter(x)          -> this rank's shard of the sum (x is left unchanged)
    coll.allgather(shard, n=None)   -> all shards concatenated in rank order
    coll.broadcast(x, root=0)       in place

An algorithm subclasses `Collective` and writes four methods on flat buffers:
`_allreduce(x, op)`, `_reduce_scatter(x, bounds, op)` (in place; x is a scratch
copy), `_allgather(x, bounds)` (own shard already in place) and
`_broadcast(x, root)`.  Shard boundaries always come from `shards.shard_bounds`.
"""
import numpy as np

from . import check
from .buffers import (OPS, CollectiveError, Scratch, copy_into, dtype_code, empty_like, flat,
                      is_float, numel, scale, validate)
from .shards import bounds_from_sizes, shard_bounds
from .transport import TransportTimeout

# Below this a message is sent whole; above it, in segments of this size so
# that reducing (or forwarding) one segment overlaps receiving the next.
SEGMENT_BYTES = 1 << 20


class CollectiveTimeout(TimeoutError):
    pass


class Collective:
    name = "?"
    counts_traffic = True   # False where a library moves the bytes out of our sight

    def __init__(self, transport, segment_bytes=SEGMENT_BYTES):
        self.transport = transport
        self.scratch = Scratch()
        self.segment_bytes = int(segment_bytes)
        self.check = check.enabled()

    @property
    def rank(self):
        return self.transport.rank

    @property
    def size(self):
        return self.transport.size

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r} rank {self.rank}/{self.size}>"

    # ----------------------------------------------------------- public API
    def allreduce(self, x, op="sum"):
        self._begin("allreduce", x, op=op)
        self._guarded("allreduce", self._allreduce, flat(x), op)
        if op == "avg":
            scale(x, self.size)
        return x

    def reduce_scatter(self, x, op="sum"):
        self._begin("reduce_scatter", x, op=op, writable=False)
        n = numel(x)
        bounds = shard_bounds(n, self.size)
        work = self.scratch.get("reduce_scatter", x, n)
        copy_into(work, flat(x))
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
        self._begin("allgather", shard, count=-1 if n is None else n, writable=False)
        if n is None:
            sizes = np.zeros(self.size, dtype=np.int64)
            sizes[self.rank] = numel(shard)
            self._guarded("allgather", self._allgather, sizes, shard_bounds(self.size, self.size))
            bounds = bounds_from_sizes(int(s) for s in sizes)
        else:
            bounds = shard_bounds(n, self.size)
            start, stop = bounds[self.rank]
            if stop - start != numel(shard):
                raise CollectiveError(
                    f"{self.name} allgather: rank {self.rank} passed {numel(shard)} elements, "
                    f"but shard {self.rank} of n={n} over {self.size} ranks has {stop - start}")
        out = empty_like(shard, bounds[-1][1])
        start, stop = bounds[self.rank]
        copy_into(out[start:stop], flat(shard))
        self._guarded("allgather", self._allgather, out, bounds)
        return out

    def broadcast(self, x, root=0):
        if not 0 <= root < self.size:
            raise CollectiveError(f"{self.name} broadcast: root {root} is not a rank "
                                  f"(world size {self.size})")
        self._begin("broadcast", x, root=root)
        self._guarded("broadcast", self._broadcast, flat(x), root)
        return x

    def barrier(self):
        self.transport.barrier()

    # ------------------------------------------------------------ plumbing
    def _begin(self, collective, x, op=None, root=-1, count=None, writable=True):
        """Validate arguments before any message is sent; with TOPOLAB_CHECK, compare ranks."""
        problem = None
        try:
            if op is not None and op not in OPS:
                raise CollectiveError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
            validate(x, f"{self.name} {collective}", writable)
            if op == "avg" and not is_float(x):
                raise CollectiveError(f"op 'avg' needs a floating dtype, got {x.dtype}")
        except CollectiveError as e:
            problem = e
        if self.check:
            if problem is None:
                code, n = dtype_code(x), numel(x) if count is None else count
            else:
                code, n = -1, -1
            sig = check.signature(collective, n, code, op, root, problem is not None)
            self._guarded(collective, check.verify, self.transport, sig, self.name,
                          problem and str(problem))
        if problem is not None:
            raise problem

    def _guarded(self, collective, fn, *args):
        try:
            return fn(*args)
        except TransportTimeout as e:
            raise CollectiveTimeout(f"{self.name} {collective}: {e}") from None

    def segments(self, x, n):
        """[start, stop) segments of a run of n elements of x, SEGMENT_BYTES each."""
        per = max(1, self.segment_bytes // (x.itemsize if type(x) is np.ndarray
                                            else x.element_size()))
        if n <= per:
            return ((0, n),)
        return [(a, min(a + per, n)) for a in range(0, n, per)]
