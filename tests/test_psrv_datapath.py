"""The data path: replies received straight into `out`, and what the client does with a
reply whose frames do not fit; ipc:// endpoints and who may use them.

Tier (a)/(b): a real Client against a scripted server (a ROUTER in a thread of this
process, on an ipc socket in pytest's private tmp_path), so each reply can be
malformed on purpose; one tier (c) test runs real server processes on ipc://.
"""
import os
import stat
import struct
import threading

import numpy as np
import pytest
import zmq

import psrv
from psrv import protocol as P
from psrv.server import Server

N = 3000                                       # elements of the one parameter "w"
CHUNK = 1000                                   # elements per payload frame of the replies


class ScriptedServer:
    """Answers each request with the VALUES that `reply(request_id)` makes (a list of
    frames after the header's entries), or the correct ones when reply returns None."""

    def __init__(self, endpoint, reply, lie_about_size=False):
        self.lie_about_size = lie_about_size
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.reply, self.stop = reply, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = P.decode(frames)
            if msg.op in (P.Op.BYE, P.Op.ABORT):
                self.sock.send_multipart([identity, *P.encode(P.Op.OK, 0, msg.request, extras=[b"bye"])])
                continue
            if msg.op == P.Op.HEARTBEAT:
                continue
            values = (np.arange(N, dtype=np.float32) + 1000 * msg.request)
            entry, frames = self.reply(msg.request, values) or good_reply(values)
            reply = P.encode(P.Op.VALUES, 0, msg.request, [entry], payload=frames)
            if self.lie_about_size and msg.request == 1:
                reply[0] = reply[0][:20] + struct.pack("<Q", 7) + reply[0][28:]
            self.sock.send_multipart([identity, *reply])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def good_reply(values, key=0):
    parts = P.chunks(values, CHUNK * 4)
    return P.Entry(key, 0, N, (N,), nframes=len(parts)), parts


BAD = {  # what the server does wrong -> words of the client's error
    "frame too big": (lambda v: (P.Entry(0, 0, N, (N,), nframes=2),
                                 [v[:CHUNK], np.concatenate([v, v])]), "a frame of"),
    "odd frame size": (lambda v: (P.Entry(0, 0, N, (N,), nframes=2),
                                  [v.view(np.uint8)[:4001], v.view(np.uint8)[4001:]]), "a frame of"),
    "too few bytes": (lambda v: (P.Entry(0, 0, N, (N,), nframes=1), [v[:CHUNK]]), "bytes in 1 frames"),
    "frame missing": (lambda v: (P.Entry(0, 0, N, (N,), nframes=3), [v[:CHUNK], v[CHUNK:]]),
                      "frame 2 of 3 is missing"),
    "extra frame": (lambda v: (P.Entry(0, 0, N, (N,), nframes=1), [v, v[:4]]), "more frames"),
    "not its slice": (lambda v: (P.Entry(7, 0, N, (N,), nframes=1), [v]), "not a float32 slice"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", sorted(BAD))
def test_a_reply_that_does_not_fit_out_is_named_and_the_next_one_lands(tmp_path, what):
    """INIT's reply is bad: a PSError names it.  The client then reads the next reply
    from its first frame (the bad one was drained), and a pull fills `out` exactly."""
    make, words = BAD[what]
    server = ScriptedServer(f"ipc://{tmp_path}/s0", lambda request, v: make(v) if request == 1 else None)
    client = psrv.Client([f"ipc://{tmp_path}/s0"], 0, 1, timeout=10)
    try:
        params = {"w": np.zeros(N, np.float32)}
        with pytest.raises(psrv.PSError, match=f"malformed reply: .*{words}"):
            client.init(params, psrv.OptimizerConfig("sgd", lr=0.1))
        out = {"w": np.full(N, -1, np.float32)}
        client.pull_async(out).wait()                   # request 2
        np.testing.assert_array_equal(out["w"], np.arange(N, dtype=np.float32) + 2000)
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_reply_whose_header_lies_about_its_payload_size_is_named(tmp_path):
    server = ScriptedServer(f"ipc://{tmp_path}/s0", lambda request, v: None, lie_about_size=True)
    client = psrv.Client([f"ipc://{tmp_path}/s0"], 0, 1, timeout=10)
    try:
        with pytest.raises(psrv.PSError, match="payload_bytes 7 != 12000 received"):
            client.init({"w": np.zeros(N, np.float32)}, psrv.OptimizerConfig("sgd", lr=0.1))
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(60)
def test_replies_land_in_out_in_place_and_in_any_order(tmp_path):
    """Two pulls in flight, waited for in reverse order: each out gets its own reply,
    and no other array is written."""
    server = ScriptedServer(f"ipc://{tmp_path}/s0", lambda request, v: None)
    client = psrv.Client([f"ipc://{tmp_path}/s0"], 0, 1, timeout=10)
    try:
        params = {"w": np.zeros(N, np.float32)}
        client.init(params, psrv.OptimizerConfig("sgd", lr=0.1))          # request 1
        np.testing.assert_array_equal(params["w"], np.arange(N, dtype=np.float32) + 1000)
        a, b = {"w": np.empty(N, np.float32)}, {"w": np.empty(N, np.float32)}
        keep = {"w": a["w"]}
        ha, hb = client.pull_async(a), client.pull_async(b)               # requests 2, 3
        hb.wait()
        ha.wait()
        assert a["w"] is keep["w"]                                        # filled in place
        np.testing.assert_array_equal(a["w"], np.arange(N, dtype=np.float32) + 2000)
        np.testing.assert_array_equal(b["w"], np.arange(N, dtype=np.float32) + 3000)
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(30)
def test_an_ipc_socket_others_could_reach_is_refused_without_keys(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ValueError, match="has mode 0o755 .*others on this host could connect"):
        Server(f"ipc://{shared}/s0")
    with pytest.raises(ValueError, match="abstract socket"):
        Server("ipc://@psrv-test")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    server = Server(f"ipc://{private}/s0")
    assert server.endpoint == f"ipc://{private}/s0"
    server.listener.close()


@pytest.mark.timeout(60)
def test_local_servers_listen_on_ipc_in_a_private_directory():
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        (endpoint,) = servers.endpoints
        assert endpoint.startswith("ipc://")
        directory = os.path.dirname(endpoint[len("ipc://"):])
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        with psrv.Client(servers.endpoints, 0, 1, timeout=20) as client:
            params = {"w": np.arange(10, dtype=np.float32)}
            client.init(params, psrv.OptimizerConfig("sgd", lr=0.5))
            client.push_pull({"w": np.ones(10, np.float32)}, params, 0).wait()
            np.testing.assert_allclose(params["w"], np.arange(10) - 0.5, rtol=0, atol=1e-6)
        assert servers.wait(30) == [0]
    assert not os.path.exists(directory)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["serial", "one", "two"])
def test_the_echo_benchmark_times_each_shape_of_round_trip(tmp_path, shape):
    """psrv.bench_echo: each shape's echo comes back and is timed (wall and CPU > 0),
    over ipc:// in a directory of the test's own."""
    from psrv.bench_echo import MIB, rounds_of
    wall, cpu = rounds_of(shape, str(tmp_path), 8 * MIB, 2)
    assert wall > 0 and cpu > 0
