"""The baselines: the MPI library's own collectives and torch.distributed's.

These are what the textbook algorithms are measured against; MPIRaw, MPI's
collectives with no topolab layer at all, is what the baselines are measured
against (allreduce.bench's mpi-raw row).  Both use the
libraries' non-blocking calls (MPI_Iallreduce, `async_op=True`), which here
run as fast as the blocking ones, so that the wait can have a timeout.
"""
import numpy as np

from .buffers import CollectiveError, is_tensor, reduce_into
from .collective import Collective
from .shards import shard_bounds
from .transport import Handle, MPITransport

_MPI_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
RAW = "mpi-raw"
_USER_OPS = {}


def _numpy_view(x):
    """A numpy view of x's memory in x's own dtype; bfloat16 as uint16 bits."""
    if type(x) is np.ndarray:
        return x
    import torch
    if x.device.type != "cpu":
        raise CollectiveError("the mpi baseline takes CPU buffers (MPI here is not CUDA-aware); "
                              "use --sync torch with NCCL for CUDA tensors")
    return x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


class MPINative(Collective):
    """mpi4py's MPI collectives over the transport's communicator."""
    name = "mpi"
    counts_traffic = False  # MPI's own algorithm chooses what moves; we cannot see it

    def __init__(self, transport, **options):
        if not isinstance(transport, MPITransport):
            raise CollectiveError("the 'mpi' baseline needs an MPI transport")
        super().__init__(transport, **options)
        self.MPI = transport.MPI
        self.comm = transport.comm
        self.in_place = transport.MPI.IN_PLACE
        self._ops = {}          # dtype -> {op name: MPI_Op}

    def _mpi_ops(self, x):
        """{op name: MPI_Op} for x's dtype."""
        ops = self._ops.get(x.dtype)
        if ops is None:
            ops = self._ops[x.dtype] = {name: self._make_op(x, name) for name in _MPI_OPS}
        return ops

    def _mpi_op(self, x, op):
        return self._mpi_ops(x)[op]

    def _make_op(self, x, op):
        """MPI has no bfloat16, and MPICH's float16 is an extension: reduce those
        with a user-defined MPI_Op that adds through torch or numpy.  The same for
        max and min of any floating dtype: MPI_MAX and MPI_MIN compare (`a > b ? a
        : b`), so a NaN wins or loses by its place in the reduction, and ranks can
        end with different answers; numpy's and torch's maximum and minimum return
        NaN where either side is NaN, as the textbook algorithms do (reduce_into),
        so every algorithm gives NaN on every rank (docs/reliability.md)."""
        tensor = is_tensor(x)
        if tensor:
            import torch
            half = x.dtype in (torch.float16, torch.bfloat16)
            floating = x.dtype.is_floating_point
        else:
            half = x.dtype == np.float16
            floating = np.issubdtype(x.dtype, np.floating)
        name = _MPI_OPS[op]
        if not half and not (floating and op in ("max", "min")):
            return getattr(self.MPI, name)
        # One user op per (dtype, kind, reduction) for the whole process, shared
        # by every baseline: mpi4py allows only a few dozen.
        key = (str(x.dtype), tensor, name)
        if key not in _USER_OPS:
            dtype, reduction = x.dtype, name.lower()

            def combine(inbuf, inoutbuf, datatype):
                if tensor:
                    import torch
                    a = torch.frombuffer(bytearray(inbuf), dtype=dtype)
                    b = torch.frombuffer(inoutbuf, dtype=dtype)
                else:
                    a = np.frombuffer(inbuf, dtype=dtype)
                    b = np.frombuffer(inoutbuf, dtype=dtype)
                reduce_into(b, a, reduction)
            _USER_OPS[key] = self.MPI.Op.Create(combine, commute=True)
        return _USER_OPS[key]

    def _wait(self, request):
        self.transport.wait_request(request)

    def _allreduce(self, x, op):
        # the lookups spelled out: this is the path whose overhead over a bare
        # MPI_Allreduce allreduce.bench's x_raw column shows
        buf = x if type(x) is np.ndarray else _numpy_view(x)
        ops = self._ops.get(x.dtype) or self._mpi_ops(x)
        self.transport.wait_request(self.comm.Iallreduce(self.in_place, buf, op=ops[op]))

    def _allreduce_runner(self, x, op):
        """For a numpy buffer, MPI_Iallreduce with the MPI_Op of (dtype, op) bound
        once: what Collective.allreduce keeps and calls for buffers like x."""
        if type(x) is not np.ndarray:
            return self._allreduce
        comm, in_place, mpi_op, wait = self.comm, self.in_place, self._mpi_op(x, op), self._wait

        def allreduce(buf, op):
            request = comm.Iallreduce(in_place, buf, mpi_op)
            if not request.Test():
                wait(request)
        return allreduce

    def _reduce_scatter(self, x, bounds, op):
        buf = _numpy_view(x)
        counts = [b - a for a, b in bounds]
        a, b = bounds[self.rank]
        out = np.empty(b - a, dtype=buf.dtype)
        self._wait(self.comm.Ireduce_scatter(buf, out, counts, op=self._mpi_op(x, op)))
        buf[a:b] = out
        return x[a:b]

    def _allgather(self, x, bounds):
        buf = _numpy_view(x)
        counts = [b - a for a, b in bounds]
        displs = [a for a, _ in bounds]
        self._wait(self.comm.Iallgatherv(self.MPI.IN_PLACE, [buf, counts, displs, None]))

    def _broadcast(self, x, root):
        self._wait(self.comm.Ibcast(_numpy_view(x), root=root))

    def _alltoall(self, x, out, bounds):
        # MPI_Alltoallv: block j of x to rank j, P blocks of our shard's size back
        m = bounds[self.rank][1] - bounds[self.rank][0]
        sent = ([b - a for a, b in bounds], [a for a, _ in bounds])
        received = ([m] * self.size, [j * m for j in range(self.size)])
        self._wait(self.comm.Ialltoallv([_numpy_view(x), sent], [_numpy_view(out), received]))


