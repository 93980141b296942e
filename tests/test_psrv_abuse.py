"""Tier (c): peers that abuse what they were given.  Real server processes, real sockets.

    another worker's key        a valid key speaks only for the worker id its file names
    replies left unread         a worker that never reads its VALUES is stopped at a byte
                                limit, naming it; the shard stays small and serves the rest;
                                a reply counts until ZeroMQ lets go of it, also one whose
                                last frame is small enough for pyzmq to copy
    pushes faster than read     a shard's ZeroMQ queue holds a few of a worker's messages,
                                not libzmq's default of 1000 (gigabytes of 4 MiB pushes)
    unauthenticated flood       64 connections that each start a 4 MiB CURVE handshake frame:
                                the server holds at most 2 per key + 16 of them, for at most
                                5 s, grows by less than they would pin, logs a few lines
    no keys, CURVE server       the client names the refused handshake at once
    heartbeats of a stranger    on loopback, only the registered worker's own heartbeat
                                socket keeps it alive: a killed worker is still found dead
"""
import os
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest
import zmq

import psrv
from psrv import keys as K
from psrv import protocol as P
from psrv.config import Consistency, OptimizerConfig, pack_config
from psrv.replies import Outbox
from psrv.store import Key

SHAPES = {"w": (6, 4), "b": (4,)}
SGD = OptimizerConfig("sgd", lr=0.5)


def start_params():
    return {n: (np.arange(np.prod(s), dtype=np.float32).reshape(s) % 5) / 4 for n, s in SHAPES.items()}


def grads(step, w=0):
    return {n: ((np.arange(np.prod(s)) % 4 - 1.5) * (1 + (step + w) % 3) / 8).astype(np.float32)
            .reshape(s) for n, s in SHAPES.items()}


@pytest.fixture
def keydir(tmp_path):
    K.generate(str(tmp_path / "keys"), 2)
    return str(tmp_path / "keys")


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def wait_for_log(servers, text, seconds=30):
    end = time.monotonic() + seconds
    while text not in servers.log(0):
        assert time.monotonic() < end, f"no {text!r} in the log within {seconds} s:\n" \
                                       f"{servers.log(0)[-2000:]}"
        time.sleep(0.1)


def test_the_key_files_bind_each_key_to_its_worker(keydir):
    server = K.load_server_keys(keydir)
    assert {w: K.load_worker_keys(keydir, w).public for w in range(2)} == \
        {w: key for key, w in server.clients.items()}
    workers = os.path.join(keydir, "workers")
    os.link(os.path.join(workers, "worker-1.key"), os.path.join(workers, "worker-7.key"))
    with pytest.raises(ValueError, match="worker-7.key holds the key of worker 1 too"):
        K.load_server_keys(keydir)
    os.rename(os.path.join(workers, "worker-7.key"), os.path.join(workers, "spare.key"))
    with pytest.raises(ValueError, match="spare.key: a worker key file is named worker-I.key"):
        K.load_server_keys(keydir)


@pytest.mark.timeout(60)
def test_a_key_speaks_only_for_its_own_worker(keydir):
    """Worker 1's key asks first to be worker 0: refused, naming both; then the real
    worker 0 and worker 1 train (old rule: first come, first served, the real worker 0
    refused)."""
    with psrv.launch.start_local_servers(1, keys=keydir, worker_timeout=30) as servers:
        def connect(w, key_of):
            return psrv.Client(servers.endpoints, w, 2, timeout=10, consistency=Consistency("asp"),
                               keys=K.load_worker_keys(keydir, key_of))
        intruder = connect(0, 1)
        with pytest.raises(psrv.PSError, match="belongs to worker 1: it may not speak for worker 0"):
            intruder.init(start_params(), SGD)
        intruder.close()
        workers = [connect(w, w) for w in range(2)]
        params = [start_params() for _ in workers]
        for c, p in zip(workers, params):
            c.init(p, SGD)
        for c, p in zip(workers, params):
            c.push_pull(grads(0, c.worker_id), p, 0).wait()
        assert sum(workers[0].stats()["histogram"].values()) == 2 * len(workers[0].placement.slices)
        for c in workers:
            c.close()
        assert servers.wait(30) == [0]


