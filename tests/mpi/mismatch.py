"""Ranks that disagree about a collective must all raise, naming the mismatch.

    TOPOLAB_CHECK=1 mpiexec -n 3 python -m mpi4py tests/mpi/mismatch.py CASE

Rank 0 prints one line per rank, 'rank R raised: MESSAGE' or 'rank R ok'
(gathered over MPI, so lines from several ranks cannot interleave).
"""
import sys

import numpy as np
from mpi4py import MPI

import allreduce

rank = MPI.COMM_WORLD.rank
case = sys.argv[1]
coll = allreduce.create(sys.argv[2] if len(sys.argv) > 2 else "ring")
x = np.arange(10 + (2 if rank == 2 and case == "count" else 0), dtype=np.float32)
try:
    if case == "count":
        coll.allreduce(x)
    elif case == "collective":
        coll.broadcast(x) if rank == 1 else coll.allreduce(x)
    elif case == "dtype":
        coll.allreduce(x.astype(np.float64) if rank == 0 else x)
    elif case == "op":
        coll.allreduce(x, op="max" if rank == 2 else "sum")
    elif case == "bad_input_one_rank":
        if rank == 1:
            x.flags.writeable = False
        coll.allreduce(x)
    elif case == "matching":
        coll.allreduce(x)
    outcome = f"rank {rank} ok"
except allreduce.CollectiveError as e:
    outcome = f"rank {rank} raised: {e}"
lines = MPI.COMM_WORLD.gather(outcome, root=0)
if rank == 0:
    print("\n".join(lines), flush=True)
