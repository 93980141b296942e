"""A slower interconnect on one machine: latency and bandwidth per link.

    coll = allreduce.create("ring", link_latency_us=50, link_gbps=1.0)   # 1 Gbit/s

Bandwidth is in Gbit/s, as network links are rated and as the emulated
cluster's --inter-gbps is: one unit for every link in the project.

Wraps any transport.  Each rank's outgoing link sends one message at a time:
a message of b bytes occupies it for b / bandwidth seconds and arrives
`latency` after it left (the alpha-beta model: t = alpha + b * beta).  A send
is held back until the emulated link would have delivered it, then handed to
the real transport, which is far faster, so the receiver sees the data at the
emulated time.  Held sends go out in order before any wait, so a rank never
waits for a receive while its own sends are still held (that would deadlock
two ranks that exchange).
"""
import os
import time

from .buffers import nbytes
from .transport import Handle, Transport


def emulated(config):
    """Whether a run with these settings (a record's config, a sweep's point: a
    mapping with link_latency_us / link_gbps) goes over an emulated link."""
    return bool(config.get("link_latency_us") or config.get("link_gbps"))


def wait_until(due):
    """Sleep through most of a long delay (other ranks may need this core), then
    yield-poll the last stretch: sleep() alone overshoots by ~60 us."""
    left = due - time.perf_counter()
    if left > 200e-6:
        time.sleep(left - 100e-6)
    while time.perf_counter() < due:
        os.sched_yield()


class _HeldSend:
    def __init__(self, link, buf, peer, tag, due):
        self.link, self.buf, self.peer, self.tag, self.due = link, buf, peer, tag, due
        self.real = None

    def wait(self):
        self.link._wait_all([self])


class EmulatedLink(Transport):
    def __init__(self, inner, latency_us=0.0, gbps=None):
        super().__init__(inner.timeout, inner.traffic)
        if latency_us < 0 or (gbps is not None and gbps <= 0):
            raise ValueError(f"link emulation needs latency >= 0 and bandwidth > 0, "
                             f"got {latency_us} us, {gbps} Gbit/s")
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.latency = latency_us * 1e-6
        self.seconds_per_byte = 8 / (gbps * 1e9) if gbps else 0.0      # Gbit/s
        self._link_free_at = 0.0
        self._held = []

    def isend(self, buf, peer, tag=0):
        start = max(time.perf_counter(), self._link_free_at)
        self._link_free_at = start + nbytes(buf) * self.seconds_per_byte
        held = _HeldSend(self, buf, peer, tag, self._link_free_at + self.latency)
        self._held.append(held)
        return held

    def irecv(self, buf, peer, tag=0):
        # Wrapped, so that waiting on it releases our held sends first.
        return Handle(self, self.inner.irecv(buf, peer, tag), peer)

    def _release_held_sends(self):
        for held in self._held:
            wait_until(held.due)
            held.real = self.inner.isend(held.buf, held.peer, held.tag)
        self._held = []

    def _wait_all(self, handles):
        self._release_held_sends()
        self.inner.wait_all([h.real if isinstance(h, _HeldSend) else h.request for h in handles])

    def barrier(self):
        self._release_held_sends()
        self.inner.barrier()

    def split(self, color):
        return EmulatedLink(self.inner.split(color), self.latency * 1e6,
                            8 / self.seconds_per_byte / 1e9 if self.seconds_per_byte else None)

    def world_rank(self, rank):
        return self.inner.world_rank(rank)

    def node_id(self):
        return self.inner.node_id()

    @property
    def comm(self):
        return getattr(self.inner, "comm", None)