def raw_socket(ctx, endpoint, routing_id=None, rcvhwm=None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if rcvhwm:                       # what a peer that wants the server to hold its replies does
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


@pytest.mark.timeout(90)
def test_a_worker_that_never_reads_its_replies_is_stopped_at_the_limit():
    """ASP, W=2, a 1 MiB key, --max-unread-mib 8: worker 0 (a raw socket that reads
    nothing) sends 150 PUSH + PULL pairs, so every reply pins a fresh copy of the key.
    The shard stops serving it once 8 MiB are unread, naming it (its own count, from
    its log, at most the limit); it grows by far less than the 150 MiB the replies
    would pin; worker 1 is still served.  Its resident memory also holds the pushes
    ZeroMQ queued before the shard read them, at most server.RECEIVE_HWM (8) of 1 MiB
    here, and freed frames stay in heap.py's tuned heap: 14 MiB on a quiet machine
    (with 1000 queued pushes allowed: 23 MiB quiet, 53 MiB on a loaded one)."""
    n = 1 << 18                                              # float32: 1 MiB
    opts = dict(worker_timeout=30, max_unread_mib=8)
    with psrv.launch.start_local_servers(1, **opts) as servers:
        pid = servers.procs[0].pid
        ctx = zmq.Context()
        hog = raw_socket(ctx, servers.endpoints[0], rcvhwm=1)
        entry = P.Entry(0, 0, n, (n,), nframes=1)
        cfg = pack_config(SGD, Consistency("asp"), 2)
        value = np.arange(n, dtype=np.float32) % 7
        hog.send_multipart(P.encode(P.Op.INIT, 0, 1, [entry], [cfg, b"w"], [value]))
        time.sleep(0.5)
        before = rss_mib(pid)
        grad = np.full(n, 0.25, np.float32)
        for step in range(150):
            hog.send_multipart(P.encode(P.Op.PUSH, 0, 2 + 2 * step,
                                        [P.Entry(0, 0, n, (n,), nframes=1, step=step)],
                                        payload=[grad]))
            hog.send_multipart(P.encode(P.Op.PULL, 0, 3 + 2 * step, [P.Entry(0, 0, n, (n,))]))
        wait_for_log(servers, "worker 0 has")
        log = servers.log(0)
        assert "of replies it has not read (limit 8.0 MiB): it is not reading its replies" in log
        held = re.search(r"worker 0 has ([\d.]+) MiB of replies it has not read", log)
        assert held and float(held.group(1)) <= 8.0, log
        with psrv.Client(servers.endpoints, 1, 2, timeout=10, consistency=Consistency("asp")) as c:
            out = {"w": np.zeros(n, np.float32)}
            c.init(out, SGD)
            c.push_pull({"w": grad}, out, 0).wait()
            assert np.all(out["w"] < value + 1e-6) and np.any(out["w"] != value)
            grown = rss_mib(pid) - before
            assert grown < 40, f"the unread replies grew the server by {grown:.0f} MiB"
        hog.close()
        ctx.term()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("step_messages", [None, 24], ids=["by-hand", "launched"])
def test_a_worker_that_pushes_faster_than_the_shard_reads_parks_a_few_messages_in_it(
        step_messages):
    """A shard (in this process, not serving yet: a busy one, as ZeroMQ sees it) and a
    raw worker that sends 4 MiB PUSHes without waiting: ZeroMQ takes at most the shard's
    receive high-water mark of them into its queue (+ one in the worker's own queue of
    1, and what the kernel's socket buffers hold), then the sends block.  libzmq's
    default of 1000 took all 64 here (256 MiB parked in the shard).  The mark is set at
    the bind: server.RECEIVE_HWM (8) for a shard started by hand, one step's messages of
    a worker when its launcher counted them (launch.step_messages; 24 here)."""
    from psrv.server import Server, receive_hwm
    shard = Server(worker_timeout=30, step_messages=step_messages)
    hwm = receive_hwm(step_messages)
    ctx = zmq.Context()
    hog = ctx.socket(zmq.DEALER)
    try:
        assert shard.sock.getsockopt(zmq.RCVHWM) == hwm
        hog.setsockopt(zmq.LINGER, 0)
        hog.setsockopt(zmq.SNDHWM, 1)
        hog.connect(shard.endpoint)
        n = 1 << 20                                          # float32: 4 MiB
        grad = np.full(n, 0.25, np.float32)
        push = P.encode(P.Op.PUSH, 0, 2, [P.Entry(0, 0, n, (n,), nframes=4)],
                        payload=[grad[i * n // 4:(i + 1) * n // 4] for i in range(4)])
        sent, last = 0, time.monotonic()
        while sent < 64 and time.monotonic() - last < 1.5:  # until no send goes for 1.5 s
            try:
                hog.send_multipart(push, flags=zmq.NOBLOCK, copy=False)
                sent, last = sent + 1, time.monotonic()
            except zmq.Again:
                time.sleep(0.01)
        assert sent <= hwm + 4, f"the shard took {sent} unread 4 MiB messages (mark {hwm})"
        assert sent >= hwm, f"only {sent} sent: the shard's queue of {hwm} was not filled"
    finally:
        # the shard reads all, so that the hog closes between messages: libzmq 4.3.5 aborts
        # closing a LINGER 0 socket whose I/O thread is inside a multipart message
        # (session_base_t::clean_pipes finds the rest of it gone)
        while shard.sock.poll(500):
            shard.sock.recv_multipart()
        hog.close()
        shard.listener.close()
        ctx.term()


def test_a_reply_counts_as_unread_until_zeromq_lets_go_of_it_even_with_a_small_last_frame(tmp_path):
    """Tier (b): an Outbox on a real ROUTER, a peer that reads nothing.  Each reply holds
    a 4 MiB key and then a 16-byte one, a last frame that pyzmq would copy (below
    zmq.COPY_THRESHOLD) and report done at once; the outbox tracks the last frame
    anyway, so what the peer leaves unread is counted, and an update of the big key
    copies the value that a queued reply still holds."""
    ctx, peer_ctx = zmq.Context(), zmq.Context()     # as if in two processes
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/shard")
    peer = raw_socket(peer_ctx, f"ipc://{tmp_path}/shard", routing_id=b"w1", rcvhwm=1)
    peer.send(b"hello")
    assert router.poll(5000) and router.recv_multipart()[0] == b"w1"   # the route exists
    n = 1 << 20
    big, small = Key("big", 0, n, (n,)), Key("small", 0, 4, (4,))
    big.value, small.value = np.arange(n, dtype=np.float32), np.ones(4, np.float32)
    entries = [P.Entry(0, 0, n, (n,)), P.Entry(1, 0, 4, (4,))]
    outbox = Outbox(router, shard_id=0)
    for request in range(4):       # the peer's queue (1 message) and the kernel take < 2
        outbox.values(b"w1", request, 1, {0: big, 1: small}, entries, limit=1 << 30)
    time.sleep(0.2)                # let ZeroMQ move what it can
    assert outbox.unread(1) >= 2 * 4 * (n + 4), outbox.unread(1)
    held = big.value
    assert big.writable() is not held and np.array_equal(held, np.arange(n, dtype=np.float32))
    router.close()                 # the shard first, as a shard that stops
    ctx.term()
    peer.close()
    peer_ctx.term()


def start_handshake(address):
    """A TCP connection that greets as a ZMTP 3.0 CURVE client and then sends most of
    a HELLO command announced as large as the largest legal frame: libzmq buffers
    it until the frame is complete or the handshake interval ends."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") \
        + b"\0" + bytes(31)
    size = P.MAX_FRAME_BYTES
    conn = socket.create_connection(address, timeout=5)
    try:
        conn.sendall(greeting + b"\x06" + struct.pack(">Q", size) + bytes(size - 4096))
    except OSError:
        pass                              # cut by the server: as it should be
    return conn


def still_open(conn):
    """False once the server has closed it (what it sent before, its greeting, is read)."""
    conn.settimeout(0.05)
    try:
        while conn.recv(1 << 16):
            pass
        return False
    except socket.timeout:
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_unauthenticated_connections_are_capped_in_number_time_and_log_lines(keydir):
    """A CURVE server for 2 worker keys holds at most 2 x 2 + 16 = 20 connections; the
    64 unfinished handshakes would pin 256 MiB (libzmq's default: for 30 s)."""
    with psrv.launch.start_local_servers(1, keys=keydir, worker_timeout=30,
                                         transport="tcp") as servers:
        pid = servers.procs[0].pid
        address = ("127.0.0.1", int(servers.endpoints[0].rsplit(":", 1)[1]))
        before = rss_mib(pid)
        conns = [start_handshake(address) for _ in range(64)]
        time.sleep(1.0)                                         # the server's loop cuts
        held = sum(map(still_open, conns))
        grown = rss_mib(pid) - before
        assert held <= 20, f"{held} unauthenticated connections held"
        assert grown < 120, f"64 unfinished handshakes grew the server by {grown:.0f} MiB"
        end = time.monotonic() + 15                             # HANDSHAKE_IVL: 5 s
        while any(still_open(c) for c in conns):
            assert time.monotonic() < end, "a handshake was held for more than 15 s"
        for c in conns:
            c.close()
        refusals = [line for line in servers.log(0).splitlines() if "refused" in line]
        assert 1 <= len(refusals) <= 6, "\n".join(refusals)       # not one per connection
        assert "connections open, the limit is 20" in servers.log(0)
        with psrv.Client(servers.endpoints, 0, 1, timeout=10,
                         keys=K.load_worker_keys(keydir, 0)) as c:   # still served
            params = start_params()
            c.init(params, SGD)
            c.push_pull(grads(0), params, 0).wait()


@pytest.mark.timeout(60)
def test_a_plain_servers_connections_are_capped_from_its_workers_count():
    """Loopback, no keys: once worker 0's INIT names W=2, the shard holds at most
    2 x 2 + 16 = 20 connections (the worker's two among them); 40 more that connect and
    say nothing are cut above it, the refusal logged in a line or a few, not one per
    connection; each held one lasts at most the handshake interval (5 s), and the
    worker and a late worker 1 are served after."""
    with psrv.launch.start_local_servers(1, worker_timeout=30, transport="tcp") as servers:
        address = ("127.0.0.1", int(servers.endpoints[0].rsplit(":", 1)[1]))
        asp = Consistency("asp")
        first = psrv.Client(servers.endpoints, 0, 2, timeout=10, consistency=asp)
        params = start_params()
        first.init(params, SGD)
        conns = [socket.create_connection(address, timeout=5) for _ in range(40)]
        time.sleep(1.0)                                         # the server's loop cuts
        held = sum(map(still_open, conns))
        assert held <= 20 - 2, f"{held} connections held beside the worker's two"
        end = time.monotonic() + 15                             # HANDSHAKE_IVL: 5 s
        while any(still_open(c) for c in conns):
            assert time.monotonic() < end, "a handshake was held for more than 15 s"
        for c in conns:
            c.close()
        wait_for_log(servers, "connections open, the limit is 20 (2 per worker + 16)")
        refusals = [line for line in servers.log(0).splitlines() if "refused" in line]
        assert 1 <= len(refusals) <= 6, "\n".join(refusals)       # not one per connection
        late = psrv.Client(servers.endpoints, 1, 2, timeout=10, consistency=asp)
        late.init(start_params(), SGD)
        first.push_pull(grads(0), params, 0).wait()
        late.push_pull(grads(0, 1), start_params(), 0).wait()
        first.close()
        late.close()


@pytest.mark.timeout(60)
def test_a_client_without_keys_names_the_refused_handshake_at_once(keydir):
    with psrv.launch.start_local_servers(1, keys=keydir, worker_timeout=30) as servers:
        plain = psrv.Client(servers.endpoints, 0, 1, timeout=20)        # loopback: no keys needed
        began = time.monotonic()
        with pytest.raises(psrv.PSError, match="refused the handshake: .* this worker has no "
                                               "keys; is the server a CURVE server"):
            plain.init(start_params(), SGD)
        assert time.monotonic() - began < 10                   # not the 20 s timeout
        plain.close()


def stranger_heartbeats(endpoint, worker, stop):
    """Until stop is set: HEARTBEATs for worker every 0.2 s on two connections of our
    own, one with a heartbeat-socket routing id (protocol.routing_ids) of a wrong twin."""
    ctx = zmq.Context()
    strangers = [raw_socket(ctx, endpoint), raw_socket(ctx, endpoint, P.routing_ids(os.urandom(15))[1])]
    while not stop.wait(0.2):
        for s in strangers:
            s.send_multipart(P.encode(P.Op.HEARTBEAT, worker, 0))
    for s in strangers:
        s.close()
    ctx.term()


@pytest.mark.timeout(60)
def test_heartbeats_from_another_connection_keep_no_dead_worker_alive():
    """Loopback, no keys, BSP, W=2: worker 1 (a raw socket) sends its INIT and goes
    silent, as if killed, while a stranger sends HEARTBEATs for worker 1 from then on.
    The survivor still gets the death error, not its own timeout."""
    with psrv.launch.start_local_servers(1, worker_timeout=3) as servers:
        ctx = zmq.Context()
        victim = raw_socket(ctx, servers.endpoints[0], routing_id=P.routing_ids(os.urandom(15))[0])
        cfg = pack_config(SGD, Consistency("bsp"), 2)
        victim.send_multipart(P.encode(P.Op.INIT, 1, 1, [P.Entry(0, 0, 4, (4,))], [cfg, b"b"]))
        stop = threading.Event()
        beats = threading.Thread(target=stranger_heartbeats, args=(servers.endpoints[0], 1, stop))
        beats.start()
        try:
            survivor = psrv.Client(servers.endpoints, 0, 2, timeout=20)
            params = {"b": np.arange(4, dtype=np.float32)}
            survivor.init(params, SGD)
            began = time.monotonic()
            with pytest.raises(psrv.PSError, match="worker 1 sent nothing for .* fails the bsp run"):
                survivor.push_pull({"b": np.ones(4, np.float32)}, params, 0).wait()
            assert time.monotonic() - began < 15                 # not the 20 s timeout
            assert "is not the twin of the connection that registered worker 1" in servers.log(0)
            survivor.close()
        finally:
            stop.set()
            beats.join(10)
            victim.close()
            ctx.term()


def test_a_key_exchanged_under_mpiexec_binds_to_the_first_id_it_speaks_for():
    """keys.for_mpi_rank's keys (no file, the id decided after the exchange: a hybrid
    node leader speaks for its node's index) bind at first use, then hold."""
    from psrv.auth import Members
    one, two = b"1" * 40, b"2" * 40
    members = Members({one: None, two: None})
    members.bind(b"a", one, 1)                     # rank 2's key, speaking for node 1
    members.bind(b"a", one, 1)
    with pytest.raises(ValueError, match="worker 1 belongs to another client key"):
        members.bind(b"b", two, 1)
    with pytest.raises(ValueError, match="belongs to worker 1: it may not speak for worker 0"):
        members.bind(b"c", one, 0)
    members.bind(b"b", two, 0)
