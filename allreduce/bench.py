"""Collective benchmark in the manner of nccl-tests and the OSU micro-benchmarks.

    mpiexec -n 2 python -m mpi4py -m allreduce.bench --algos mpi-raw,ring,auto --sizes 4K,16M,64M
    mpiexec -n 2 python -m mpi4py -m allreduce.bench --sizes 4K --loop 20 --iters 200  # overhead
    mpiexec -n 4 python -m mpi4py -m allreduce.bench --min-bytes 4K --max-bytes 64M --factor 4 \\
        --algos ring,tree,halving_doubling,hierarchical,mpi,torch --jsonl results/bench.jsonl
    mpiexec -f hostfile -n 16 python -m mpi4py -m allreduce.bench ...      # several hosts
    mpiexec -n 2 python -m mpi4py -m allreduce.bench --device cuda --algos ring,mpi,torch
        # one GPU a rank; MPI moves CUDA buffers through pinned host memory
        # (allreduce.host_staged), NCCL directly; NCCL's own all-reduce (torch)
        # is always a row: the bar the others are measured against

For every (size, collective) the algorithms take turns iteration by iteration
(A B C A B C ...), so a machine that changes speed mid-run slows all alike.  A
row gives the median time (the slowest rank's), x_raw = time / mpi-raw's
(MPI's collective through mpi4py, no topolab layer: the floor), algbw, busbw
(nccl-tests' factors), the bytes one rank sent beside the textbook figure, and
#wrong: elements that differ from a reference each rank computes itself.  auto
rows name their choice (auto→ring); the shm row's buffers live in its window
(shm.py).  From 1 MiB a line gives memcpy on the same bytes, same rounds.

Timing.  By default each call starts after a barrier: one collective from ranks
that start together, as in a training step.  --loop N times N calls back to
back after one barrier, per call, as the OSU benchmarks do.  At small sizes the
barrier and the wake-up after it are as large as the collective itself, so the
overhead of one layer over another (x_raw) is compared fairly with --loop; from
1 MiB the two modes agree within the noise.
"""
import argparse
import platform
import socket
import subprocess
import sys
import time

import numpy as np

from . import ALGORITHMS, create, host_staged, shard_bounds
from .native import RAW, MPIRaw
from .records import append_jsonl
from .theory import bus_factor, bytes_sent
from .twolevel import predictor

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
DTYPES = ("float32", "float64", "int32", "int64", "float16", "bfloat16")
ROWS = ALGORITHMS + (RAW,)
RAW_DTYPES = ("float32", "float64", "int32", "int64")    # MPI's own types, no user op
UNCOUNTED = ("mpi", "torch", RAW, "shm")       # their bytes move out of the transport's sight
DEFAULT_ALGOS = {"cpu": "mpi-raw,ring,mpi", "cuda": "ring,torch"}


def parse_size(text):
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMGB") if scale > 1 else text) * scale)