class TorchNative(Collective):
    """torch.distributed's collectives (gloo on CPU, NCCL on GPU)."""
    name = "torch"
    counts_traffic = False

    def __init__(self, transport, **options):
        from .torch_transport import TorchTransport
        if not isinstance(transport, TorchTransport):
            raise CollectiveError("the 'torch' baseline needs a torch transport")
        if not transport.own_group:
            raise CollectiveError(
                f"the 'torch' baseline needs a transport with a process group of its own, not "
                f"one split from another (ranks {transport.global_ranks}): make it with "
                f"make_transport('torch', comm)")
        super().__init__(transport, **options)
        import torch.distributed as dist
        self.dist = dist
        self.group = transport.group

    def _tensor(self, x):
        import torch
        return x if is_tensor(x) else torch.from_numpy(x)

    def _wait(self, work):
        self.transport._wait_all([Handle(self.transport, work, -1)])

    def _reduce_op(self, op):
        R = self.dist.ReduceOp
        return {"sum": R.SUM, "avg": R.SUM, "max": R.MAX, "min": R.MIN}[op]

    def _allreduce(self, x, op):
        if not len(x):
            return
        t = self._tensor(x)
        nan = self._nan_anywhere(t) if op in ("max", "min") and t.is_floating_point() else None
        self._wait(self.dist.all_reduce(t, op=self._reduce_op(op), group=self.group,
                                        async_op=True))
        if nan is not None:
            t.masked_fill_(nan, float("nan"))

    def _nan_anywhere(self, t):
        """Where any rank's t is NaN (a bool mask), or None if no rank has a NaN.  Gloo's
        and NCCL's max and min compare, so a NaN wins or loses by its place (gloo: even
        by whether it falls in a vectorised block or the tail); max and min propagate
        NaN on every other algorithm (buffers.reduce_into, MPINative._make_op), so here
        the NaNs are found first: one byte all-reduced, and the mask only if needed."""
        import torch
        R = self.dist.ReduceOp
        mask = torch.isnan(t)
        seen = mask.any().to(torch.uint8).reshape(1)
        self._wait(self.dist.all_reduce(seen, op=R.MAX, group=self.group, async_op=True))
        if not seen.item():
            return None
        flags = mask.to(torch.uint8)
        self._wait(self.dist.all_reduce(flags, op=R.MAX, group=self.group, async_op=True))
        return flags.bool()

    def _reduce_scatter(self, x, bounds, op):
        # gloo has no reduce-scatter: all-reduce, then keep our shard.
        self._allreduce(x, op)
        a, b = bounds[self.rank]
        return x[a:b]

    def _allgather(self, x, bounds):
        # all_gather wants equal sizes: pad every shard to the largest.
        t = self._tensor(x)
        width = max(b - a for a, b in bounds)
        if width == 0:
            return
        padded = [t.new_zeros(width) for _ in bounds]
        a, b = bounds[self.rank]
        mine = t.new_zeros(width)
        mine[:b - a] = t[a:b]
        self._wait(self.dist.all_gather(padded, mine, group=self.group, async_op=True))
        for (a, b), piece in zip(bounds, padded):
            t[a:b] = piece[:b - a]

    def _alltoall(self, x, out, bounds):
        m = bounds[self.rank][1] - bounds[self.rank][0]
        if len(x):                      # gloo rejects empty tensors; n is alike on every rank
            self._wait(self.dist.all_to_all_single(
                self._tensor(out), self._tensor(x), [m] * self.size, [b - a for a, b in bounds],
                group=self.group, async_op=True))

    def _broadcast(self, x, root):
        if len(x):
            src = self.transport.world_rank(root)
            self._wait(self.dist.broadcast(self._tensor(x), src=src, group=self.group,
                                           async_op=True))


class MPIRaw:
    """MPI's collectives called straight through mpi4py, no topolab layer: the
    floor every row of allreduce.bench is measured against (the same buffers,
    barrier and timing).  Outputs are allocated once per size, as the OSU
    benchmarks do."""
    name = RAW

    def __init__(self, comm):
        from mpi4py import MPI
        self.comm, self.in_place = comm, MPI.IN_PLACE

    def runner(self, collective, n):
        """The call to time for n elements: x -> result."""
        comm, in_place, rank = self.comm, self.in_place, self.comm.rank
        bounds = shard_bounds(n, comm.size)
        counts, displs = [b - a for a, b in bounds], [a for a, _ in bounds]
        if collective == "allreduce":
            return lambda x: comm.Allreduce(in_place, x) or x
        if collective == "broadcast":
            return lambda x: comm.Bcast(x, root=0) or x
        out = []

        def reduce_scatter(x):
            if not out:
                out.append(np.empty(counts[rank], dtype=x.dtype))
            comm.Reduce_scatter(x, out[0], counts)
            return out[0]

        def allgather(x):
            if not out:
                out.append(np.empty(n, dtype=x.dtype))
            comm.Allgatherv(x, [out[0], (counts, displs)])
            return out[0]
        def alltoall(x):
            m = counts[rank]
            if not out:
                out.append(np.empty(m * comm.size, dtype=x.dtype))
            comm.Alltoallv([x, (counts, displs)],
                           [out[0], ([m] * comm.size, [j * m for j in range(comm.size)])])
            return out[0]
        if collective == "alltoall":
            return alltoall
        return reduce_scatter if collective == "reduce_scatter" else allgather
