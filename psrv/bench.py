"""Push+pull throughput of psrv beside its peers: raw pyzmq and a torch.distributed.rpc server.

    python -m psrv.bench                                     # 4K..64M, W=1,2,3 x S=1,2
    python -m psrv.bench --sizes 4K,1M,64M --workers 1 --servers 1 --reps 9 --jsonl results/psrv.jsonl
    python -m psrv.bench ... --transport tcp                 # psrv and raw_zmq on loopback TCP

For every (S servers, W workers, size) each worker moves `size` bytes of float32
per iteration, both ways:

    psrv       push_pull of one parameter of `size` bytes (placed over the S servers,
               BSP, SGD applied on the servers) and copy of the new values into `out`
    raw_zmq    the same bytes, split the same way over S echo processes (ROUTER),
               sent as one multipart of 1 MiB zero-copy frames, echoed back
               zero-copy, received zero-copy (the fastest ping-pong found here;
               one 64 MiB frame is about half as fast)
    torch_rpc  (S = W = 1 only) what a PyTorch user gets for free, the pattern of
               PyTorch's parameter-server tutorial: rpc_sync sends the gradient,
               the server applies SGD (`p.add_(g, alpha=-lr)`) and returns the
               parameter; TensorPipe forced onto TCP on loopback (transport "uv",
               channel "basic").  The worker keeps the returned tensor (no copy
               into `out`: the cheaper reading for torch)

psrv and raw_zmq use one transport (--transport: ipc, Unix sockets, the default
for servers on this host; or tcp on loopback).  All kinds run interleaved in the
same processes (psrv, raw, rpc, psrv, raw, rpc, ... `--reps` times, a barrier
before each block: allreduce/harness.py's rounds) because this machine changes
speed every minute or two.
Reported: median time per iteration (the slowest worker), and
gbps = W * 2 * size / time, the aggregate bytes moved per second (1 GB = 1e9 B).

Also reported: cpu_ms, the CPU time (user + system, every thread) that the
workers and the servers (or echoes) spent per iteration, all together.  On a
machine of C cores nothing can run faster than cpu_ms / C, so the column says
how far each kind is from being CPU-bound.  psrv does work the echo does not:
it runs the optimizer over every byte on the server and copies every byte into
`out` on the worker.  io_ms: the part of cpu_ms spent in ZeroMQ's I/O threads,
which move the bytes between the sockets and the kernel; the rest is the
kinds' own work.  faults: the minor page faults they took per iteration,
pages the kernel mapped in afresh (psrv/heap.py says why there should be few).
"""
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import tempfile

import numpy as np
import zmq

from allreduce.harness import Timings, interleaved, slowest
from allreduce.records import append_jsonl
from allreduce.units import parse_sizes

from . import protocol as P
from .bench_config import parser
from .client import Client
from .config import OptimizerConfig
from .launch import start_local_servers
from .measure import ZMQ_IO_THREADS, collect, cpu_seconds, minor_faults