def human(nbytes):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m allreduce.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default=None, help=f"comma list of {','.join(ROWS)} "
                                                 "(default: mpi-raw,ring,mpi; on cuda ring,torch)")
    p.add_argument("--ops", default="allreduce", help=f"comma list of {','.join(COLLECTIVES)}")
    p.add_argument("--sizes", default=None, help="comma list of message sizes, e.g. 4K,1M,64M")
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--factor", type=int, default=4, help="size step of the min..max sweep")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--iters", type=int, default=20, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--loop", type=int, default=0, metavar="N",
                   help="time N back-to-back calls after one barrier, OSU style (default: "
                        "a barrier before every call)")
    p.add_argument("--transport", default="mpi", choices=("mpi", "torch"),
                   help="transport of the textbook algorithms")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the buffers live (cuda: one GPU per rank on its host)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="hierarchical: emulate nodes of this many ranks (default: host names)")
    p.add_argument("--inner", default="ring", help="hierarchical: algorithm inside a node")
    p.add_argument("--outer", default="ring", help="hierarchical: algorithm between nodes")
    p.add_argument("--link-latency-us", type=float, default=0.0,
                   help="emulate a slower network: latency per message (allreduce/emulate.py)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulate a slower network: bandwidth of each rank's link")
    p.add_argument("--jsonl", default=None, help="append one JSON record per row to this file")
    p.add_argument("--predict", default=None, metavar="CAL.json",
                   help="add the cost model's time of each all-reduce row (predicted_us; "
                        "allreduce/twolevel.py) from this calibration (experiments.calibrate)")
    args = p.parse_args(argv)
    args.algos = [a for a in (args.algos or DEFAULT_ALGOS[args.device]).split(",") if a]
    emulated = args.link_latency_us or args.link_gbps
    if args.device == "cuda" and "torch" not in args.algos and not emulated:
        args.algos.append("torch")                 # NCCL's own all-reduce: the baseline row
    args.ops = [o for o in args.ops.split(",") if o]
    for a in args.algos:
        if a not in ROWS:
            p.error(f"unknown algorithm {a!r}; choose from {', '.join(ROWS)}")
    if RAW in args.algos and (args.device != "cpu" or args.dtype not in RAW_DTYPES):
        p.error(f"{RAW} takes host buffers of {', '.join(RAW_DTYPES)}")
    if args.loop < 0:
        p.error(f"--loop {args.loop}: give a number of calls >= 1, or 0 for a barrier per call")
    if emulated:
        native = [a for a in args.algos if a in ("mpi", "torch", RAW)]
        if native:
            p.error(f"link emulation slows the textbook algorithms only, not {', '.join(native)}")
    for o in args.ops:
        if o not in COLLECTIVES:
            p.error(f"unknown collective {o!r}; choose from {', '.join(COLLECTIVES)}")
    if args.sizes:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        lo, hi = parse_size(args.min_bytes), parse_size(args.max_bytes)
        args.sizes = []
        while lo <= hi:
            args.sizes.append(lo)
            lo *= max(2, args.factor)
    return args


def make_input(rank, n, dtype, device="cpu"):
    """Rank- and position-dependent values that every rank can recompute for any rank;
    numpy arrays on the host (bfloat16: a tensor), tensors on a GPU."""
    import torch
    i = np.arange(n)
    if dtype in ("int32", "int64"):
        values = np.asarray((i % 1000) + 1000 * rank, dtype=dtype)
    else:
        values = (i % 61) * 0.125 - 3 + 0.5 * rank   # exact in every float dtype
    if dtype == "bfloat16":
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).to(device)
    values = values.astype(dtype)
    # torch.device("cpu") == "cpu" is False: compare the type
    return values if torch.device(device).type == "cpu" else torch.from_numpy(values).to(device)


def reference(collective, rank, P, n, dtype, root=0):
    """The expected result, computed locally in float64 / int64."""
    inputs = [np.asarray(make_input(r, n, dtype).float() if dtype == "bfloat16"
                         else make_input(r, n, dtype), dtype=np.float64) for r in range(P)]
    total = np.sum(inputs, axis=0) if P else np.zeros(n)
    if collective == "allreduce":
        return total
    a, b = shard_bounds(n, P)[rank]
    if collective == "reduce_scatter":
        return total[a:b]
    if collective == "allgather":
        return np.concatenate([inputs[r][slice(*shard_bounds(n, P)[r])] for r in range(P)])
    return inputs[root]


def as_float64(x):
    return x.double().cpu().numpy() if hasattr(x, "double") else np.asarray(x, dtype=np.float64)


