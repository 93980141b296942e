"""Point-to-point transport: the only thing the collective algorithms use.

    t.rank, t.size                    who I am, how many we are
    h = t.isend(buf, peer)            non-blocking; h.wait() completes it
    h = t.irecv(buf, peer)
    t.send / t.recv / t.sendrecv      the blocking forms
    t.wait_all(handles)
    t.split(color)                    a transport over the ranks of the same colour
    t.takes_cuda                      whether CUDA tensors may be passed (NCCL, a
                                      CUDA-aware MPI); where not, allreduce.host_staged
                                      stages them through host memory

A buffer is a contiguous numpy array or torch tensor.  Its bytes go on the wire
as they are (`buffers.as_bytes`): never pickled, never copied on the way.

Every wait polls with a deadline (TOPOLAB_TIMEOUT seconds, default 120), so a
missing peer ends in a `TransportTimeout` naming the rank and the peer instead
of a hang.  Polling costs nothing measurable against a blocking wait here: MPI
itself spins while it waits.  Whatever else goes wrong here (a buffer this
transport cannot move, a failed transfer) is a `TransportError`; both are this
layer's own classes (errors.py), which the collective layer names again.

A waiting rank naps between polls only where ranks outnumber cores on its host
(TOPOLAB_NAP=1 or 0 overrides): see `nap.may_nap`.
"""
import functools
import os
import time

import numpy as np

from .buffers import as_bytes, nbytes
from .errors import TransportError, TransportTimeout
from .gpus import device_ready, mpi_takes_cuda
from .nap import may_nap

DEFAULT_TIMEOUT_S = 120.0
SPIN_POLLS = 100    # polls before a waiting rank starts yielding its core
SPIN_S = 300e-6     # then yield-polls until this long, then naps (if may_nap())
POLL_NAP_S = 50e-6  # the nap between later polls


def default_timeout():
    value = os.environ.get("TOPOLAB_TIMEOUT", "")
    try:
        return float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"TOPOLAB_TIMEOUT={value!r} is not a number of seconds") from None


class Traffic:
    """Bytes a rank sent and received; shared by a transport and its splits."""

    def __init__(self):
        self.sent = 0
        self.received = 0

    def reset(self):
        self.sent = self.received = 0


class Transport:
    """The interface.  Subclasses give isend, irecv, _wait_all, split, world_rank."""

    rank = 0
    size = 1
    takes_cuda = False

    def __init__(self, timeout=None, traffic=None):
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.traffic = traffic or Traffic()

    @property
    def bytes_sent(self):
        return self.traffic.sent

    @property
    def bytes_received(self):
        return self.traffic.received

    def send(self, buf, peer, tag=0):
        self.isend(buf, peer, tag).wait()

    def recv(self, buf, peer, tag=0):
        self.irecv(buf, peer, tag).wait()

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        # Post the receive first so the peer's send can land directly in it.
        self.wait_all([self.irecv(recvbuf, source, tag), self.isend(sendbuf, dest, tag)])

    def wait_all(self, handles):
        if handles:
            self._wait_all(handles)


class Handle:
    """A pending send or receive; wait() completes it or raises TransportTimeout."""
    __slots__ = ("transport", "request", "peer")

    def __init__(self, transport, request, peer):
        self.transport, self.request, self.peer = transport, request, peer

    def wait(self):
        self.transport._wait_all((self,))


