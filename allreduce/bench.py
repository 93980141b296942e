"""Collective benchmark in the manner of nccl-tests and the OSU micro-benchmarks.

    mpiexec -n 2 python -m mpi4py -m allreduce.bench --algos mpi-raw,ring,auto --sizes 4K,16M,64M
    mpiexec -n 2 python -m mpi4py -m allreduce.bench --sizes 4K --loop 20 --iters 200  # overhead
    mpiexec -n 4 python -m mpi4py -m allreduce.bench --min-bytes 4K --max-bytes 64M --factor 4 \\
        --algos ring,tree,halving_doubling,hierarchical,mpi,torch --jsonl results/bench.jsonl
    mpiexec -f hostfile -n 16 python -m mpi4py -m allreduce.bench ...      # several hosts
    mpiexec -n 2 python -m mpi4py -m allreduce.bench --device cuda --algos ring,mpi,torch
        # one GPU a rank; a CUDA-aware MPI takes the ring's CUDA buffers as they
        # are, any other MPI gets them through pinned host memory
        # (allreduce.host_staged; the header says which); NCCL moves them itself.
        # NCCL's own all-reduce (torch) is always a row, the bar the others are
        # measured against, unless ranks share a GPU (NCCL needs one each)

For every (size, collective) the algorithms take turns iteration by iteration
(A B C A B C ..., allreduce/harness.py), so a machine that changes speed
mid-run slows all alike.  A row gives the median time (of the slowest rank's
samples), x_raw = time / mpi-raw's (MPI's collective through mpi4py, no
topolab layer: the floor), algbw, busbw
(nccl-tests' factors), the bytes one rank sent beside the textbook figure, and
#wrong: elements that differ from a reference each rank computes itself.  auto
rows name their choice (auto→ring); the shm row's buffers live in its window
(shm.py).  From 1 MiB a line gives memcpy on the same bytes, same rounds, and
each row's busbw as a fraction of it (the median of the rounds' ratios).
--jsonl records carry the quartiles too (time_us_p25, time_us_p75: error bars).

Timing.  By default each call starts after a barrier: one collective from ranks
that start together, as in a training step.  --loop N times N calls back to
back after one barrier, per call, as the OSU benchmarks do.  At small sizes the
barrier and the wake-up after it are as large as the collective itself, so the
overhead of one layer over another (x_raw) is compared fairly with --loop; from
1 MiB the two modes agree within the noise.
"""
import math
import os

import numpy as np

from . import create, host_staged, shard_bounds
from .bench_config import RAW, element_size, parse_args, parser
from .bench_setup import refuse, refuse_unallocatable, use_device, without_shared_gpus
from .cuda_ipc import SharedGpuTransport
from .harness import interleaved
from .native import MPIRaw
from .records import append_jsonl, provenance
from .staging import HostStaged
from .theory import bus_factor, bytes_sent
from .twolevel import predictor
from .units import format_size

UNCOUNTED = ("mpi", "torch", RAW, "shm")       # their bytes move out of the transport's sight


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
    if collective == "alltoall":                 # block `rank` of every rank's input
        return np.concatenate([inputs[j][a:b] for j in range(P)])
    return inputs[root]


def as_float64(x):
    return x.double().cpu().numpy() if hasattr(x, "double") else np.asarray(x, dtype=np.float64)


def settle(device):
    """Wait for the GPU's queued kernels (asynchronous), so that a time covers them."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


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
    if collective == "alltoall":
        return coll.alltoall
    return lambda x: coll.broadcast(x, root=0)


def chosen(algo, coll, collective, nbytes):
    """What ran: the row's algorithm, or for auto the one it chose."""
    if algo != "auto" or collective == "alltoall":     # auto chooses all-reduces only
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
                             link_gbps=args.link_gbps, device=device, **options)
        # The benchmark checks results itself; time and count the collective alone.
        colls[algo].check = False
        if device.type == "cuda":
            colls[algo] = host_staged(colls[algo])
    return colls


def cuda_path(coll):
    """How a row's CUDA buffers travel: 'direct' (NCCL, a CUDA-aware MPI), 'ipc'
    (device to device between ranks that share a GPU: cuda_ipc.py) or 'staged'
    (through pinned host memory: allreduce.host_staged's fallback)."""
    if isinstance(coll, HostStaged):
        return "staged"
    return "ipc" if isinstance(getattr(coll, "transport", None), SharedGpuTransport) \
        else "direct"


def cuda_paths_line(colls):
    """The header's line on which path each row's CUDA buffers took."""
    rows = {path: [a for a, c in colls.items() if a != RAW and cuda_path(c) == path]
            for path in ("direct", "ipc", "staged")}
    said = {"direct": "handed to the transport as they are",
            "ipc": "device to device through CUDA IPC between ranks that share a GPU "
                   "(staged to the others)",
            "staged": "staged through pinned host memory"}
    return "# CUDA buffers: " + "; ".join(f"{said[path]}: {', '.join(algos)}"
                                          for path, algos in rows.items() if algos)


