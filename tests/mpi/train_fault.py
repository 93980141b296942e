"""strategies.train with a fault injected into its loop: data-parallel rank RANK raises
RuntimeError("injected fault at step STEP") in that step, before it synchronizes.

    mpiexec -n 3 python -m mpi4py tests/mpi/train_fault.py RANK STEP JSON OUT

JSON: a list of argv, trained in turn in one launch.  Every rank writes how each run
ended, `finished` or `raised TYPE: TEXT`, as a line of OUT/rank-R.txt (a file of its
own: the launcher may interleave the ranks' stdout mid-line), and goes on to the
next: what the other workers see must come from the servers, not from MPI_Abort
ending them all first.  psrv's log goes to stderr, each line led by `rank R`.
"""
import json
import logging
import sys

from mpi4py import MPI

import strategies.engine.loop as loop
import strategies.train as train

fault_rank, fault_step, runs = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
rank = MPI.COMM_WORLD.rank
ended = open(f"{sys.argv[4]}/rank-{rank}.txt", "w", buffering=1)
logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format=f"rank {rank} %(name)s %(levelname)s %(message)s")
real_step = loop.StepEngine.step


def faulty_step(engine, step):
    if engine.ctx.dp_rank == fault_rank and step == fault_step:
        raise RuntimeError(f"injected fault at step {step}")
    return real_step(engine, step)


loop.StepEngine.step = faulty_step
for i, argv in enumerate(runs):
    try:
        train.main(argv)
        print("finished", file=ended)
    except Exception as e:          # noqa: BLE001 - reported, then the next run
        print(f"raised {type(e).__name__}: {e}", file=ended)
