"""Rank 1 never joins the all-reduce: rank 0 must fail within TOPOLAB_TIMEOUT,
naming itself, the peer and the collective, and `python -m mpi4py` must then
abort every rank instead of leaving rank 1 behind."""
import sys
import time

import numpy as np
from mpi4py import MPI

import allreduce

coll = allreduce.create(sys.argv[1] if len(sys.argv) > 1 else "ring")
if MPI.COMM_WORLD.rank == 1:
    time.sleep(600)
coll.allreduce(np.arange(1000, dtype=np.float32))