def settle(device):
    """Wait for the GPU's queued kernels (asynchronous), so that a time covers them."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def use_device(args, comm):
    """torch.device for --device, or exit 2 on every rank with the reason (no GPU)."""
    import torch
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.stderr.write(f"allreduce.bench rank {comm.rank}: error: --device cuda but torch "
                         f"sees no GPU (torch {torch.__version__}); use --device cpu\n")
        sys.stderr.flush()
        comm.Barrier()                               # every rank has said it before any exits
        sys.exit(2)
    from .torch_transport import local_rank
    device = torch.device("cuda", local_rank(comm) % torch.cuda.device_count())
    torch.cuda.set_device(device)                    # NCCL and the pinned copies use it
    return device


def provenance():
    def commit():
        try:
            return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or None
        except OSError:
            return None
    from mpi4py import MPI
    import torch
    return {"host": socket.gethostname(), "commit": commit(), "python": platform.python_version(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(), "torch": torch.__version__}


def runner(coll, collective, n):
    """The call a row times, x -> result."""
    if isinstance(coll, MPIRaw):
        return coll.runner(collective, n)
    if collective == "allreduce":
        return coll.allreduce
    if collective == "reduce_scatter":
        return coll.reduce_scatter
    if collective == "allgather":
        return lambda x: coll.allgather(x, n)
    return lambda x: coll.broadcast(x, root=0)


def chosen(algo, coll, collective, nbytes):
    """What ran: the row's algorithm, or for auto the one it chose."""
    if algo != "auto":
        return algo
    return getattr(coll, "inner", coll).choice(collective, nbytes)


def make_rows(args, comm, device):
    colls = {}
    for algo in args.algos:
        if algo == RAW:
            colls[algo] = MPIRaw(comm)
            continue
        options = {}
        if algo in ("hierarchical", "auto") and args.ranks_per_node:
            options["ranks_per_node"] = args.ranks_per_node
        if algo == "hierarchical":
            options.update(inner=args.inner, outer=args.outer)
        transport = "torch" if algo == "torch" else args.transport
        colls[algo] = create(algo, transport=transport, link_latency_us=args.link_latency_us,
                             link_gbps=args.link_gbps, **options)
        # The benchmark checks results itself; time and count the collective alone.
        colls[algo].check = False
        if device.type == "cuda":
            colls[algo] = host_staged(colls[algo])
    return colls


