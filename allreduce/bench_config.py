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