def header(args, P, width, predict, mpi):
    link = (f" link={args.link_latency_us:g}us/{args.link_gbps or 'inf'}Gbit/s"
            if args.link_latency_us or args.link_gbps else "")
    timing = f"loop={args.loop}" if args.loop else "barrier per call"
    return (f"# P={P} dtype={args.dtype} iters={args.iters} transport={args.transport}{link} "
            f"device={args.device} timing: {timing}  (bandwidth in GB/s; {mpi})\n"
            f"{'algo':>{width}} {'collective':>14} {'size':>8} {'time_us':>10} {'x_raw':>6} "
            f"{'algbw':>7} {'busbw':>7} {'sent/rank':>10} {'theory':>10} {'#wrong':>6}" +
            (f" {'predicted':>10}" if predict else ""))


INT_MAX = 2**63 - 1             # an int past int64 overflows numpy's arithmetic
SLOWEST_LINK_GBPS = 1e-3        # 1 Mbit/s; slower links overflow the emulated sleep
LONGEST_LATENCY_US = 1e12       # 11.6 days a message


def input_problem(argv, comm):
    """What is wrong with the flags that parse_args would take, or None: numbers out
    of their domain (NaN, inf, past int64; a sweep from 0 bytes, which never ends),
    and, on rank 0, a --jsonl it cannot write (it used to measure everything and then
    end in a traceback).  The same answer on every rank."""
    args, _ = parser().parse_known_args(argv)    # argparse's own errors: parse_args's
    problem = None
    for flag in ("iters", "warmup", "loop", "factor", "min_bytes", "max_bytes"):
        if abs(getattr(args, flag)) > INT_MAX:
            problem = f"--{flag.replace('_', '-')} {getattr(args, flag)} is out of range: " \
                      f"at most 2**63 - 1"
    if args.min_bytes < 1 and not args.sizes:
        problem = f"--min-bytes {args.min_bytes}: the sweep multiplies it by --factor, " \
                  f"so it starts at 1 byte or more"
    latency, gbps = args.link_latency_us, args.link_gbps
    if not (math.isfinite(latency) and 0 <= latency <= LONGEST_LATENCY_US):
        problem = f"--link-latency-us {latency:g}: give microseconds from 0 to " \
                  f"{LONGEST_LATENCY_US:g}"
    if gbps is not None and not (math.isfinite(gbps) and gbps >= SLOWEST_LINK_GBPS):
        problem = f"--link-gbps {gbps:g}: give a finite bandwidth of at least " \
                  f"{SLOWEST_LINK_GBPS:g} Gbit/s (1 Mbit/s)"
    mine = None
    if comm.rank == 0 and args.jsonl:
        folder = os.path.dirname(os.path.abspath(args.jsonl))
        if os.path.isdir(args.jsonl):
            mine = f"--jsonl {args.jsonl} is a folder, not a file"
        elif not os.path.isdir(folder):
            mine = f"--jsonl {args.jsonl}: no folder {folder} to write it in"
        elif not os.access(folder, os.W_OK) or \
                (os.path.exists(args.jsonl) and not os.access(args.jsonl, os.W_OK)):
            mine = f"--jsonl {args.jsonl}: not writable"
    return problem or comm.bcast(mine)


