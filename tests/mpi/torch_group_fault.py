"""Fault: a torch transport over a sub-communicator made by only some ranks.

    TOPOLAB_TIMEOUT=3 mpiexec -n 2 python -m mpi4py tests/mpi/torch_group_fault.py

torch makes a group with every rank of the world, so the transport of a
communicator is made by the whole launch together.  Here rank 1 never comes:
rank 0 must stop with a TransportError saying so within the timeout, not hang
(python -m mpi4py then aborts rank 1, which waits in a barrier).
"""
from mpi4py import MPI

import allreduce

world = MPI.COMM_WORLD
allreduce.make_transport("torch")          # the torch world: every rank
if world.rank == 0:
    allreduce.make_transport("torch", MPI.COMM_SELF)
    print("rank 0 made a group alone: no error", flush=True)
world.Barrier()
