"""CUDA tensors through pinned host memory, for transports that move host memory only.

    coll = allreduce.host_staged(coll)     # this wrapper where the transport needs it
    coll.allreduce(x_on_gpu)               # as any collective: in place, returns x

The MPI from PyPI is not CUDA-aware: it reads and writes host memory only.  A
CUDA tensor therefore goes down to a pinned host buffer, through the wrapped
collective, and back up.  The copies run on a side CUDA stream, ordered by
events, the way torch's NCCL collectives order theirs:

    producing stream  ==[kernels that write x]==(produced)==[the next bucket's kernels]==>
                                                   |                        (returned)
    side stream                             wait(produced)  x -> host (copied)   |  host -> x
    the CPU (MPI)                                         sync(copied) ... collective ... |
    the consumer (the current stream)                                       wait(returned) ==>

1. `produced` is recorded on the current stream at the call: x is complete
   there.  The side stream waits for that event, not for the stream itself, so
   kernels queued later (the next bucket's backward) run while x leaves.
2. The CPU waits for `copied` before the collective reads the host buffer:
   MPI sees host memory only once the bytes are in it.
3. The copy back runs on the side stream too; the current stream waits for its
   event `returned` (on the GPU: the CPU goes on to the next buffer at once),
   so whatever reads x next, on that stream, sees the reduced values.

Where the caller makes a stream of its own current for communication (the
gradient-sync thread, strategies/sync/comm_thread.py, whose stream waits for
each bucket's event and is current while it reduces the bucket), `produced`
marks exactly that bucket, and its copy overlaps the backward of the next.
On the default stream it marks everything queued so far: correct, with less
overlap.  The ordering is written once, against `CudaCopies`; the tests run it
against a simulated GPU whose streams run only when waited for.

Point-to-point messages (a pipeline's activations and their gradients) take the
same path through `HostStagedTransport`, with one difference: several messages
are in flight at once, so each has a pinned buffer of its own (from torch's
caching host allocator: pinned once, reused after), kept until its send is done.

    isend(x):  `produced`, x -> host (copied), the CPU waits for `copied`, MPI_Isend(host)
    irecv(x):  MPI_Irecv(host); at wait(): host -> x on the side stream (returned),
               the current stream waits for `returned`

A send costs the CPU one wait, for its copy down (MPI may read the buffer only
once the bytes are there); a receive none beyond waiting for the message itself.
"""
from contextlib import nullcontext

from .buffers import is_tensor, validate
from .transport import Transport

try:  # torch is optional for the numpy-only user
    import torch
except ImportError:  # pragma: no cover
    torch = None


class HostCopies:
    """Copies for a tensor in host memory standing in for a device one: done at once,
    so there is nothing to order (the stream and event methods do nothing)."""
    side = None

    def current(self):
        return None

    def record(self, stream):
        return None

    def wait(self, stream, event):
        pass

    def copy(self, dst, src, stream):
        dst.copy_(src)

    def keep(self, tensor, stream):
        pass

    def synchronize(self, event):
        pass

    def using(self, stream):
        """A context in which `stream` is the current one."""
        return nullcontext()


class CudaCopies(HostCopies):
    """The side stream of one GPU, and the CUDA calls the staging makes on it."""

    def __init__(self, device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def record(self, stream):
        return stream.record_event()

    def wait(self, stream, event):
        stream.wait_event(event)

    def copy(self, dst, src, stream):
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)    # pinned memory: asynchronous, at PCIe speed

    def keep(self, tensor, stream):
        # x was allocated on the current stream and is used on the side one: the
        # caching allocator must not hand its memory out before the side stream is done
        tensor.record_stream(stream)

    def synchronize(self, event):
        event.synchronize()

    def using(self, stream):
        return torch.cuda.stream(stream)


def copies_for(device):
    return CudaCopies(device) if device.type == "cuda" else HostCopies()


class HostStaging:
    """Pinned host buffers, one per dtype, and the ordered copies through them.

    A buffer is grown to the largest tensor seen and reused: pinning memory
    (cudaHostAlloc) costs more than copying the same bytes several times, so it
    is paid once, not on every call.  Without CUDA the buffers are plain host
    memory (so the staging can be tested on any machine).  `copies` makes the
    copier of a device (default: CudaCopies for a GPU, HostCopies otherwise)."""

    def __init__(self, copies=copies_for):
        self._buffers = {}
        self._copiers = {}
        self.make_copies = copies

    def copier(self, device):
        found = self._copiers.get(device)
        if found is None:
            found = self._copiers[device] = self.make_copies(device)
        return found

    def buffer(self, dtype, n):
        """A flat host tensor of n elements of dtype: a view of the reused buffer."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < n:
            # the old buffer may still feed a copy in flight: torch's pinned-memory
            # allocator keeps it until the copy's stream has passed it
            buf = torch.empty(max(n, 1), dtype=dtype, pin_memory=torch.cuda.is_available())
            self._buffers[dtype] = buf
        return buf[:n]

    def own_buffer(self, x):
        """A flat host tensor of x's dtype and size for one message in flight: pinned
        (torch's caching host allocator pins each size once and hands it out again
        once the copies that used it are done), plain host memory without CUDA."""
        return torch.empty(x.numel(), dtype=x.dtype, pin_memory=torch.cuda.is_available())

    def to_host(self, x, host=None):
        """x's values in a flat host tensor, there when this returns: `host` (of x's
        dtype and size), or the reused buffer, valid until the next call for x's dtype."""
        c = self.copier(x.device)
        host = self.buffer(x.dtype, x.numel()) if host is None else host
        produced = c.record(c.current())          # 1. x is complete here
        c.wait(c.side, produced)
        c.copy(host, x.reshape(-1), c.side)
        c.keep(x, c.side)
        c.synchronize(c.record(c.side))           # 2. the collective reads host memory
        return host

    def to_device(self, dst, host):
        """dst = host's values, in order before whatever the current stream runs next."""
        c = self.copier(dst.device)
        c.copy(dst.view(-1), host.reshape(-1), c.side)
        c.keep(dst, c.side)
        c.wait(c.current(), c.record(c.side))     # 3. the consumer waits; the CPU does not
        return dst

    def new_on(self, device, host):
        """A new device tensor holding host's values (a collective's new result)."""
        # allocated on the current stream: the consumer's, which the copy's event orders
        return self.to_device(torch.empty(host.shape, dtype=host.dtype, device=device), host)