def main(argv=None):
    from mpi4py import MPI
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, P = comm.rank, comm.size
    device = use_device(args, comm)
    colls = make_rows(args, comm, device)
    predict = predictor(args.predict, comm, args.inner, args.outer, args.ranks_per_node,
                        emulated=bool(args.link_latency_us or args.link_gbps)) \
        if args.predict else None                # on every rank: MPI tells the hosts apart
    itemsize = 2 if args.dtype in ("float16", "bfloat16") else np.dtype(args.dtype).itemsize
    meta = provenance() if rank == 0 else {}
    width = 22 if "auto" in args.algos else 16         # auto→halving_doubling
    header = (f"{'algo':>{width}} {'collective':>14} {'size':>8} {'time_us':>10} {'x_raw':>6} "
              f"{'algbw':>7} {'busbw':>7} {'sent/rank':>10} {'theory':>10} {'#wrong':>6}" +
              (f" {'predicted':>10}" if predict else ""))
    timing = f"loop={args.loop}" if args.loop else "barrier per call"
    if rank == 0:
        link = (f" link={args.link_latency_us:g}us/{args.link_gbps or 'inf'}GB/s"
                if args.link_latency_us or args.link_gbps else "")
        print(f"# P={P} dtype={args.dtype} iters={args.iters} transport={args.transport}{link} "
              f"device={args.device} timing: {timing}  "
              f"(bandwidth in GB/s; {meta['mpi']})")
        print(header)
        sys.stdout.flush()
    out = args.jsonl if rank == 0 else None
    window = None
    if "shm" in colls and args.dtype != "bfloat16" and device.type == "cpu":
        window = colls["shm"].empty(max(args.sizes) // itemsize, args.dtype)
    for nbytes in args.sizes:
        n = nbytes // itemsize
        for collective in args.ops:
            pristine = make_input(rank, n, args.dtype, device)
            if collective == "allgather":
                pristine = pristine[slice(*shard_bounds(n, P)[rank])]
            work = {a: pristine.clone() if hasattr(pristine, "clone") else pristine.copy()
                    for a in colls}
            if window is not None:             # shm's saving needs its own buffers
                work["shm"] = window[:len(pristine)]
            runs = {a: runner(colls[a], collective, n) for a in colls}
            times = {a: [] for a in colls}
            wrong, sent = {}, {}

            def call(algo, calls=max(1, args.loop)):
                """One sample: `calls` calls after one barrier; seconds per call."""
                run, x = runs[algo], work[algo]
                x[:] = pristine
                settle(device)
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    result = run(x)
                settle(device)
                return (time.perf_counter() - start) / calls, result

            for algo in colls:                 # checked call, also a warm-up
                transport = getattr(colls[algo], "transport", None)      # none for mpi-raw
                before = transport.bytes_sent if transport else 0
                _, result = call(algo, calls=1)
                sent[algo] = transport.bytes_sent - before if transport else 0
                expect = reference(collective, rank, P, n, args.dtype)
                wrong[algo] = int(np.count_nonzero(as_float64(result) != expect))
            for _ in range(args.warmup):
                for algo in colls:
                    call(algo)
            # the roofline of a bandwidth-bound size: memcpy of the same bytes, same rounds
            copies = []
            spare = (np.empty_like(pristine) if type(pristine) is np.ndarray and
                     nbytes >= 1 << 20 else None)
            for _ in range(args.iters):
                for algo in colls:             # interleaved: A B C A B C ...
                    times[algo].append(call(algo)[0])
                if spare is not None:
                    start = time.perf_counter()
                    np.copyto(spare, pristine)
                    copies.append(time.perf_counter() - start)
            medians = {a: comm.allreduce(float(np.median(times[a])), op=MPI.MAX) for a in colls}
            memcpy = pristine.nbytes / np.median(copies) / 1e9 if copies else None
            for algo in colls:
                n_wrong = comm.reduce(wrong[algo], op=MPI.SUM, root=0)
                most_sent = comm.reduce(sent[algo], op=MPI.MAX, root=0)
                if rank != 0:
                    continue
                median = medians[algo]
                ran = chosen(algo, colls[algo], collective, n * itemsize)
                label = algo if ran == algo else f"{algo}→{ran}"
                vs_raw = median / medians[RAW] if RAW in medians and medians[RAW] > 0 else None
                theory = bytes_sent(ran, collective, n * itemsize, P)
                algbw = n * itemsize / median / 1e9 if median > 0 else 0.0
                busbw = algbw * bus_factor(collective, P)
                native = ran in UNCOUNTED
                predicted = predict(ran, collective, n * itemsize) if predict else None
                print(f"{label:>{width}} {collective:>14} {human(nbytes):>8} {median * 1e6:10.1f} "
                      f"{'-' if vs_raw is None else f'{vs_raw:.2f}':>6} "
                      f"{algbw:7.2f} {busbw:7.2f} {('-' if native else human(most_sent)):>10} "
                      f"{('-' if theory is None else human(int(theory))):>10} {n_wrong:6d}" +
                      (f" {'-' if predicted is None else f'{predicted:.1f}':>10}" if predict
                       else ""))
                sys.stdout.flush()
                if out:
                    record = {"algo": label, "chosen": ran, "op": collective,
                              "bytes": n * itemsize, "dtype": args.dtype, "world_size": P,
                              "iters": args.iters, "loop": args.loop, "time_us": median * 1e6,
                              "vs_raw": vs_raw, "algbw_gbps": algbw, "busbw_gbps": busbw,
                              "sent_bytes": None if native else most_sent,
                              "theory_bytes": theory, "wrong": n_wrong, "device": args.device,
                              "transport": ("mpi" if algo == RAW else
                                            "torch" if algo == "torch" else args.transport),
                              "link_latency_us": args.link_latency_us,
                              "link_gbps": args.link_gbps, "memcpy_gbps": memcpy,
                              **({"predicted_us": predicted} if predict else {}), **meta}
                    append_jsonl(out, [record])
            if rank == 0 and memcpy and collective == args.ops[-1]:
                print(f"{'# memcpy':>{width}} {human(nbytes):>23} {memcpy:.2f} GB/s "
                      f"(np.copyto on rank 0, in the same rounds)", flush=True)
    comm.Barrier()


if __name__ == "__main__":
    main()
