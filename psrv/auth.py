"""Who may talk to a server: CURVE, the ZAP allow-list, worker ids bound to keys, what is local.

A server with keys is a CURVE server (RFC 26): before any message reaches its
ROUTER, libzmq completes a handshake in which the client proves it holds the
secret key of its public key, and asks the ZAP handler (RFC 27) whether that
public key is admitted.  Frames of an unknown key, of a plain (NULL) peer, or
bytes replayed from another connection never leave libzmq.  Each admitted
message carries its key as the "User-Id" property (Z85 text), which may speak
only for the worker id the key was made for (Members).

Why our own ZAP handler and not zmq.auth.ThreadAuthenticator: the server is one
thread that owns its sockets; the handler is one more socket in the same poll
(no second thread, no locks, refusals in the same log), and the allow-list is a
set of keys, which is all psrv needs.  The handler is bound before the ROUTER,
because libzmq admits every CURVE client when no handler is bound.
"""
import ipaddress
import logging
import os
import socket
import time

import zmq
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from . import protocol as P

ZAP_ENDPOINT = "inproc://zeromq.zap.01"          # fixed by RFC 27
ZAP_DOMAIN = b"psrv"
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# Before a CURVE peer is authenticated libzmq buffers its handshake frames, each up to
# MAXMSGSIZE (protocol.MAX_FRAME_BYTES, 4 MiB), for up to HANDSHAKE_IVL, and takes any
# number of connections: the bound is ours.  A handshake takes milliseconds, so 5 s
# (libzmq's default: 30 s) is ample; and a server takes at most two connections per
# admitted key (a worker's request and heartbeat sockets) + SPARE_CONNECTIONS.
HANDSHAKE_IVL_MS = 5000
SPARE_CONNECTIONS = 16
# A plain server (loopback or a 0700 ipc directory: no keys) has the same cap, 2 per
# worker + SPARE_CONNECTIONS, counted the same way; it learns W from the first INIT.
# Until then it serves only workers of its own host, and takes at most JOIN_WORKERS of
# them: a host with more has its extra connections cut before their handshake (no
# message of theirs is lost: ZeroMQ keeps it queued and reconnects) until an INIT
# raises the cap.
JOIN_WORKERS = 256
# Connections one admitted key may speak on: a worker's request and heartbeat sockets,
# and one of each again while a reconnect's new connection speaks before the old one's
# DISCONNECTED event has been read.  The total cap above counts connections of any key;
# this one stops a single key from filling it (16 connections of one key, each with a
# few messages queued, held +400 MiB in a shard before it).
KEY_CONNECTIONS = 4
LOG_EVERY_S = 10.0           # refusals: one line, then one summary line per period

