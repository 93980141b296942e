"""strategies.train with a fault injected into its loop: data-parallel rank RANK raises
RuntimeError("injected fault at step STEP") in that step, before it synchronizes.

    mpiexec -n 3 python -m mpi4py tests/mpi/train_fault.py RANK STEP JSON

JSON: a list of argv, trained in turn in one launch.  Every rank prints how each run
ended, `rank R run I: finished` or `rank R run I: raised TYPE: TEXT`, and goes on to
the next: what the other workers see must come from the servers, not from MPI_Abort
ending them all first.  psrv's log goes to stderr, each line led by `rank R`.
"""
import json
import logging
import sys

from mpi4py import MPI

import strategies.loop as loop
import strategies.train as train

fault_rank, fault_step, runs = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
rank = MPI.COMM_WORLD.rank
logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format=f"rank {rank} %(name)s %(levelname)s %(message)s")
real_step = loop.one_step


def faulty_step(step, cfg, ctx, *args, **kwargs):
    if ctx.dp_rank == fault_rank and step == fault_step:
        raise RuntimeError(f"injected fault at step {step}")
    return real_step(step, cfg, ctx, *args, **kwargs)


loop.one_step = faulty_step
for i, argv in enumerate(runs):
    try:
        train.main(argv)
        print(f"rank {rank} run {i}: finished", flush=True)
    except Exception as e:          # noqa: BLE001 - reported, then the next run
        print(f"rank {rank} run {i}: raised {type(e).__name__}: {e}", flush=True)
