"""Self-check of lab 1: is your ring all-reduce right, is it a ring, and how fast
is it?

    .venv/bin/python -m experiments.labs.check_ring my_ring.py                 # P = 2, 3, 4
    .venv/bin/python -m experiments.labs.check_ring my_ring.py --np 4 \\
        --calibration results/calibration.json

For each P the check starts P processes, one a rank, each running your file in
a sandbox whose only channel is `t` (experiments/labs/ring_sandbox.py: no MPI, no
file it may write, no socket, no other process; its own namespaces where the
machine allows).  Your `ring_allreduce(t, x)` gets t.rank, t.size and
t.sendrecv; every sendrecv goes to the check, which is the ring's network
(experiments/labs/ring_network.py).  At lengths 1, P - 1, P, P + 1, 17, 1001 and
12345 it feeds random integers, new each run, and checks

  the route       each message goes to the right neighbour, and each receive is
                  from the left one
  the contents    each message holds consecutive elements summed over an arc of
                  ranks that ends at the sender (a partial sum of the
                  reduce-scatter), or finished elements (the all-gather); never
                  zeros, never more than a chunk (ceil(n/P) elements)
  the count       each element goes round once in each phase: summed over 1, 2,
                  ..., P-1 ranks, then P-1 finished copies
  the values      every rank ends with the exact sum

and stops at the first thing that is wrong, saying what and where.  A rank that
raises is shown with its traceback; one that exits with its status; one that
waits for a message nobody will send at once, with whom it waits for; one that
runs its own code for 10 s without calling t with the line it is at.
When every P passes, it times your ring on 16 MiB at the first P under mpiexec
(experiments/labs/ring_launch.py) and prints its busbw beside the cost model's
prediction (alpha, beta, gamma and cores from --calibration, else probed now).
Exit 0: correct.
"""
import argparse
import sys

from .ring_launch import time_ring
from .ring_network import check, sandbox_words


def run_all(path, world_sizes, timing, calibration, out=sys.stdout):
    """Check the ring at each P, then time it; exit status 0 if correct."""
    ok = True
    print(f"each rank runs in a sandbox: {sandbox_words()}", file=out)
    for P in world_sizes:
        failed = check(path, P, out)
        if failed is None:
            print(f"P={P}: correct: every message a ring's, and every rank ends with the sum",
                  file=out)
            continue
        ok = False
        for text in failed.shown:
            print(text, end="" if text.endswith("\n") else "\n", file=out)
        print(f"P={P}: WRONG\n  " + "\n  ".join(failed.lines), file=out)
        break
    print("PASS: your ring all-reduce is correct" if ok else "FAIL: see the lines above",
          file=out, flush=True)
    if ok and timing:
        time_ring(path, world_sizes[0], calibration)
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.labs.check_ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="your ring, e.g. a filled-in copy of ring_skeleton.py")
    p.add_argument("--np", default="2,3,4", help="world sizes to check")
    p.add_argument("--calibration", default="", help="experiments.calibrate's JSON")
    p.add_argument("--no-timing", dest="timing", action="store_false")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.np.split(",")]
    if any(P < 1 or P > 16 for P in sizes):
        p.error("--np: world sizes from 1 to 16")
    return run_all(a.file, sizes, a.timing, a.calibration)


if __name__ == "__main__":
    sys.exit(main())