def main(argv=None):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    problem = input_problem(argv, comm)
    if problem:
        refuse(comm, problem)
    args = parse_args(argv, description=__doc__)
    rank, P = comm.rank, comm.size
    device = use_device(args, comm)
    args.algos, note = without_shared_gpus(args, comm)
    refuse_unallocatable(args, comm, device)
    colls = make_rows(args, comm, device)
    predict = predictor(args.predict, comm, args.inner, args.outer,
                        args.ranks_per_node, emulated=bool(args.link_latency_us or args.link_gbps)) \
        if args.predict else None                # on every rank: MPI tells the hosts apart
    itemsize = element_size(args.dtype)
    meta = provenance() if rank == 0 else {}
    width = 22 if "auto" in args.algos else 16         # auto→halving_doubling
    if rank == 0:
        print(header(args, P, width, predict, meta["mpi"]), flush=True)
        for line in (note, cuda_paths_line(colls) if device.type == "cuda" else None):
            if line:
                print(line, flush=True)
    out = args.jsonl if rank == 0 else None
    # each algorithm's buffer from its own empty(): shared memory's (shm, auto on one
    # host) lie in a window, which is where its saving comes from (collective: all alike)
    windows = {}
    if args.dtype != "bfloat16" and device.type == "cpu":
        windows = {a: colls[a].empty(max(args.sizes) // itemsize, args.dtype)
                   for a in colls if hasattr(colls[a], "empty")}
    for nbytes in args.sizes:
        n = nbytes // itemsize
        for collective in args.ops:
            pristine = make_input(rank, n, args.dtype, device)
            if collective == "allgather":
                pristine = pristine[slice(*shard_bounds(n, P)[rank])]
            work = {a: pristine.clone() if hasattr(pristine, "clone") else pristine.copy()
                    for a in colls}
            for algo, window in windows.items():
                work[algo] = window[:len(pristine)]
            runs = {a: runner(colls[a], collective, n) for a in colls}
            wrong, sent = {}, {}
            for algo in colls:                 # checked call, also a warm-up
                transport = getattr(colls[algo], "transport", None)      # none for mpi-raw
                before = transport.bytes_sent if transport else 0
                work[algo][:] = pristine
                result = runs[algo](work[algo])
                sent[algo] = transport.bytes_sent - before if transport else 0
                expect = reference(collective, rank, P, n, args.dtype)
                wrong[algo] = int(np.count_nonzero(as_float64(result) != expect))
            candidates = {a: (lambda a=a: runs[a](work[a])) for a in colls}
            # the roofline of a bandwidth-bound size: memcpy of the same bytes, same rounds
            if type(pristine) is np.ndarray and nbytes >= 1 << 20:
                spare = np.empty_like(pristine)
                candidates["# memcpy"] = lambda: np.copyto(spare, pristine)

            def reset(algo):                   # a fresh input every sample, untimed
                if algo in work:
                    work[algo][:] = pristine
            timings = interleaved(candidates, rounds=args.iters, warmup=args.warmup,
                                  calls=max(1, args.loop), comm=comm, before=reset,
                                  settle=lambda: settle(device))
            memcpy = (pristine.nbytes / timings.median("# memcpy") / 1e9
                      if "# memcpy" in timings.samples else None)
            of_memcpy = {}                     # busbw / memcpy's GB/s, round by round
            for algo in colls:
                n_wrong = comm.reduce(wrong[algo], op=MPI.SUM, root=0)
                most_sent = comm.reduce(sent[algo], op=MPI.MAX, root=0)
                if rank != 0:
                    continue
                median, (p25, p75) = timings.median(algo), timings.spread(algo)
                ran = chosen(algo, colls[algo], collective, n * itemsize)
                label = algo if ran == algo else f"{algo}→{ran}"
                raw = timings.median(RAW) if RAW in colls else 0.0
                vs_raw = median / raw if raw > 0 else None
                theory = bytes_sent(ran, collective, n * itemsize, P)
                algbw = n * itemsize / median / 1e9 if median > 0 else 0.0
                busbw = algbw * bus_factor(collective, P)
                native = ran in UNCOUNTED
                if memcpy:
                    of_memcpy[label] = bus_factor(collective, P) * timings.ratio("# memcpy", algo)
                predicted = predict(ran, collective, n * itemsize) if predict else None
                print(f"{label:>{width}} {collective:>14} {format_size(nbytes):>8} "
                      f"{median * 1e6:10.1f} {'-' if vs_raw is None else f'{vs_raw:.2f}':>6} "
                      f"{algbw:7.2f} {busbw:7.2f} "
                      f"{('-' if native else format_size(most_sent)):>10} "
                      f"{('-' if theory is None else format_size(int(theory))):>10} "
                      f"{n_wrong:6d}" +
                      (f" {'-' if predicted is None else f'{predicted:.1f}':>10}" if predict
                       else ""), flush=True)
                if out:
                    record = {"algo": label, "chosen": ran, "op": collective,
                              "bytes": n * itemsize, "dtype": args.dtype, "world_size": P,
                              "iters": args.iters, "loop": args.loop, "time_us": median * 1e6,
                              "time_us_p25": p25 * 1e6, "time_us_p75": p75 * 1e6,
                              # every round's time, the slowest rank's: the error bars
                              "round_us": [round(t * 1e6, 2) for t in timings.samples[algo]],
                              "vs_raw": vs_raw, "algbw_gbps": algbw, "busbw_gbps": busbw,
                              "sent_bytes": None if native else most_sent,
                              "theory_bytes": theory, "wrong": n_wrong, "device": args.device,
                              "cuda_path": (cuda_path(colls[algo]) if device.type == "cuda"
                                            and algo != RAW else None),
                              "transport": ("mpi" if algo == RAW else
                                            "torch" if algo == "torch" else args.transport),
                              "link_latency_us": args.link_latency_us,
                              "link_gbps": args.link_gbps, "memcpy_gbps": memcpy,
                              "busbw_of_memcpy": of_memcpy.get(label),
                              **({"predicted_us": predicted} if predict else {}), **meta}
                    append_jsonl(out, [record])
            if rank == 0 and memcpy and collective == args.ops[-1]:
                print(f"{'# memcpy':>{width}} {format_size(nbytes):>23} {memcpy:.2f} GB/s "
                      f"(np.copyto, in the same rounds); busbw / memcpy, median of the rounds: "
                      + ", ".join(f"{a} {f:.2f}" for a, f in of_memcpy.items()), flush=True)
    comm.Barrier()


if __name__ == "__main__":
    main()
