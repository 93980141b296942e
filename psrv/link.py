"""A worker's link to one server: its DEALER socket, sending under a deadline, reading replies.

    link = Link(ctx, "ipc:///tmp/psrv-x/shard0", "worker 0: server 0 (...)", timeout=30)
    link.send(frames, deadline, "took no PUSH")
    link.wait(zmq.POLLIN, deadline, "sent no reply to PUSH_PULL (request 7)")
    msg = link.read(out_of_request, slices)      # one reply; VALUES land in out

Reading a reply, the one place a worker parses what a server sent:

    frame 0         protocol.decode_head: header and entries, every field checked
    VALUES payload  frame by frame straight into the `out` arrays of the request it
                    answers (pyzmq's recv_into: the one copy out of ZeroMQ's buffer
                    is the copy into place); each frame must fit the room left in its
                    slice, the slice must be filled, no frame may be left over
    other replies   read whole and decoded (protocol.decode)

ZeroMQ hands over a multipart message whole or not at all, so once frame 0 is
read the rest is there.  A reply that breaks the rules is drained to its last
frame (the next read starts at a message boundary) and reported as PSError.

Every wait has a deadline; a monitor socket reports a refused handshake (an
unknown CURVE key, or no keys against a CURVE server) at once, instead of after
the timeout.
"""
import time

import zmq

from . import auth
from . import protocol as P


class PSError(RuntimeError):
    """A server answered with an error, or did not answer in time."""


class Link:
    def __init__(self, ctx, endpoint, name, timeout, keys=None, server_key=None,
                 routing_id=None, watch=True):
        self.name, self.timeout = name, timeout
        self.sock = sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)           # we close only after the last reply came
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        if routing_id:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if keys is not None:
            auth.make_client(sock, keys, server_key)
        sock.connect(endpoint)
        # also without keys: a CURVE server refuses a plain client in the handshake,
        # which only the monitor hears (the socket itself just stays silent)
        self.monitor = auth.watch_handshakes(sock) if watch else None
        self.has_keys = keys is not None
        self.refused = None                       # why the server refused our key
        self.pollers = {}                         # event -> zmq.Poller, made once
        self.bytes_sent = self.bytes_received = 0

    def send(self, frames, deadline, what):
        """Queue a message zero-copy; never a blocking send (a DEALER with no peer, refused
        or dead, blocks): PSError at the deadline."""
        while True:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                self.wait(zmq.POLLOUT, deadline, what)
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames)

    def wait(self, event, deadline, what):
        """Until the socket is ready for event (POLLIN, POLLOUT); PSError at the deadline,
        or at once when the server refused our CURVE handshake."""
        poller = self.pollers.get(event)
        if poller is None:
            poller = self.pollers[event] = zmq.Poller()
            poller.register(self.sock, event)
            if self.monitor:
                poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(left, 0) * 1000))
            if self.sock in ready and self.refused is None:
                return                           # the common case, before any text is built
            if self.monitor in ready:
                for failure in auth.handshake_failures(auth.pending_events(self.monitor)):
                    self.refused = failure
            if self.refused is not None and self.has_keys:
                raise PSError(f"{self.name} refused the CURVE handshake: {self.refused}: is "
                              f"this worker's public key in the server's key set, and the "
                              f"server's public key the right one?")
            if self.refused is not None:
                raise PSError(f"{self.name} refused the handshake: {self.refused}: this "
                              f"worker has no keys; is the server a CURVE server (--keys)? "
                              f"then pass keys (psrv.keys)")
            if left <= 0:
                raise PSError(f"{self.name} {what} within {self.timeout:g} s: is it alive?")

    def read(self, outs, slices):
        """One message (wait first: this blocks).  outs: request id -> the `out` arrays
        its VALUES go into (the entry is taken); slices: key -> placement.Slice."""
        sock = self.sock
        first = sock.recv()
        self.bytes_received += len(first)
        try:
            msg = P.decode_head(first)
            if msg.op == P.Op.VALUES:
                self._read_values(msg, outs.pop(msg.request, None), slices)
                return msg
            frames = [first]
            while sock.rcvmore:
                frames.append(sock.recv(copy=False))
                self.bytes_received += len(frames[-1])
            return P.decode(frames)
        except (P.ProtocolError, PSError) as e:
            while sock.rcvmore:                  # the next read starts at a message boundary
                sock.recv_into(bytearray())
            raise PSError(f"{self.name} sent a malformed reply: {e}") from None

    def _read_values(self, msg, out, slices):
        """VALUES' payload frames into out (None: nobody waits for them: discarded)."""
        sock, total = self.sock, 0
        for e in msg.entries:
            sl = slices.get(e.key)
            if sl is None or (e.offset, e.length, e.dtype) != (sl.offset, sl.length, P.FLOAT32):
                raise PSError(f"key {e.key} [{e.offset}:{e.offset + e.length}] is not a float32 "
                              f"slice that this server holds")
            dst = None
            if out is not None:
                if out.get(sl.name) is None:
                    raise PSError(f"key {e.key} ({sl.name}) was not asked for")
                dst = out[sl.name].reshape(-1)[sl.offset:sl.offset + sl.length]
            pos = 0
            for i in range(e.nframes):
                if not sock.rcvmore:
                    raise PSError(f"key {e.key}: frame {i} of {e.nframes} is missing")
                room = dst[pos:] if dst is not None else bytearray()
                got = sock.recv_into(room)       # a larger frame is cut, and reported here
                self.bytes_received += got
                total += got
                if dst is not None and (got > room.nbytes or got % 4):
                    raise PSError(f"key {e.key}: a frame of {got} bytes where {room.nbytes} "
                                  f"bytes of float32 remain")
                pos += got // 4
            if dst is not None and e.nframes and pos != len(dst):
                raise PSError(f"key {e.key}: {pos * 4} bytes in {e.nframes} frames for "
                              f"{len(dst) * 4}")
        if sock.rcvmore:
            raise PSError("more frames than the entries announce")
        if total != msg.payload_bytes:
            raise PSError(f"payload_bytes {msg.payload_bytes} != {total} received")

    def close(self):
        if self.monitor is not None:
            auth.stop_watching(self.sock, self.monitor)
        self.sock.close()
