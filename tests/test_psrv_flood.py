"""Tier (c): a shard flooded by peers that send more than any worker would.  Real server
processes, real sockets, resident memory read from /proc.

    big messages         3 connections x 3 PUSHes of 32 frames of 1 MiB, for a key of 1 MiB:
                         each refused; the shard stays within 150 MiB of its baseline while
                         they arrive, and is back near it a second after the last refusal
                         (heap.trim); a worker is still served
    tiny frames          a key's payload cut into 4-byte frames (each a libzmq message of its
                         own): refused, naming protocol.most_frames
    one key, many        8 CURVE connections of one admitted key: the 5th and later are cut
    connections          at their first message (auth.KEY_CONNECTIONS), the key's worker is
                         still served

What the shard cannot refuse before it arrives: libzmq hands a multipart message over
only once its last frame is in, and neither its high-water mark (whole messages) nor
MAXMSGSIZE (one frame) counts a message's frames; so a message is buffered whole, and
the shard's peak is about (connections) x (message size).  In libzmq's source,
pipe_t::write and pipe_t::read (src/pipe.cpp) count a message only at a frame without
the more flag, and the mark is checked against those counts; v2_decoder_t::size_ready
(src/v2_decoder.cpp) holds each frame's length against MAXMSGSIZE; ypipe_t::write
(src/ypipe.hpp) lets ypipe_t::flush hand the reader frames only up to a message's last
one.  No option in src/options.cpp caps the frames of one message.  The sizes here fit this
machine; docs/reliability.md has the figures of larger floods, measured with

    python -m tests.test_psrv_flood CONNECTIONS MESSAGES FRAMES     # e.g. 4 3 96
"""
import sys
import threading
import time

import numpy as np
import pytest
import zmq

import psrv
from psrv import auth
from psrv import keys as K
from psrv import protocol as P
from psrv.config import Consistency, OptimizerConfig

KEY = 1 << 18                      # float32 elements: a 1 MiB key
SGD = OptimizerConfig("sgd", lr=0.1)


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class PeakRss:
    """The highest resident memory of pid while the block runs, sampled every 5 ms."""

    def __init__(self, pid):
        self.pid, self.peak, self.done = pid, 0.0, threading.Event()

    def sample(self):
        while not self.done.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.005)

    def __enter__(self):
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def worker(servers, num_workers=1, **options):
    """Worker 0 of num_workers (asp) with its 1 MiB key declared and one step done."""
    c = psrv.Client(servers.endpoints, 0, num_workers, timeout=10,
                    consistency=Consistency("asp"), **options)
    params = {"w": np.arange(KEY, dtype=np.float32) % 7}
    c.init(params, SGD)
    c.push_pull({"w": np.ones(KEY, np.float32)}, params, 0).wait()
    return c, params


def flood(endpoint, connections=3, messages=3, frames=32):
    """PUSHes of `frames` MiB (a slice the shard does not hold) from fresh connections;
    -> the replies (ERRORs), once every message has been answered."""
    ctx = zmq.Context()
    n = frames * KEY
    chunk = np.zeros(KEY, np.float32)
    push = P.encode(P.Op.PUSH, 0, 7, [P.Entry(0, 0, n, (n,), nframes=frames)],
                    payload=[chunk] * frames)
    socks = []
    for _ in range(connections):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        socks.append(s)
    for _ in range(messages):
        for s in socks:
            s.send_multipart(push, copy=False)
    replies = [P.decode(s.recv_multipart()) for s in socks for _ in range(messages)
               if s.poll(30_000)]
    for s in socks:
        s.close()
    ctx.term()
    return replies