log = logging.getLogger("psrv.auth")


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: 200 for an admitted CURVE key."""

    def __init__(self, ctx, admitted, name="psrv", refusals=None):
        self.admitted, self.name = frozenset(admitted), name
        self.refusals = refusals or RefusalLog(name)
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.refused = 0

    def handle(self):
        """One request (the socket is readable).  Frames: version, request id, domain,
        address, identity, mechanism, credentials...  Reply: version, request id,
        status code, status text, user id, metadata."""
        frames = self.sock.recv_multipart()
        request_id = frames[1] if len(frames) > 1 else b""
        ok, why, user = False, "malformed ZAP request", b""
        if len(frames) >= 7 and frames[0] == b"1.0":
            address, mechanism, key = frames[3], frames[5], frames[6]
            if mechanism != b"CURVE":
                why = f"mechanism {mechanism.decode('ascii', 'replace')}, only CURVE is admitted"
            elif len(key) != 32:
                why = "CURVE key is not 32 bytes"
            else:
                user = zmq.utils.z85.encode(key)
                ok = user in self.admitted
                why = "admitted" if ok else f"client key {user.decode()} is not in the key set"
            if not ok:
                self.refused += 1
                self.refusals.note("key", f"refused a connection from "
                                   f"{address.decode('ascii', 'replace')}: {why}")
        self.sock.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                  why.encode()[:255], user if ok else b"", b""])

    def close(self):
        self.sock.close()


class RefusalLog:
    """Log refused peers, of each kind (an unknown key, a failed handshake, the
    connection cap) at most one line per LOG_EVERY_S, then how many more there were:
    a flood of refused connections must not become a flood of log lines."""

    def __init__(self, name):
        self.name, self.last, self.quiet = name, {}, {}

    def note(self, kind, text):
        now, last = time.monotonic(), self.last.get(kind, -LOG_EVERY_S)
        if now - last < LOG_EVERY_S:
            self.quiet[kind] = self.quiet.get(kind, 0) + 1
            return
        quiet = self.quiet.pop(kind, 0)
        more = f" (and {quiet} more like it in the last {now - last:.0f} s)" if quiet else ""
        log.warning("%s: %s%s", self.name, text, more)
        self.last[kind] = now

    def close(self):
        for kind, quiet in self.quiet.items():
            log.warning("%s: %d more refusals (%s) after the last one logged", self.name,
                        quiet, kind)


class Connections:
    """The connections a server holds, from its monitor's ACCEPTED and
    DISCONNECTED/CLOSED events (whose value is the file descriptor).  Above `limit`
    a new connection is shut down at once, before its handshake can make libzmq
    buffer anything for it: shutdown(2) on a duplicate of the descriptor, which
    libzmq then sees as a peer that hung up.  (The descriptor is read from the
    event: if libzmq closed it and accepted another under the same number in the
    moment between, that newer connection is the one cut, and it reconnects.)

    Which key a connection belongs to is known only once it speaks: a message's
    descriptor (SRCFD) and its User-Id.  A key that speaks on more than `per_key`
    connections has the newest cut at its first message (speaks)."""

    def __init__(self, workers, per_key=KEY_CONNECTIONS, unit="worker key"):
        self.per_key, self.unit, self.open, self.cut = per_key, unit, set(), 0
        self.expect(workers)
        self.key_of, self.fds_of = {}, {}      # descriptor -> key that spoke on it, and back

    def expect(self, workers):
        """The cap for `workers` workers: their request and heartbeat sockets, and spares
        (connections already open above a lowered cap stay; new ones are cut)."""
        self.limit = 2 * workers + SPARE_CONNECTIONS

    def speaks(self, fd, user):
        """A message of key `user` arrived on descriptor fd (ZeroMQ's SRCFD): None, or,
        when that key already speaks on per_key other connections, the text of the
        refusal, after cutting this one (its message is dropped unread)."""
        if self.key_of.get(fd) == user:
            return None                        # the common case: a known connection
        self.forget(fd)
        fds = self.fds_of.setdefault(user, set())
        if len(fds) < self.per_key:
            self.key_of[fd] = user
            fds.add(fd)
            return None
        self.shut(fd)
        return (f"refused a connection: client key {user.decode()} already speaks on "
                f"{len(fds)} connections, the limit is {self.per_key} per key")

    def forget(self, fd):
        user = self.key_of.pop(fd, None)
        if user is not None:
            self.fds_of[user].discard(fd)

    def events(self, batch):
        """Apply a batch of monitor events in order; -> the texts of the cut connections."""
        cut, closes = [], {}
        for i, e in enumerate(batch):           # where each descriptor is last closed
            if e["event"] & (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED):
                closes[e["value"]] = i
        for i, e in enumerate(batch):
            fd = e["value"]
            if e["event"] == zmq.EVENT_ACCEPTED:
                self.forget(fd)                    # a new connection under an old number
                if len(self.open) < self.limit:
                    self.open.add(fd)
                elif closes.get(fd, -1) < i:       # not already closed again: cut it
                    self.shut(fd)
                    cut.append(f"refused a connection: {len(self.open)} connections open, "
                               f"the limit is {self.limit} (2 per {self.unit} + "
                               f"{SPARE_CONNECTIONS})")
            elif e["event"] & (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED):
                self.open.discard(fd)
                self.forget(fd)
        return cut

    def shut(self, fd):
        try:
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as dup:
                dup.shutdown(socket.SHUT_RDWR)
            self.cut += 1
        except OSError:
            pass                   # closed meanwhile: nothing to cut


class Listener:
    """A server's ROUTER with its limits, and a monitor that caps its connections
    (Connections) and logs failed handshakes; with keys also its ZAP handler.  Its own
    context: there is one ZAP endpoint per context."""

    def __init__(self, bind, keys, name, linger_ms, rcvhwm, sndhwm):
        self.name, self.ctx = name, zmq.Context()
        self.zap = None
        self.refusals = RefusalLog(name)
        if keys is not None:       # the handler first: without one libzmq admits any key
            self.zap = ZapHandler(self.ctx, keys.clients, name, self.refusals)
            self.connections = Connections(len(keys.clients))
        else:
            self.connections = Connections(JOIN_WORKERS, unit="worker")
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)   # libzmq drops larger frames
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)    # set before bind: the first connections
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)    # are made with them
        self.sock.setsockopt(zmq.LINGER, linger_ms)               # let the last replies leave
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)    # each held that long
        if keys is not None:
            make_server(self.sock, keys)
        self.monitor = self.sock.get_monitor_socket(
            HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        host, _, port = bind.rpartition(":")
        if port in ("0", "*"):
            bind = f"{host}:{self.sock.bind_to_random_port(host)}"
        else:
            self.sock.bind(bind)
        self.endpoint = bind

    def expect_workers(self, workers):
        """An INIT named W: a plain server caps its connections at 2 W + spares from now
        on (a CURVE server's cap comes from its key set, which names its workers)."""
        if self.zap is None:
            self.connections.expect(workers)

    def sockets(self):
        return [s for s in (self.sock, self.zap and self.zap.sock, self.monitor) if s is not None]

    def service(self, sock):
        """A ZAP request or a monitor event is waiting on sock."""
        if self.zap is not None and sock is self.zap.sock:
            return self.zap.handle()
        batch = pending_events(self.monitor)
        for text in self.connections.events(batch):
            self.refusals.note("cap", text)
        for failure in handshake_failures(batch):
            self.refusals.note("handshake", f"refused a connection: handshake failed: {failure}")

    def close(self):
        self.refusals.close()
        for s in (self.monitor, self.zap):
            if s is not None:
                s.close()
        self.sock.close()
        self.ctx.term()


class Members:
    """Who speaks for which worker id.  A connection (ROUTER identity) speaks for one
    worker.  With CURVE a worker id belongs to the client key bound to it
    (key_owner: public key -> worker id, from the key files' names; a key exchanged
    inside one MPI job, which no file holds, binds to the first id it speaks for),
    so a key can only ever speak for its own worker; without keys, to the
    first request connection that used it.  Heartbeats come on a socket of their
    own and claim nothing: without keys only the registered connection's twin
    (protocol.routing_ids) may send them."""

    def __init__(self, key_owner=None):
        # a key mapped to None (keys.for_mpi_rank) binds to the first id it speaks for
        self.key_owner = None if key_owner is None else dict(key_owner)
        self.speaks_for = {}       # ROUTER identity -> worker id
        self.owner = {}            # worker id -> identity (without keys)
        self.owned = {}            # and back

    def bind(self, identity, user, worker):
        """A request: ValueError naming the conflict if it may not speak for worker."""
        self._check_key(user, worker)
        bound = self.speaks_for.get(identity)
        if bound is not None and bound != worker:
            raise ValueError(f"this connection speaks for worker {bound}, not worker {worker}")
        if self.key_owner is None:
            owner = self.owner.get(worker)
            if owner is not None and owner != identity:
                raise ValueError(f"worker {worker} is already registered by another connection")
            if self.owned.get(identity, worker) != worker:
                raise ValueError(f"this connection is registered as worker "
                                 f"{self.owned[identity]}, not worker {worker}")
            self.owner[worker], self.owned[identity] = identity, worker
        self.speaks_for[identity] = worker

    def may_beat(self, identity, user, worker):
        """A heartbeat: True if it may refresh worker; False (ignored) before worker
        registered without keys; ValueError if it speaks for somebody else's worker."""
        self._check_key(user, worker)
        if self.key_owner is not None:
            return True
        owner = self.owner.get(worker)
        if owner is not None and owner != P.request_twin(identity):
            raise ValueError(f"this heartbeat connection is not the twin of the connection "
                             f"that registered worker {worker} (protocol.routing_ids)")
        return owner is not None

    def _check_key(self, user, worker):
        if self.key_owner is None:
            return
        if user in self.key_owner and self.key_owner[user] is None:
            if worker in self.key_owner.values():
                raise ValueError(f"worker {worker} belongs to another client key")
            self.key_owner[user] = worker          # bound now, for good
        if self.key_owner.get(user) != worker:
            raise ValueError(f"client key {user.decode()} belongs to worker "
                             f"{self.key_owner.get(user)}: it may not speak for worker {worker}")


def make_server(sock, keys):
    """Make sock a CURVE server with keys (a keys.ServerKeys)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN


def make_client(sock, keys, server_public):
    """Make sock a CURVE client of the server whose public key is server_public."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public


def watch_handshakes(sock):
    """A monitor socket that reports failed (and, for clients, good) handshakes."""
    return sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)


def pending_events(monitor):
    """The monitor's events waiting now, in order."""
    events = []
    while monitor.poll(0):
        events.append(recv_monitor_message(monitor))
    return events


def handshake_failures(events):
    """-> the texts of the failed handshakes among monitor events."""
    failures = []
    for event in events:
        if event["event"] & HANDSHAKE_FAILED:
            name, detail = zmq.Event(event["event"]).name.lower(), event["value"]
            # AUTH: the ZAP status code (400); PROTOCOL: a ZMQ_PROTOCOL_ERROR_* code
            # (0x1100000X: ZMTP, e.g. a mechanism mismatch); NO_DETAIL: an errno
            failures.append(f"{name} (status {int(detail)})"
                            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                            else f"{name} (code {int(detail):#x})")
    return failures


def stop_watching(sock, monitor):
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass                       # the socket is already closed
    monitor.close()


def check_private_ipc(endpoint):
    """ValueError unless an ipc:// socket lies in a directory that only this user can
    enter (a Unix socket is reachable by whoever may enter its directory); an
    abstract socket (ipc://@name) has no permissions at all."""
    path = endpoint.partition("://")[2]
    if path.startswith("@"):
        raise ValueError(f"{endpoint} is an abstract socket, which any process on this host "
                         f"can reach: use a path in a 0700 directory, or pass --keys")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(directory)
    except OSError as e:
        raise ValueError(f"{endpoint}: its directory {directory} is not usable: {e}") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"{endpoint}: directory {directory} has mode {st.st_mode & 0o777:#o} "
                         f"(owner uid {st.st_uid}): others on this host could connect; put the "
                         f"socket in a directory of mode 0700 (mktemp -d), or pass --keys")


def is_local(endpoint):
    """True for loopback TCP, ipc:// and inproc://: places only this host can reach."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False              # a name or an interface: assume others can reach it
