"""What lab 1's check gives a student's ring, and what it watches while the ring runs.

  LabTransport   t.rank, t.size, t.sendrecv: the only door a ring needs.  It counts
                 the bytes each rank sends, and records (without stopping, so that
                 both sides of every exchange stay in step) the first exchange that
                 is not a ring's: a peer that is not the right or left neighbour, a
                 message longer than a chunk, a send that does not fit its receive.
  WatchedWorld   MPI.COMM_WORLD as the student's module sees it: the real one, but
                 each call that could move data is noted, so a sum that went around
                 t (an MPI_Allreduce, then zeros sent round the ring to make up a
                 ring's byte count) is named for what it is.
  Alarm          a rank whose ring raised tells the others at once, so that they
                 stop waiting for it (within milliseconds, not the timeout).
"""
import os
import time

import numpy as np

from allreduce.nap import may_nap

TIMEOUT_S = 10.0        # a wrong ring may wait forever; a right one needs milliseconds
DATA, LENGTH, ALARM = 0, 1, 2     # message tags
# MPI calls that only ask who is who: a ring may make them, nothing moves.
HARMLESS = {"Get_rank", "Get_size", "Get_name", "Is_inter", "Is_intra", "Get_topology"}


class PeerFailed(Exception):
    """Another rank's ring raised: this rank stops waiting for it."""


class Alarm:
    """One small message from a failing rank to each of the others, on a
    communicator of its own: `ring()` sends it, `heard()` tests for it."""

    def __init__(self, comm):
        from mpi4py import MPI
        self._comm, self._flag = comm, np.zeros(1, np.int64)
        self._incoming = comm.Irecv(self._flag, MPI.ANY_SOURCE, ALARM)
        self._sent = []

    def heard(self):
        return self._incoming.Test()

    def close(self):
        """No alarm came: take back the receive posted for it, before MPI_Finalize."""
        if not self._incoming.Test():
            self._incoming.Cancel()
            self._incoming.Wait()

    def ring(self):
        me = self._comm.Get_rank()
        self._sent = [self._comm.Isend(np.ones(1, np.int64), peer, ALARM)
                      for peer in range(self._comm.Get_size()) if peer != me]


class WatchedWorld:
    """Stands in for MPI.COMM_WORLD in the student's module; forwards everything to
    the real one and notes, in `calls`, the name of each method that may move data."""

    def __init__(self, world):
        self._world, self.calls = world, []

    def __getattr__(self, name):
        attribute = getattr(self._world, name)
        if not callable(attribute) or name in HARMLESS:
            return attribute

        def noted(*args, **kwargs):
            self.calls.append(name)
            return attribute(*args, **kwargs)
        return noted


class LabTransport:
    """What a student's ring gets: rank, size and sendrecv, nothing else.

    Not allreduce.MPITransport: that one imports torch (seconds per rank on a
    laptop) and offers more than the lab allows.  With check=True it sends each
    message's length first, so the receiver can compare it with its buffer: on a
    mismatch it records what differs and receives into scratch, so both sides
    carry on in step (instead of an MPI truncation error on one rank and a wait
    for it on the others)."""

    def __init__(self, comm, check=True, timeout=TIMEOUT_S, alarm=None):
        self._comm, self._check, self._timeout, self._alarm = comm, check, timeout, alarm
        self._nap = may_nap()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.reset(1)

    def reset(self, n):
        """Before an all-reduce of n elements: counts to zero, and the longest
        message a ring sends, one chunk (np.array_split's largest)."""
        self.bytes_sent, self.calls, self.mismatch, self.not_a_ring = 0, 0, None, None
        self._chunk = -(-n // self.size)

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        """Send sendbuf to rank dest while receiving recvbuf from rank source."""
        self.calls += 1
        for name, buf in (("sendbuf", sendbuf), ("recvbuf", recvbuf)):
            if not (isinstance(buf, np.ndarray) and buf.ndim == 1 and buf.flags.c_contiguous
                    and buf.dtype == np.float64):
                raise TypeError(f"t.sendrecv: {name} must be a 1-D float64 numpy array such as "
                                f"x[a:b], got {type(buf).__name__} {getattr(buf, 'dtype', '')}")
        for name, peer in (("dest", dest), ("source", source)):
            if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.size):
                raise ValueError(f"t.sendrecv: {name}={peer!r} is not a rank (0..{self.size - 1})")
        if self._check:
            self._watch(sendbuf.size, dest, source)
            mine, theirs = np.array([sendbuf.size], np.int64), np.empty(1, np.int64)
            self._wait([self._comm.Irecv(theirs, source, LENGTH),
                        self._comm.Isend(mine, dest, LENGTH)], dest, source)
            if theirs[0] != recvbuf.size:
                if self.mismatch is None:
                    self.mismatch = (
                        f"sendrecv call {self.calls}: rank {source} sent {theirs[0]} elements "
                        f"into a receive buffer of {recvbuf.size}: the send and receive chunk "
                        f"sizes differ (the chunk a rank sends right must be the chunk its "
                        f"right neighbour receives, and receive buffers must be sliced to it)")
                recvbuf = np.empty(int(theirs[0]))
        self.bytes_sent += sendbuf.nbytes
        self._wait([self._comm.Irecv(recvbuf, source, DATA),
                    self._comm.Isend(sendbuf, dest, DATA)], dest, source)

    def __getattr__(self, name):
        raise AttributeError(f"the lab's transport has no {name!r}: a ring needs only "
                             f"t.rank, t.size and t.sendrecv")

    def _watch(self, elements, dest, source):
        """Note the first exchange a ring would not make."""
        if self.not_a_ring is not None:
            return
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        if (dest, source) != (right, left):
            self.not_a_ring = (
                f"sendrecv call {self.calls} sends to rank {dest} and receives from rank "
                f"{source}; in a ring rank {self.rank} sends only to its right neighbour "
                f"(rank {right}) and receives only from its left one (rank {left})")
        elif elements > self._chunk:
            self.not_a_ring = (
                f"sendrecv call {self.calls} sends {elements} elements, more than a chunk "
                f"(at most ceil(n/P) = {self._chunk}): a ring passes chunks of about n/P, "
                f"never whole vectors")

    def _wait(self, requests, dest, source):
        from mpi4py import MPI
        deadline = time.monotonic() + self._timeout
        polls = 0
        while not MPI.Request.Testall(requests):
            polls += 1
            if self._alarm is not None and self._alarm.heard():
                raise PeerFailed(f"sendrecv call {self.calls} stopped: another rank failed")
            if polls > 100:        # then leave the core to a rank that may need it
                time.sleep(50e-6) if self._nap else os.sched_yield()
            if polls % 1000 == 0 and time.monotonic() > deadline:
                for request in requests:
                    request.Cancel()
                raise TimeoutError(
                    f"sendrecv call {self.calls} (to rank {dest}, from rank {source}) found "
                    f"no partner in {self._timeout:g} s")
