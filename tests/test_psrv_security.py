"""Tier (c): the parameter server is no open door.  Real server processes, real sockets.

    off loopback, no keys        the server refuses to start, naming --keys
    keys                         `python -m psrv.keys` writes 0600 files; bad files refused
    with keys                    every client operation works
    no key, unknown key          a plain DEALER and a client with an unknown key get nothing
    replayed bytes               TCP bytes captured from real workers (INIT, PUSH, PULL,
                                 HEARTBEAT, BYE), replayed on new connections, do nothing,
                                 on a live server and on a fresh one with the same keys
    one worker, one owner        a second connection claiming a worker id is refused
    memory                       an INIT declaring W=4096 x 1,024 keys stays small; a larger
                                 product is refused; a frame above the largest legal one is
                                 dropped by libzmq
"""
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

import psrv
from conftest import ROOT
from psrv import keys as K
from psrv import protocol as P
from psrv.config import Consistency, OptimizerConfig, pack_config

SHAPES = {"w": (6, 4), "b": (4,)}
SGD = OptimizerConfig("sgd", lr=0.5)


def start_params():
    return {n: (np.arange(np.prod(s), dtype=np.float32).reshape(s) % 5) / 4 for n, s in SHAPES.items()}


def grads(step):
    return {n: ((np.arange(np.prod(s)) % 4 - 1.5) * (1 + step % 3) / 8).astype(np.float32).reshape(s)
            for n, s in SHAPES.items()}


@pytest.fixture
def keydir(tmp_path):
    K.generate(str(tmp_path / "keys"), 3)
    return str(tmp_path / "keys")


def worker(servers, keydir, w, num_workers, mode="asp", endpoints=None, timeout=10):
    return psrv.Client(endpoints or servers.endpoints, w, num_workers, timeout=timeout,
                       consistency=Consistency(mode), keys=K.load_worker_keys(keydir, w))


@pytest.mark.timeout(30)
def test_a_non_loopback_bind_without_keys_exits_at_once():
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "psrv.server", "--bind", "tcp://0.0.0.0:0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert run.returncode == 2 and time.monotonic() - began < 15
    assert "refusing to bind tcp://0.0.0.0:0 without authentication" in run.stderr
    assert "--keys DIR" in run.stderr and "python -m psrv.keys" in run.stderr


@pytest.mark.timeout(30)
def test_keys_command_writes_private_files_and_loaders_refuse_bad_ones(tmp_path):
    d = tmp_path / "keys"
    cmd = [sys.executable, "-m", "psrv.keys", str(d), "--workers", "2"]
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=20).returncode == 0
    names = sorted(str(p.relative_to(d)) for p in d.rglob("*.key*"))
    assert names == ["server.key", "server.key_secret", "workers/worker-0.key",
                     "workers/worker-0.key_secret", "workers/worker-1.key",
                     "workers/worker-1.key_secret"]
    assert {stat.S_IMODE(p.stat().st_mode) for p in d.rglob("*.key*")} == {0o600}
    server, w1 = K.load_server_keys(str(d)), K.load_worker_keys(str(d), 1)
    assert w1.public in server.clients and w1.servers == (server.public,)
    assert "secret" not in repr(server) and server.secret.decode() not in repr(server)
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    os.chmod(d / "server.key_secret", 0o644)
    with pytest.raises(ValueError, match="may be read by group or others"):
        K.load_server_keys(str(d))
    (d / "workers" / "worker-1.key_secret").write_text("")
    with pytest.raises(ValueError, match="worker-1.key_secret"):
        K.load_worker_keys(str(d), 1)
    for bad in (b"", b"short", b"~" * 40, b"#" * 40):
        with pytest.raises(ValueError, match="server public key"):
            K.ClientKeys(w1.public, w1.secret, bad)


@pytest.mark.timeout(60)
def test_every_client_operation_works_with_keys(keydir, tmp_path):
    with psrv.launch.start_local_servers(2, keys=keydir, worker_timeout=30,
                                         checkpoint_dir=str(tmp_path)) as servers:
        c = worker(servers, keydir, 0, 1, mode="bsp")
        params = start_params()
        assert c.init(params, SGD) == 0
        c.push("w", grads(0)["w"], 0)
        c.push("b", grads(0)["b"], 0)
        out = np.empty(SHAPES["w"], np.float32)
        c.pull("w", out)
        np.testing.assert_array_equal(out, start_params()["w"] - np.float32(0.5) * grads(0)["w"])
        c.pull_async({"b": params["b"]}).wait()
        c.push_async(grads(1), 1).wait()
        c.push_pull(grads(2), params, 2).wait()
        assert sum(c.stats()["histogram"].values()) == 3 * len(c.placement.slices)
        assert c.checkpoint() == [str(tmp_path / f"shard{i}-of-2.npz") for i in range(2)]
        c.close()
        assert servers.wait(30) == [0, 0]                       # BYE arrived, authenticated
        assert "CURVE, 3 client keys" in servers.log(0)


