"""The echo's three shapes: what a round trip of raw pyzmq costs, before any psrv code.

    python -m psrv.bench_echo --transport tcp --rounds 20 --runs 5

psrv.bench's `raw_zmq` row, the floor psrv is measured against, sends the whole
vector as one message of 1 MiB frames and gets it back: nothing travels both ways
at once.  psrv pipelines instead (messages of `message_bytes`, the replies coming
back while the worker still sends), so that the shard's SGD overlaps the transfer.
This benchmark times a bare echo in each shape, in the same run:

    serial     one message there, then back (the `raw_zmq` row)
    one        4 MiB messages, both directions in flight on one DEALER-ROUTER
               connection, one ZeroMQ I/O thread at each end (psrv's shape)
    two        the same messages, a connection per direction (PUSH to PULL each
               way), each socket in its own context, so its own I/O thread

Each line is one run: every shape's median wall time per round, and the CPU time
per round of both processes together (all their threads, ZeroMQ's included).
"""
import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import zmq

MIB = 1 << 20
SHAPES = ("serial", "one", "two")


def bind(sock, where, name):
    """where: "tcp", or the directory for ipc:// sockets."""
    if where == "tcp":
        return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    endpoint = f"ipc://{os.path.join(where, name)}"
    sock.bind(endpoint)
    return endpoint


def serve(shape, where, queue):
    """Echo every message until b"stop"; b"cpu" asks for this process's CPU time."""
    if shape == "two":
        rx, tx = zmq.Context().socket(zmq.PULL), zmq.Context().socket(zmq.PUSH)
        queue.put((bind(rx, where, "there"), bind(tx, where, "back")))
        recv, send = rx.recv_multipart, tx.send_multipart
    else:
        sock = zmq.Context().socket(zmq.ROUTER)
        queue.put((bind(sock, where, "echo"), None))
        recv, send = sock.recv_multipart, sock.send_multipart
    while True:
        frames = recv(copy=False)
        body = frames[-1].bytes if len(frames[-1]) < 8 else b""
        if body == b"stop":
            break
        if body == b"cpu":
            queue.put(time.process_time())
            continue
        send(frames, copy=False)
    time.sleep(0.2)                 # let the last frames leave before the process ends


def rounds_of(shape, where, nbytes, rounds):
    """(median wall s, CPU s of both processes) per round trip of nbytes."""
    queue = mp.Queue()
    server = mp.Process(target=serve, args=(shape, where, queue))
    server.start()
    there, back = queue.get()
    if shape == "two":
        tx, rx = zmq.Context().socket(zmq.PUSH), zmq.Context().socket(zmq.PULL)
        tx.connect(there)
        rx.connect(back)
    else:
        tx = rx = zmq.Context().socket(zmq.DEALER)
        tx.connect(there)
    data = np.ones(nbytes // 4, np.float32)
    frames = [memoryview(data[i:i + MIB // 4]) for i in range(0, data.size, MIB // 4)]
    messages = [frames] if shape == "serial" else \
        [frames[i:i + 4] for i in range(0, len(frames), 4)]      # 4 MiB a message
    times = []
    for r in range(rounds + 2):                 # two rounds to connect and warm up
        if r == 2:
            tx.send(b"cpu")
            server_cpu, cpu = queue.get(), time.process_time()
        start = time.perf_counter()
        for m in messages:
            tx.send_multipart(m, copy=False)
        for m in messages:
            rx.recv_multipart(copy=False)
        if r >= 2:
            times.append(time.perf_counter() - start)
    tx.send(b"cpu")
    server_cpu, cpu = queue.get() - server_cpu, time.process_time() - cpu
    tx.send(b"stop")
    server.join()
    return statistics.median(times), (cpu + server_cpu) / rounds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", choices=("ipc", "tcp"), default="tcp")
    ap.add_argument("--mib", type=int, default=64, help="bytes per round trip, MiB (multiple of 4)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5, help="runs, each of every shape in turn")
    a = ap.parse_args(argv)
    if a.mib < 4 or a.mib % 4 or a.rounds < 1 or a.runs < 1:
        ap.error(f"--mib {a.mib} --rounds {a.rounds} --runs {a.runs}: need a multiple of 4 "
                 f"MiB and at least one round and run")
    print(f"# {a.mib} MiB round trips over {a.transport}, median ms per round (CPU ms of both "
          f"processes)")
    where = "tcp" if a.transport == "tcp" else tempfile.mkdtemp(prefix="psrv-echo-")
    try:
        for _ in range(a.runs):
            line = []
            for shape in SHAPES:
                wall, cpu = rounds_of(shape, where, a.mib * MIB, a.rounds)
                line.append(f"{shape} {1e3 * wall:6.1f} ({1e3 * cpu:5.1f})")
            print("   ".join(line), flush=True)
    finally:
        if where != "tcp":
            shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
