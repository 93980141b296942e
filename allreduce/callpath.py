"""What one small all-reduce costs, part by part, in CPU time on one rank.

    mpiexec -n 1 python -m mpi4py -m allreduce.callpath            # 4 KiB float32
    mpiexec -n 1 python -m mpi4py -m allreduce.callpath --bytes 64K --repeat 15

allreduce.bench's --loop rows give the whole overhead of a layer over the bare
MPI_Allreduce, on two ranks; this splits it into its parts.  One rank, so that
no part waits for a peer (a wait on a loaded machine is whatever the scheduler
makes it); CPU time (time.process_time), so that a rank descheduled by other
jobs is not charged; the least of --repeat batches, the figure least disturbed.
Each part is called back to back, as a training loop calls the same bucket:

  raw Allreduce            comm.Allreduce(MPI.IN_PLACE, x): the floor
  raw Iallreduce + Test    the non-blocking call the baselines make, tested
                           until done (the timeout needs a call that returns)
  full validation          Collective._begin: what a buffer's first call checks
  mpi / auto / ring        coll.allreduce(x), a call of a kind seen before
  mpi avg                  the same with op="avg": a sum, then x /= P
"""
import argparse
import time

import numpy as np

from . import create
from .units import format_size, parse_size


def cpu_us(call, calls, repeat):
    """The least CPU time per call, in us, of `repeat` batches of `calls` calls."""
    best = float("inf")
    for _ in range(repeat):
        for _ in range(calls // 10):           # warm: caches as a loop leaves them
            call()
        start = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e6


def parts(comm, x):
    """{part: call} in the order printed."""
    from mpi4py import MPI
    colls = {}
    for name in ("mpi", "auto", "ring"):
        colls[name] = create(name, comm=comm)
        colls[name].check = False               # TOPOLAB_CHECK's exchange is not the path
    in_place = MPI.IN_PLACE

    def iallreduce():
        request = comm.Iallreduce(in_place, x)
        while not request.Test():
            pass
    return {"raw Allreduce": lambda: comm.Allreduce(in_place, x),
            "raw Iallreduce + Test": iallreduce,
            "full validation (_begin)": lambda: colls["mpi"]._begin("allreduce", x, op="sum"),
            "mpi": lambda: colls["mpi"].allreduce(x),
            "mpi avg": lambda: colls["mpi"].allreduce(x, op="avg"),
            "auto": lambda: colls["auto"].allreduce(x),
            "ring (one rank: no step)": lambda: colls["ring"].allreduce(x)}


def main(argv=None):
    from mpi4py import MPI
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=parse_size, default="4K", help="message size (float32)")
    p.add_argument("--calls", type=int, default=20000, help="calls per batch")
    p.add_argument("--repeat", type=int, default=7, help="batches per part; the least counts")
    args = p.parse_args(argv)
    if args.calls < 10 or args.repeat < 1:
        p.error("--calls must be >= 10 and --repeat >= 1")
    comm = MPI.COMM_WORLD
    if comm.size != 1:
        p.error(f"run on one rank (mpiexec -n 1), not {comm.size}: no part may wait for a peer")
    x = np.arange(args.bytes // 4, dtype=np.float32)
    print(f"# CPU us per call, {format_size(x.nbytes)} float32, one rank, least of "
          f"{args.repeat} batches of {args.calls}")
    for name, call in parts(comm, x).items():
        print(f"{name:>26} {cpu_us(call, args.calls, args.repeat):8.3f}", flush=True)


if __name__ == "__main__":
    main()