@pytest.mark.timeout(90)
def test_a_flood_of_big_messages_leaves_the_shard_near_its_baseline():
    with psrv.launch.start_local_servers(1, worker_timeout=60, transport="tcp") as servers:
        pid = servers.procs[0].pid
        c, params = worker(servers)
        time.sleep(0.5)
        baseline = rss_mib(pid)
        with PeakRss(pid) as during:
            replies = flood(servers.endpoints[0])
        assert len(replies) == 9 and all(r.op == P.Op.ERROR for r in replies)
        grown = during.peak - baseline
        assert grown < 150, f"the flood grew the shard by {grown:.0f} MiB while it arrived"
        end = time.monotonic() + 10
        while (after := rss_mib(pid) - baseline) > 40:     # heap.trim: 1 s after the last
            assert time.monotonic() < end, f"the shard stayed {after:.0f} MiB above its " \
                                           f"baseline after the flood (peak +{grown:.0f})"
            time.sleep(0.1)
        c.push_pull({"w": np.ones(KEY, np.float32)}, params, 1).wait()   # still served
        c.close()
        assert servers.wait(30) == [0]


@pytest.mark.timeout(60)
def test_a_key_cut_into_tiny_frames_is_refused():
    with psrv.launch.start_local_servers(1, worker_timeout=60, transport="tcp") as servers:
        c, params = worker(servers, num_workers=2)     # the raw socket speaks for worker 1
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(servers.endpoints[0])
        grad = np.ones(KEY, np.float32)
        frames = P.chunks(grad, 1024)                  # 1 KiB frames: 1024 for a 1 MiB key
        s.send_multipart(P.encode(P.Op.PUSH, 1, 9, [P.Entry(0, 0, KEY, (KEY,),
                                                            nframes=len(frames))],
                                  payload=frames))
        assert s.poll(10_000)
        reply = P.decode(s.recv_multipart())
        assert reply.op == P.Op.ERROR
        assert "1024 frames for 262144 elements, at most 1 (protocol.most_frames)" in \
            bytes(reply.extras[0]).decode()
        s.close()
        ctx.term()
        c.push_pull({"w": grad}, params, 1).wait()
        c.close()


@pytest.mark.timeout(60)
def test_one_key_speaks_on_at_most_key_connections(tmp_path):
    keydir = str(tmp_path / "keys")
    K.generate(keydir, 1)
    with psrv.launch.start_local_servers(1, keys=keydir, worker_timeout=60,
                                         transport="tcp") as servers:
        mine = K.load_worker_keys(keydir, 0)
        c, params = worker(servers, keys=mine)         # its request and heartbeat sockets
        time.sleep(1.0)                                # both have spoken (heartbeat: 0.5 s)
        ctx = zmq.Context()
        socks = []
        for _ in range(8):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            auth.make_client(s, mine, mine.server(0))
            s.connect(servers.endpoints[0])
            s.send_multipart(P.encode(P.Op.STATS, 0, 11))
            socks.append(s)
        time.sleep(2.0)                                # answers come in milliseconds
        answered = sum(bool(s.poll(0)) for s in socks)
        assert answered == auth.KEY_CONNECTIONS - 2, f"{answered} of 8 extra connections served"
        log = servers.log(0)
        assert f"connections, the limit is {auth.KEY_CONNECTIONS} per key" in log, log[-2000:]
        for s in socks:
            s.close()
        ctx.term()
        c.push_pull({"w": np.ones(KEY, np.float32)}, params, 1).wait()
        c.close()


def main(connections, messages, frames):
    """Print a flood's figures: the shard's baseline, its peak while the flood arrives and
    what it holds 3 s after (MiB)."""
    with psrv.launch.start_local_servers(1, worker_timeout=60, transport="tcp") as servers:
        pid = servers.procs[0].pid
        c, _ = worker(servers)
        time.sleep(1.0)
        baseline = rss_mib(pid)
        with PeakRss(pid) as during:
            replies = flood(servers.endpoints[0], connections, messages, frames)
        time.sleep(3.0)
        print(f"{connections} connections x {messages} messages of {frames} MiB: baseline "
              f"{baseline:.0f} MiB, peak +{during.peak - baseline:.0f}, 3 s after "
              f"+{rss_mib(pid) - baseline:.0f}, {len(replies)} refused")
        c.close()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
