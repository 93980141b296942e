"""The collective benchmark's flags, defaults and checks, apart from the benchmark itself.

allreduce/bench.py is a command line, and command lines are leaves: nothing
imports them.  Yet the sweep fills in a point's defaults from these flags
(experiments/sweepfile.py) and the emulated cluster works out a job's bytes
from them (experiments/cluster/wire.py); so the flags live here, and all three
read the one parser.

    args = parse_args(["--algos", "ring,tree", "--sizes", "4K,1M"])
    args.algos == ["ring", "tree"], args.sizes == [4096, 1048576]
"""
import argparse

import numpy as np

from . import ALGORITHMS
from .cli import add_output_flags, size, size_list
from .native import RAW
from .records import calibration_file
from .units import format_size

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall")
DTYPES = ("float32", "float64", "int32", "int64", "float16", "bfloat16")
ROWS = ALGORITHMS + (RAW,)
RAW_DTYPES = ("float32", "float64", "int32", "int64")    # MPI's own types, no user op
DEFAULT_ALGOS = {"cpu": "mpi-raw,ring,mpi", "cuda": "ring,torch"}


def element_size(dtype):
    """Bytes of one element of a bench dtype (numpy has no bfloat16: 2, as float16)."""
    return 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize


def parser(description=None):
    p = argparse.ArgumentParser(prog="python -m allreduce.bench", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default=None, help=f"comma list of {','.join(ROWS)} "
                                                 "(default: mpi-raw,ring,mpi; on cuda ring,torch)")
    p.add_argument("--ops", default="allreduce", help=f"comma list of {','.join(COLLECTIVES)}")
    p.add_argument("--sizes", type=size_list, default=None,
                   help="comma list of message sizes, e.g. 4K,1M,64M (default: the "
                        "--min-bytes..--max-bytes sweep)")
    p.add_argument("--min-bytes", type=size, default="4K", help="smallest size of the sweep")
    p.add_argument("--max-bytes", type=size, default="64M", help="largest size of the sweep")
    p.add_argument("--factor", type=int, default=4, help="size step of the min..max sweep")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="element type")
    p.add_argument("--iters", type=int, default=20, help="timed rounds per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
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
                   help="emulate a slower network: bandwidth of each rank's link, Gbit/s")
    add_output_flags(p, out=False)
    p.add_argument("--predict", default=None, metavar="FILE|DIR",
                   help="add the cost model's time of each all-reduce row (predicted_us; "
                        "allreduce/twolevel.py) from a calibration: its file or the directory "
                        "`experiments.calibrate --out DIR` wrote")
    return p


def parse_args(argv=None, description=None):
    """The bench's flags, checked; lists split and sizes in bytes.  Exits 2 naming a bad flag."""
    p = parser(description)
    args = p.parse_args(argv)
    args.algos = [a for a in (args.algos or DEFAULT_ALGOS[args.device]).split(",") if a]
    emulated = args.link_latency_us or args.link_gbps
    # NCCL's own all-reduce: the baseline row, unless ranks share a GPU (nccl_rows)
    args.nccl_added = args.device == "cuda" and "torch" not in args.algos and not emulated
    if args.nccl_added:
        args.algos.append("torch")
    args.ops = [o for o in args.ops.split(",") if o]
    for a in args.algos:
        if a not in ROWS:
            p.error(f"unknown algorithm {a!r}; choose from {', '.join(ROWS)}")
    if RAW in args.algos and (args.device != "cpu" or args.dtype not in RAW_DTYPES):
        p.error(f"{RAW} takes host buffers of {', '.join(RAW_DTYPES)}")
    if args.loop < 0:
        p.error(f"--loop {args.loop}: give a number of calls >= 1, or 0 for a barrier per call")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters {args.iters} --warmup {args.warmup}: need iters >= 1, warmup >= 0")
    if emulated:
        native = [a for a in args.algos if a in ("mpi", "torch", RAW)]
        if native:
            p.error(f"link emulation slows the textbook algorithms only, not {', '.join(native)}")
    for o in args.ops:
        if o not in COLLECTIVES:
            p.error(f"unknown collective {o!r}; choose from {', '.join(COLLECTIVES)}")
    if args.predict:
        try:
            args.predict = calibration_file(args.predict)     # the file, or DIR's
        except FileNotFoundError as e:
            p.error(f"--predict: {e}")
    if not args.sizes:
        lo, hi = args.min_bytes, args.max_bytes
        args.sizes = []
        while lo <= hi:
            args.sizes.append(lo)
            lo *= max(2, args.factor)
    return args


def over_nccl(algos, transport):
    """The rows that run over NCCL on a GPU: torch's and, with --transport torch,
    the textbook ones (mpi-raw is MPI's, whatever the transport)."""
    return [a for a in algos if a == "torch" or (transport == "torch" and a != RAW)]


def nccl_rows(algos, transport, added, problem):
    """(the rows to run, a note or None) where `problem` says why NCCL cannot run
    this launch's ranks (gpus.nccl_sharing_problem), or is None.  The baseline row
    the benchmark added itself is left out with a note, as the trainer leaves NCCL
    out where ranks share a GPU; a row asked for is a ValueError naming it."""
    nccl = over_nccl(algos, transport)
    if problem is None or not nccl:
        return algos, None
    asked = [a for a in nccl if not (a == "torch" and added)]
    if asked:
        raise ValueError(f"--device cuda: {', '.join(asked)} over NCCL cannot run: {problem}; "
                         f"start fewer ranks, or use --transport mpi (it stages CUDA buffers "
                         f"through host memory, and ranks may share a GPU)")
    return [a for a in algos if a != "torch"], f"# no torch (NCCL) row: {problem}"


def memory_needed(nbytes, dtype, P, rows, device="cpu"):
    """(host bytes, device bytes) one rank of the benchmark holds at once for a
    message of `nbytes`, as allreduce/bench.py allocates it (n elements):
    the input and each row's buffer and scratch (n * itemsize each; on a GPU on
    the device, with a pinned host copy each for the staged rows), the float64
    reference made of all P ranks' inputs and their sum (8n * (P + 1)), and the
    float64 temporaries of making an input and checking a result (8n * 4)."""
    n, itemsize = nbytes // element_size(dtype), element_size(dtype)
    buffers = n * itemsize * (2 + 2 * rows)
    checking = 8 * n * (P + 5)
    if device == "cpu":
        return buffers + checking, 0
    return n * itemsize * (1 + rows) + checking, buffers


def unallocatable(sizes, dtype, P, rows, host_free, device="cpu", device_free=None):
    """Why the largest of `sizes` cannot be allocated, in one line, or None.
    `host_free` / `device_free`: the bytes of memory available to one rank."""
    largest = max(sizes, default=0)
    host, on_device = memory_needed(largest, dtype, P, rows, device)
    short = [(need, free, where) for need, free, where in
             ((host, host_free, "host"), (on_device, device_free, "GPU"))
             if free is not None and need > free]
    if not short:
        return None
    need, free, where = short[0]
    return (f"size {format_size(largest)} needs about {need / 2**30:.1f} GiB of {where} memory "
            f"per rank ({rows} rows, P={P}) but {free / 2**30:.1f} GiB is available to each; "
            f"give smaller sizes")