def echo_server(queue, endpoint):
    """The raw baseline's server: return every message as it came, zero-copy."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 2000)
    if endpoint.startswith("tcp://"):
        endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        sock.bind(endpoint)
    queue.put(endpoint)
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            break
        sock.send_multipart(frames, copy=False)
    sock.close()


RPC_LR = 1e-9
_rpc_params = {}          # on the rpc server: parameter name -> tensor


def rpc_options(port):
    import torch.distributed.rpc as rpc        # torch only for this kind: a slow import
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           _transports=["uv"], _channels=["basic"])


def rpc_server(port, world_size):
    """The torch_rpc kind's server, rank 0 of the rpc group: serves until every
    worker has called rpc.shutdown()."""
    import torch.distributed.rpc as rpc
    rpc.init_rpc("ps", rank=0, world_size=world_size, rpc_backend_options=rpc_options(port))
    rpc.shutdown()


def rpc_sgd_step(name, grad):
    """Runs on the rpc server: SGD on parameter `name` with `grad`, returns its values."""
    import torch
    p = _rpc_params.get(name)
    if p is None:
        p = _rpc_params[name] = torch.zeros_like(grad)
    return p.add_(grad, alpha=-RPC_LR)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_keys(sizes):
    """The keys a bench worker declares: one float32 parameter per size (name -> shape)."""
    return {f"s{size:012d}": (size // 4,) for size in sizes}


def worker(w, num_workers, endpoints, echoes, rpc_port, sizes, reps, barrier, results, pids):
    client = Client(endpoints, w, num_workers, timeout=120.0)
    params = {name: np.zeros(shape, np.float32) for name, shape in bench_keys(sizes).items()}
    client.init(params, OptimizerConfig("sgd", lr=RPC_LR))
    ctx = zmq.Context()
    raw = [ctx.socket(zmq.DEALER) for _ in echoes]
    for sock, ep in zip(raw, echoes):
        sock.connect(ep)
    steps = {name: 0 for name in params}
    if rpc_port:
        import torch
        import torch.distributed.rpc as rpc
        rpc.init_rpc(f"worker{w}", rank=w + 1, world_size=num_workers + 1,
                     rpc_backend_options=rpc_options(rpc_port))

    def run_psrv(name, iters):
        g, out = {name: params[name]}, {name: np.empty_like(params[name])}
        for _ in range(iters):
            client.push_pull(g, out, steps[name]).wait()
            steps[name] += 1

    def run_raw(name, iters):
        flat = params[name]
        parts = [[] for _ in raw]          # the bytes each server would own, in 1 MiB frames
        for sl in client.placement.by_name[name]:
            parts[sl.server] += P.chunks(flat[sl.offset:sl.offset + sl.length])
        for _ in range(iters):
            for sock, frames in zip(raw, parts):
                if frames:
                    sock.send_multipart(frames, copy=False)
            for sock, frames in zip(raw, parts):
                if frames and not sock.poll(120_000):
                    raise TimeoutError("echo server did not answer in 120 s")
                if frames:
                    sock.recv_multipart(copy=False)

    def run_rpc(name, iters):
        g = torch.from_numpy(params[name])
        for _ in range(iters):
            rpc.rpc_sync("ps", rpc_sgd_step, args=(name, g))

    runs = {"psrv": run_psrv, "raw_zmq": run_raw, "torch_rpc": run_rpc}
    kinds = [k for k in runs if k in pids]
    start = {}

    def usage(kind):     # CPU seconds, page faults, CPU seconds of ZeroMQ's I/O threads;
        procs = [os.getpid()] + (pids[kind] if w == 0 else [])   # worker 0: the servers' too
        return np.array([sum(map(cpu_seconds, procs)), sum(map(minor_faults, procs)),
                         sum(cpu_seconds(p, ZMQ_IO_THREADS) for p in procs)])

    def read_usage_after(kind):
        barrier.wait(120)         # the servers' work for the slower workers counts too
        used[kind].append((usage(kind) - start[kind]) / iters)

    for size in sizes:
        name = f"s{size:012d}"
        iters = max(2, min(200, int(2e8 / size / num_workers)))
        for kind in kinds:
            runs[kind](name, 2)              # warm-up: connections, page faults
        used = {kind: [] for kind in kinds}  # usage() per iteration, sample by sample
        # one sample: `iters` iterations of one kind, after a barrier, per iteration
        timings = interleaved({kind: (lambda kind=kind: runs[kind](name, 1)) for kind in kinds},
                              rounds=reps, warmup=0, calls=iters,
                              barrier=lambda: barrier.wait(120),
                              before=lambda kind: start.__setitem__(kind, usage(kind)),
                              after=read_usage_after)
        results.put((size, timings.samples, used))
    client.close()
    for sock in raw:
        sock.close(linger=0)
    ctx.term()
    if rpc_port:
        rpc.shutdown()


def run_config(num_servers, num_workers, sizes, reps, transport="ipc", with_rpc=True):
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    socket_dir = tempfile.mkdtemp(prefix="psrv-bench-")       # 0700: only this user connects
    where = [f"ipc://{socket_dir}/echo{i}" if transport == "ipc" else "tcp://"
             for i in range(num_servers)]
    echo_procs = [ctx.Process(target=echo_server, args=(queue, ep)) for ep in where]
    procs, rpc_procs, echoes = [], [], []
    try:        # whatever ends the point (an error, SIGTERM: main), nothing is left behind
        for p in echo_procs:
            p.start()
        # echo i must own what psrv server i owns; the queue returns them in any order, fine:
        # the raw client splits bytes per socket index, as psrv does per server index
        echoes = [queue.get(timeout=60) for _ in echo_procs]
        rpc_port = free_port() if with_rpc and num_servers == num_workers == 1 else None
        rpc_procs = [ctx.Process(target=rpc_server, args=(rpc_port, num_workers + 1))] if rpc_port else []
        for p in rpc_procs:
            p.start()
        with start_local_servers(num_servers, worker_timeout=60, transport=transport,
                                 shapes=bench_keys(sizes)) as servers:
            barrier = ctx.Barrier(num_workers)
            pids = {"psrv": [p.pid for p in servers.procs], "raw_zmq": [p.pid for p in echo_procs]}
            if rpc_port:
                pids["torch_rpc"] = [p.pid for p in rpc_procs]
            procs = [ctx.Process(target=worker, args=(w, num_workers, servers.endpoints, echoes,
                                                      rpc_port, sizes, reps, barrier, results, pids))
                     for w in range(num_workers)]
            for p in procs:
                p.start()
            per_size = {}                          # size -> [(Timings, usage) of each worker]
            for size, samples, used in collect(results, len(sizes) * num_workers,
                                               procs + echo_procs + rpc_procs):
                per_size.setdefault(size, []).append((Timings(samples), used))
            for p in procs + rpc_procs:
                p.join(60)
            servers.wait(60)
        for ep in echoes:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.connect(ep)
            sock.send(b"stop")
            sock.close(linger=2000)
        for p in echo_procs:
            p.join(30)
    finally:
        for p in procs + rpc_procs + echo_procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
                p.join(10)
        shutil.rmtree(socket_dir, ignore_errors=True)
    rows = []
    for size in sizes:
        timings = slowest(t for t, _ in per_size[size])       # the slowest worker sets the pace
        for kind in pids:
            # every process's usage() per sample, summed over the workers
            used = np.sum([u[kind] for _, u in per_size[size]], axis=0)
            cpu, faults, io_cpu = np.median(used, axis=0)
            t, rounds = timings.median(kind), timings.samples[kind]
            rows.append({"kind": kind, "bytes": size, "workers": num_workers,
                         "servers": num_servers, "transport": "tcp" if kind == "torch_rpc" else transport,
                         "time_us": round(t * 1e6, 1), "cpu_ms": round(float(cpu) * 1e3, 2),
                         "io_cpu_ms": round(float(io_cpu) * 1e3, 2),
                         "faults": round(float(faults)),
                         "cores": os.cpu_count(), "gbps": round(num_workers * 2 * size / t / 1e9, 3),
                         "round_us": [round(r * 1e6, 1) for r in rounds],
                         "reps": reps, "host": platform.node(), "loadavg": os.getloadavg()[0]})
    return rows


def counts(flag, text):
    """"1,2,3" -> [1, 2, 3]; ValueError naming flag unless every item is an int >= 1."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None
    if min(values) < 1:
        raise ValueError(f"{flag} {text!r}: every count must be >= 1")
    return values