def raw_messages(worker_id=0):
    """What a worker sends, in plain frames: INIT, PULL, PUSH, HEARTBEAT, BYE."""
    entries = [P.Entry(0, 0, 4, (4,), nframes=1)]
    cfg = pack_config(OptimizerConfig("sgd", lr=0.125), Consistency("asp"), 1)
    return [P.encode(P.Op.INIT, worker_id, 1, entries, [cfg, b"x"], [np.ones(4, np.float32)]),
            P.encode(P.Op.PULL, worker_id, 2, [P.Entry(0, 0, 4, (4,))]),
            P.encode(P.Op.PUSH, worker_id, 3, entries, payload=[np.ones(4, np.float32)]),
            P.encode(P.Op.HEARTBEAT, worker_id, 0), P.encode(P.Op.BYE, worker_id, 4)]


@pytest.mark.timeout(60)
def test_no_key_or_an_unknown_key_gets_nothing(keydir):
    with psrv.launch.start_local_servers(1, keys=keydir, worker_timeout=30) as servers:
        ctx = zmq.Context()
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(servers.endpoints[0])
        for frames in raw_messages():
            plain.send_multipart(frames)
        assert not plain.poll(1500)                           # not even an ERROR
        plain.close()
        ctx.term()
        public, secret = zmq.curve_keypair()
        server = K.load_worker_keys(keydir, 0).servers
        stranger = psrv.Client(servers.endpoints, 0, 1, timeout=10,
                               keys=K.ClientKeys(public, secret, server))
        began = time.monotonic()
        with pytest.raises(psrv.PSError, match="refused the CURVE handshake: "
                                               "handshake_failed_auth \\(status 400\\)"):
            stranger.init(start_params(), SGD)
        assert time.monotonic() - began < 5                    # at once, not at the timeout
        stranger.close()
        # the real worker 0 is the first to configure the server: nothing above did
        with worker(servers, keydir, 0, 1) as c:
            params = start_params()
            c.init(params, SGD)
            c.push_pull(grads(0), params, 0).wait()
            assert sum(c.stats()["histogram"].values()) == len(c.placement.slices)
        assert servers.wait(30) == [0]
        log = servers.log(0)
        assert "refused a connection: handshake failed: handshake_failed_" in log   # plain peer
        assert f"client key {public.decode()} is not in the key set" in log   # the stranger


