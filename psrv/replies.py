"""What a shard sends back, and how much of it each worker has not read yet.

    outbox = Outbox(sock, shard_id)
    outbox.send(identity, frames)                 # small replies: OK, ERROR, STATS_REPLY
    outbox.values(identity, request, worker, keys, entries, limit)   # VALUES, zero-copy

A VALUES reply references the stored arrays zero-copy, and an update copies a
value that a queued reply still holds (store.Key.writable).  So every reply a
worker leaves unread pins one copy of what it asked for: a worker that sends
PULLs and never reads the answers would grow the shard by a copy of the key per
update, up to the ROUTER's SNDHWM (server.SEND_HWM, 1000 messages) per
connection, gigabytes for a 4 MiB key.  The outbox therefore counts, per worker,
the payload bytes of the VALUES replies that ZeroMQ still holds (a tracker on
each reply's last frame: the frames of one message leave in order), and refuses
a reply that would take the worker above `limit` (UnreadReplies); the server
then stops serving that worker (server.Server.expel).

Why the count is right for an honest worker: its client reads every reply while
it waits, and ZeroMQ's I/O threads move the bytes on as they are read, so what
stays queued is what it asked for and has not waited for yet, at most a pull
and a push_pull of everything this shard holds (server.py sets the default
limit from that).
"""
from collections import deque

import zmq

from . import protocol as P


class UnreadReplies(ValueError):
    """A worker that does not read its replies: the text names it and the bytes."""


class Outbox:
    def __init__(self, sock, shard_id):
        self.sock, self.shard_id = sock, shard_id
        self.queued = {}           # worker -> deque of (tracker, payload bytes) still in ZeroMQ
        self.queued_bytes = {}     # worker -> their sum

    def send(self, identity, frames):
        """A reply of small frames (everything but VALUES): copied, untracked."""
        self.sock.send_multipart([identity, *frames])

    def error(self, identity, request, text):
        self.send(identity, P.error_message(self.shard_id, request, text))

    def unread(self, worker):
        """Payload bytes of worker's VALUES replies that ZeroMQ still holds."""
        q = self.queued.get(worker)
        while q and q[0][0].done:
            self.queued_bytes[worker] -= q.popleft()[1]
        return self.queued_bytes.get(worker, 0)

    def forget(self, worker):
        self.queued.pop(worker, None)
        self.queued_bytes.pop(worker, None)

    def values(self, identity, request, worker, keys, entries, limit):
        """Send worker the values of `entries` (store.Key by key id in `keys`), zero-copy;
        UnreadReplies, sending nothing, if that would queue more than limit bytes for it."""
        nbytes = sum(keys[e.key].value.nbytes for e in entries)
        held = self.unread(worker)
        if nbytes and held + nbytes > limit:
            raise UnreadReplies(f"worker {worker} has {held / 2**20:.1f} MiB of replies it has "
                                f"not read (limit {limit / 2**20:.1f} MiB): it is not reading "
                                f"its replies; shard {self.shard_id} stops serving it")
        out, payload, owners = [], [], []
        for e in entries:
            k = keys[e.key]
            parts = P.chunks(k.value)
            out.append(P.Entry(e.key, k.offset, k.length, k.shape, nframes=len(parts),
                               step=k.clock.get(worker, 0), version=k.version,
                               staleness=k.staleness.get(worker, -1)))
            payload += parts
            owners.append(k)
            k.read[worker] = k.version
        head = P.encode(P.Op.VALUES, self.shard_id, request, out, payload=payload)[0]
        self.sock.send_multipart([identity, head], zmq.SNDMORE if payload else 0)
        if not payload:
            return
        # Value frames leave zero-copy (pyzmq copies one below zmq.COPY_THRESHOLD, which
        # is cheaper than sharing it).  libzmq lets go of a message's frames in the
        # order they were sent, so the last frame's tracker says when ZeroMQ is done
        # with the whole reply: one tracker (a threading.Event) per reply, not per
        # frame.  The last frame is therefore always shared, never copied: a copied
        # one would come back with a tracker that is done at once.
        for part in payload[:-1]:
            self.sock.send(part, zmq.SNDMORE, copy=False)
        tracker = self.sock.send(zmq.Frame(payload[-1], copy=False, track=True), copy=False,
                                 track=True)
        for k in owners:
            k.trackers.append(tracker)         # store.Key.writable: copy before updating
        self.queued.setdefault(worker, deque()).append((tracker, nbytes))
        self.queued_bytes[worker] = held + nbytes