class HostStaged:
    """A collective whose device tensors are staged through host memory: copied
    into a pinned buffer, reduced there by the wrapped collective (which only
    sees host memory), copied back.  Host buffers go straight through, so on a
    CPU nothing changes.  Made by `allreduce.host_staged(coll)`."""

    def __init__(self, inner, copies=copies_for):
        self.inner = inner
        self.staging = HostStaging(copies)

    # what callers read off a collective
    name = property(lambda self: self.inner.name)
    transport = property(lambda self: self.inner.transport)
    counts_traffic = property(lambda self: self.inner.counts_traffic)
    bytes_sent = property(lambda self: self.inner.bytes_sent)
    bytes_received = property(lambda self: self.inner.bytes_received)
    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)

    def __repr__(self):
        return f"<host-staged {self.inner!r}>"

    def needs_host(self, x):
        return off_host(x)

    def _host(self, x, what):
        validate(x, f"{self.name} {what}", writable=what in ("allreduce", "broadcast"))
        return self.staging.to_host(x)

    def allreduce(self, x, op="sum"):
        if not self.needs_host(x):
            return self.inner.allreduce(x, op)
        host = self._host(x, "allreduce")
        self.inner.allreduce(host, op)
        return self.staging.to_device(x, host)

    def broadcast(self, x, root=0):
        if not self.needs_host(x):
            return self.inner.broadcast(x, root)
        host = self._host(x, "broadcast")
        self.inner.broadcast(host, root)
        return self.staging.to_device(x, host)

    def reduce_scatter(self, x, op="sum"):
        if not self.needs_host(x):
            return self.inner.reduce_scatter(x, op)
        shard = self.inner.reduce_scatter(self._host(x, "reduce_scatter"), op)
        return self.staging.new_on(x.device, shard)

    def allgather(self, shard, n=None):
        if not self.needs_host(shard):
            return self.inner.allgather(shard, n)
        whole = self.inner.allgather(self._host(shard, "allgather"), n)
        return self.staging.new_on(shard.device, whole)

    def alltoall(self, x, out=None):
        if not self.needs_host(x):
            return self.inner.alltoall(x, out)
        result = self.inner.alltoall(self._host(x, "alltoall"))
        if out is None:
            return self.staging.new_on(x.device, result)
        return self.staging.to_device(out, result)

    def barrier(self):
        self.inner.barrier()


def off_host(x):
    return is_tensor(x) and x.device.type != "cpu"


class StagedHandle:
    """A staged send or receive: the transport's own handle, the host buffer it moves
    (alive until the message is done) and, for a receive, the copy up that ends it."""
    __slots__ = ("inner", "host", "arrive")

    def __init__(self, inner, host, arrive=None):
        self.inner, self.host, self.arrive = inner, host, arrive

    @property
    def request(self):          # an MPI request, for a caller that polls it itself
        return self.inner.request

    def wait(self):
        self.inner.wait()
        self.done()

    def done(self):
        if self.arrive is not None:
            self.arrive()           # the receive's copy up, ordered before its readers
        self.host = self.arrive = None


class HostStagedTransport(Transport):
    """A point-to-point transport whose device tensors travel through host memory: a
    send copies down into a buffer of its own, a receive lands in one and is copied up
    when waited for.  Host buffers go straight through.  Made by
    `allreduce.host_staged(transport)` where the transport moves host memory only."""
    takes_cuda = True

    def __init__(self, inner, copies=copies_for):
        self.inner = inner
        self.staging = HostStaging(copies)
        self.rank, self.size = inner.rank, inner.size

    timeout = property(lambda self: self.inner.timeout)
    traffic = property(lambda self: self.inner.traffic)

    def __repr__(self):
        return f"<host-staged {self.inner!r}>"

    def needs_host(self, x):
        return off_host(x)

    def isend(self, buf, peer, tag=0):
        if not self.needs_host(buf):
            return self.inner.isend(buf, peer, tag)
        validate(buf, "isend")
        host = self.staging.to_host(buf, self.staging.own_buffer(buf))
        return StagedHandle(self.inner.isend(host, peer, tag), host)

    def irecv(self, buf, peer, tag=0):
        if not self.needs_host(buf):
            return self.inner.irecv(buf, peer, tag)
        validate(buf, "irecv", writable=True)
        host = self.staging.own_buffer(buf)
        return StagedHandle(self.inner.irecv(host, peer, tag), host,
                            lambda: self.staging.to_device(buf, host))

    def _wait_all(self, handles):
        self.inner.wait_all([h.inner if isinstance(h, StagedHandle) else h for h in handles])
        for h in handles:
            if isinstance(h, StagedHandle):
                h.done()

    def barrier(self):
        self.inner.barrier()

    def split(self, color):
        return HostStagedTransport(self.inner.split(color), self.staging.make_copies)

    def world_rank(self, rank):
        return self.inner.world_rank(rank)