class RecordingProxy:
    """A TCP relay to a server that records every byte the clients send: what an
    eavesdropper on the wire captures.  cut() breaks every link (a network failure)."""

    def __init__(self, target):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.streams, self.links = [], []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                near, _ = self.listener.accept()
                far = socket.create_connection(self.target)
            except OSError:
                return
            self.links += [near, far]
            self.streams.append(bytearray())
            threading.Thread(target=self._pump, args=(near, far, self.streams[-1]), daemon=True).start()
            threading.Thread(target=self._pump, args=(far, near, None), daemon=True).start()

    @staticmethod
    def _pump(src, dst, record):
        while True:
            try:
                data = src.recv(1 << 16)
                if not data:
                    break
                if record is not None:
                    record += data
                dst.sendall(data)
            except OSError:
                break

    def cut(self):
        for s in [self.listener] + self.links:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def replay(address, streams, seconds):
    """Send each captured stream on a new connection, again and again, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for data in streams:
            try:
                with socket.create_connection(address, timeout=1) as s:
                    s.sendall(bytes(data))
                    s.settimeout(0.1)
                    while s.recv(1 << 16):
                        pass
            except OSError:
                pass                                  # the server hung up: as it should


@pytest.mark.timeout(90)
def test_replayed_bytes_get_nothing_done(keydir):
    """W=3, ASP: worker 1 trains and says BYE and worker 2 trains until its network is
    cut, both through a recording relay; worker 0 is direct.  Replaying everything they
    sent keeps nobody alive, applies nothing, and on a fresh server with the same keys
    neither configures it nor closes anyone."""
    opts = dict(keys=keydir, worker_timeout=2, on_worker_death="continue", transport="tcp")
    with psrv.launch.start_local_servers(1, **opts) as servers:
        address = ("127.0.0.1", int(servers.endpoints[0].rsplit(":", 1)[1]))
        proxy = RecordingProxy(address)
        cs = [worker(servers, keydir, w, 3, endpoints=[proxy.endpoint] if w else None,
                     timeout=3 if w else 10) for w in range(3)]
        ps = [start_params() for _ in cs]
        for c, p in zip(cs, ps):
            c.init(p, SGD)
        for step in range(2):
            for c, p in zip(cs, ps):
                c.push_pull(grads(step), p, step).wait()
        cs[1].push("b", grads(2)["b"], 2)             # a PUSH and a PULL on the wire
        cs[1].pull("w", np.empty(SHAPES["w"], np.float32))
        time.sleep(1.0)                               # a few heartbeats on the wire
        cs[1].close()                                 # its BYE is on the wire too
        before = cs[0].stats()["histogram"]
        values = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
        cs[0].pull_async(values).wait()
        proxy.cut()                                   # worker 2 is gone
        replay(address, proxy.streams, seconds=4)     # longer than worker_timeout
        assert "worker 2 sent nothing" in servers.log(0)            # no replayed heartbeat counted
        assert cs[0].stats()["histogram"] == before                  # no replayed push applied
        out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
        cs[0].pull_async(out).wait()
        for n in out:
            np.testing.assert_array_equal(out[n], values[n])
        assert "handshake failed" in servers.log(0)
        cs[0].close()
        cs[2].close()
        assert servers.wait(30) == [0]
    with psrv.launch.start_local_servers(1, keys=keydir, worker_timeout=30,
                                         transport="tcp") as servers:
        address = ("127.0.0.1", int(servers.endpoints[0].rsplit(":", 1)[1]))
        replay(address, proxy.streams, seconds=1)
        cs = [worker(servers, keydir, w, 3) for w in range(3)]
        ps = [start_params() for _ in cs]
        for c, p in zip(cs, ps):                       # a replayed INIT would have fixed
            c.init(p, OptimizerConfig("sgd", lr=0.25))  # lr = 0.5 (refused as different)
        for c, p in zip(cs, ps):                       # a replayed BYE: "has closed"
            c.push_pull(grads(0), p, 0).wait()
        assert sum(cs[0].stats()["histogram"].values()) == 3 * len(cs[0].placement.slices)
        for c in cs:
            c.close()
        assert servers.wait(30) == [0]


@pytest.mark.timeout(60)
def test_a_worker_id_belongs_to_the_connection_that_registered_it():
    """Without keys (loopback); with keys a worker id belongs to its own key
    (test_psrv_abuse.py)."""
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        owner = psrv.Client(servers.endpoints, 0, 2, timeout=10)
        owner.init(start_params(), SGD)
        intruder = psrv.Client(servers.endpoints, 0, 2, timeout=10)
        with pytest.raises(psrv.PSError, match="worker 0 is already registered by another connection"):
            intruder.init(start_params(), SGD)
        intruder.close()
        owner.close()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.timeout(60)
def test_an_init_for_many_workers_and_keys_stays_small(tmp_path):
    """Unauthenticated (loopback) INITs from worker 1 of W=4096: 65,536 keys are refused;
    1,024 keys (a 67 KB frame) grow the server by a few MiB at most."""
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        pid = servers.procs[0].pid
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(servers.endpoints[0])
        cfg = pack_config(SGD, Consistency("bsp"), 4096)

        def init(num_keys):
            """Send the INIT, then a STATS; -> the replies before the STATS reply."""
            entries = [P.Entry(k, 0, 1, (1,)) for k in range(num_keys)]
            names = "\n".join(f"k{k}" for k in range(num_keys)).encode()
            raw.send_multipart(P.encode(P.Op.INIT, 1, 7, entries, [cfg, names]))
            raw.send_multipart(P.encode(P.Op.STATS, 1, 8))
            replies = []
            while True:
                assert raw.poll(20_000)
                replies.append(P.decode(raw.recv_multipart()))
                if replies[-1].request == 8:
                    return replies[:-1]

        (reply,) = init(65_536)
        assert reply.op == P.Op.ERROR and "key-worker pairs" in bytes(reply.extras[0]).decode()
        time.sleep(0.2)
        before = rss_kib(pid)
        assert len(P.encode(P.Op.PULL, 1, 7, [P.Entry(k, 0, 1, (1,)) for k in range(1024)])[0]) \
            == 28 + 1024 * 64
        assert init(1024) == []          # held: worker 0 has not sent the values
        grown = (rss_kib(pid) - before) / 1024
        assert grown < 8, f"the INIT grew the server by {grown:.1f} MiB"
        raw.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_a_frame_larger_than_any_legal_one_never_reaches_the_server():
    """MAXMSGSIZE is protocol.MAX_FRAME_BYTES: libzmq drops the connection of a peer that
    sends a larger frame before a byte of it is buffered for the server; others go on."""
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        ctx = zmq.Context()
        socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(servers.endpoints[0])
        big, fine = socks
        big.send(bytes(P.MAX_FRAME_BYTES + 1))         # would be an ERROR reply if it arrived
        assert not big.poll(1500)
        fine.send(bytes(P.MAX_FRAME_BYTES))            # the largest legal size still arrives
        assert fine.poll(10_000)
        assert "bad magic" in bytes(P.decode(fine.recv_multipart()).extras[0]).decode()
        for s in socks:
            s.close()
        ctx.term()


def test_a_client_without_keys_refuses_a_server_off_loopback():
    """Gradients never travel in clear off this host: the client says what to pass."""
    from psrv import Client
    with pytest.raises(ValueError, match="off loopback: pass keys"):
        Client(["tcp://127.0.0.1:5555", "tcp://192.0.2.1:5555"], 0, 1)
