"""A wrong lab 1 ring: right sums, but through MPI_Allreduce, around the lab's
transport.  check_ring must refuse it: the sandbox has no MPI."""
from mpi4py import MPI


def ring_allreduce(t, x):
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    return x