def stop_on_sigterm():
    """SIGTERM (a sweep's timeout, kill) unwinds like Ctrl-C: every `finally` and
    `with` runs, so the point's processes and temporary psrv-* files go with it."""
    def unwind(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, unwind)


def main(argv=None):
    ap = parser(__doc__.split("\n")[0])
    a = ap.parse_args(argv)
    try:                                   # every value, before any work
        sizes = parse_sizes(a.sizes)
        if any(s % 4 or s <= 0 for s in sizes):
            raise ValueError("sizes must be positive multiples of 4 bytes (float32)")
        servers, workers = counts("--servers", a.servers), counts("--workers", a.workers)
        if a.reps < 1:
            raise ValueError(f"--reps must be >= 1, got {a.reps}")
    except ValueError as e:
        ap.exit(2, f"psrv.bench: {e}\n")
    stop_on_sigterm()
    print(f"{'kind':<9} {'servers':>7} {'workers':>7} {'bytes':>10} {'time_us':>11} "
          f"{'GB/s':>7} {'cpu_ms':>8} {'io_ms':>7} {'faults':>7} {'psrv/this':>9}", flush=True)
    for s in servers:
        for w in workers:
            rows = run_config(s, w, sizes, a.reps, a.transport, not a.no_rpc)
            for r in rows:
                ps = next(x for x in rows if x["kind"] == "psrv" and x["bytes"] == r["bytes"])
                ratio = f"{ps['gbps'] / r['gbps']:.2f}" if r["kind"] != "psrv" else ""
                print(f"{r['kind']:<9} {s:7d} {w:7d} {r['bytes']:10d} {r['time_us']:11.1f} "
                      f"{r['gbps']:7.3f} {r['cpu_ms']:8.2f} {r['io_cpu_ms']:7.2f} "
                      f"{r['faults']:7d} {ratio:>9}", flush=True)
                if a.jsonl:
                    append_jsonl(a.jsonl, [r])


if __name__ == "__main__":
    main()
