"""CURVE on psrv's sockets: the server's ZAP allow-list, the client's options, what is local.

A server with keys is a CURVE server (RFC 26): before any message reaches its
ROUTER, libzmq completes a handshake in which the client proves it holds the
secret key of its public key, and asks the ZAP handler (RFC 27) whether that
public key is admitted.  Frames of an unknown key, of a plain (NULL) peer, or
bytes replayed from another connection never leave libzmq.  Each admitted
message carries its key as the "User-Id" property (Z85 text), which the
server ties to one worker id.

Why our own ZAP handler and not zmq.auth.ThreadAuthenticator: the server is one
thread that owns its sockets; the handler is one more socket in the same poll
(no second thread, no locks, refusals in the same log), and the allow-list is a
set of keys, which is all psrv needs.  The handler is bound before the ROUTER,
because libzmq admits every CURVE client when no handler is bound.
"""
import ipaddress
import logging

import zmq
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

ZAP_ENDPOINT = "inproc://zeromq.zap.01"          # fixed by RFC 27
ZAP_DOMAIN = b"psrv"
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

log = logging.getLogger("psrv.auth")


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: 200 for an admitted CURVE key."""

    def __init__(self, ctx, admitted, name="psrv"):
        self.admitted, self.name = frozenset(admitted), name
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
                log.warning("%s: refused a connection from %s: %s", self.name,
                            address.decode("ascii", "replace"), why)
        self.sock.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                  why.encode()[:255], user if ok else b"", b""])

    def close(self):
        self.sock.close()


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


def handshake_failure(monitor):
    """Read the monitor's pending events; -> text of the last failed handshake, or None."""
    failure = None
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        if event["event"] & HANDSHAKE_FAILED:
            name = zmq.Event(event["event"]).name.lower()
            detail = event["value"]
            failure = (f"{name} (status {int(detail)})" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                       else f"{name} ({getattr(detail, 'name', detail)})")
        elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            failure = None
    return failure


def stop_watching(sock, monitor):
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass                       # the socket is already closed
    monitor.close()


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