class MPITransport(Transport):
    """Point-to-point over an mpi4py communicator, zero-copy through the buffer API."""

    def __init__(self, comm=None, timeout=None, traffic=None):
        from mpi4py import MPI
        super().__init__(timeout, traffic)
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.nap = may_nap()

    @property
    def takes_cuda(self):
        """Whether the MPI library reads device memory (gpus.mpi_takes_cuda): asked on
        first use, since a CPU run never needs the answer."""
        return mpi_takes_cuda(self.MPI)

    def isend(self, buf, peer, tag=0):
        self.traffic.sent += nbytes(buf)
        return Handle(self, self.comm.Isend(self._message(buf), peer, tag), peer)

    def irecv(self, buf, peer, tag=0):
        self.traffic.received += nbytes(buf)
        return Handle(self, self.comm.Irecv(self._message(buf), peer, tag), peer)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        # The step of most algorithms, so without Handles.  MPI_Sendrecv itself
        # would block past any timeout; this polls like every other wait.
        if type(sendbuf) is not np.ndarray or type(recvbuf) is not np.ndarray:
            sendbuf, recvbuf = self._message(sendbuf), self._message(recvbuf)
        traffic = self.traffic
        traffic.sent += nbytes(sendbuf)
        traffic.received += nbytes(recvbuf)
        comm = self.comm
        requests = [comm.Irecv(recvbuf, source, tag), comm.Isend(sendbuf, dest, tag)]
        if not self.MPI.Request.Testall(requests):
            self._poll(requests, (source, dest))

    def _message(self, buf):
        # A numpy array goes as it is (mpi4py reads its buffer and dtype: the
        # cheapest path for small messages); a tensor goes as its raw bytes, a
        # uint8 array over its memory.
        if type(buf) is np.ndarray:
            return buf
        if buf.device.type != "cpu":
            if not self.takes_cuda:
                raise TransportError(
                    "the MPI transport takes CPU buffers (this MPI is not CUDA-aware): use "
                    "transport='torch' (NCCL) for CUDA tensors, or allreduce.host_staged(coll) "
                    "to stage them through host memory")
            device_ready(buf)    # mpi4py takes its memory by DLPack / __cuda_array_interface__
        return as_bytes(buf)

    def wait_request(self, request, peer=-1):
        """Complete one mpi4py request (a baseline's collective) under the timeout."""
        if not request.Test():
            self._poll([request], (peer,))

    def _wait_all(self, handles):
        if len(handles) == 1:
            if handles[0].request.Test():
                return
            requests = [handles[0].request]
        else:
            requests = [h.request for h in handles]
            if self.MPI.Request.Testall(requests):
                return
        self._poll(requests, [h.peer for h in handles])

    def _poll(self, requests, peers):
        """Wait for every request, or raise TransportTimeout naming the peers of
        those still pending."""
        done = (requests[0].Test if len(requests) == 1 else
                functools.partial(self.MPI.Request.Testall, requests))
        # Spin first: the peer is usually microseconds away.  Then yield the core
        # on every poll, since a thread or rank beside us may need it.  After
        # SPIN_S, nap between polls where ranks outnumber cores (may_nap).
        for _ in range(SPIN_POLLS):
            if done():
                return
        start = time.perf_counter()
        deadline = start + self.timeout
        while not done():
            now = time.perf_counter()
            if self.nap and now - start >= SPIN_S:
                time.sleep(POLL_NAP_S)
            else:
                os.sched_yield()
            if now > deadline:
                pending = [p for p, r in zip(peers, requests) if not r.Test()]
                raise TransportTimeout(self.world_rank(self.rank),
                                       [self.world_rank(p) for p in pending], self.timeout)

    def barrier(self):
        self._wait_all([Handle(self, self.comm.Ibarrier(), -1)])

    def split(self, color):
        return MPITransport(self.comm.Split(color, self.rank), self.timeout, self.traffic)

    def node_id(self):
        """Equal on ranks that share memory (one host): MPI_COMM_TYPE_SHARED."""
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        first = np.array([self.rank], dtype=np.int64)    # the node's rank 0 names the node
        node.Bcast(first, root=0)
        node.Free()
        return int(first[0])

    def world_rank(self, rank):
        """The rank in MPI.COMM_WORLD of this communicator's `rank` (for messages)."""
        if rank < 0:
            return rank
        world = self.MPI.COMM_WORLD
        return self.MPI.Group.Translate_ranks(self.comm.Get_group(), [rank], world.Get_group())[0]
