"""What a buffer in shm's window costs the ring: shm's path and the ring on such a
buffer, beside the ring on a buffer of its own.

    mpiexec -n 2 python -m mpi4py -m allreduce.window_cost --sizes 16M,64M --iters 20

Rows, taken in interleaved rounds (allreduce/harness.py: a barrier before each
call, the slowest rank's time, medians), on float32 buffers:

  shm in window     shm's path on a buffer from shm.empty (auto.empty's from 1 MiB)
  ring in window    the ring on that same buffer
  ring private      the ring on np.empty's buffer: the bench's `ring` row

The last column divides by `ring private`, round by round.  MPI moves a
message from and into the window more slowly than from a private buffer: the
window's pages are 4 KiB (shared memory takes no transparent huge pages where
the kernel's shmem_enabled is never), numpy asks for 2 MiB pages for a buffer
of 4 MiB or more, and the kernel copies a message page by page
(docs/measurements/performance/README.md).  So `ring in window` is not the `ring` row: a window
buffer is worth having only while shm's path beats the ring on a private one.
"""
import argparse

import numpy as np

from . import create
from .harness import interleaved
from .units import format_size, parse_size


def rows(shm, n):
    """{row: call}, the buffers filled with rank-dependent values."""
    window = shm.empty(n, np.float32)
    private = np.empty(n, np.float32)
    window[:] = private[:] = shm.rank + 1
    return {"shm in window": lambda: shm._allreduce(window, "sum"),
            "ring in window": lambda: shm.ring._allreduce(window, "sum"),
            "ring private": lambda: shm.ring._allreduce(private, "sum")}


def main(argv=None):
    from mpi4py import MPI
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16M,64M",
                   type=lambda s: [parse_size(v) for v in s.split(",")],
                   help="comma-separated message sizes (float32)")
    p.add_argument("--iters", type=int, default=20, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or min(args.sizes) < 4:
        p.error("--iters must be >= 1, --warmup >= 0 and every size >= 4 bytes")
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        p.error(f"{comm.size} ranks: shm needs 2 or more ranks on one host")
    shm = create("shm", comm=comm)
    shm.check = False
    if comm.rank == 0:
        print(f"# P={comm.size} float32, median ms of {args.iters} rounds (slowest rank), "
              f"x = / ring private, round by round")
    for nbytes in args.sizes:
        calls = rows(shm, nbytes // 4)
        timings = interleaved(calls, rounds=args.iters, warmup=args.warmup, comm=comm)
        if comm.rank == 0:
            for name in calls:
                print(f"{format_size(nbytes):>8} {name:>15} {timings.median(name) * 1e3:9.2f} ms "
                      f"x{timings.ratio(name, 'ring private'):.2f}", flush=True)


if __name__ == "__main__":
    main()
