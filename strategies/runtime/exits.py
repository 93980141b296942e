"""How a run ends when every rank ends it together: MPI finalized, not aborted.

MPICH puts the ranks of a host in touch through a shared-memory segment in /dev/shm
(`mpich_shm_*`), which MPI_Finalize removes and MPI_Abort leaves behind, 1-4 MiB
each until the machine restarts (experiments/shm_segments.py).  `python -m mpi4py`
turns every non-zero exit into MPI_Abort.  That is right for a rank that fails
alone: its peers wait in a collective that will never complete, and only an abort
frees them.  But two exits of the worker are taken by every rank at the same point,
after the ranks agreed on them:

    a refused flag    train.report: every rank prints its line, meets the others in
                      a barrier, and exits 2
    a signal          engine/loop.py: every worker stops at the step they agreed on
                      (engine/stopping.py), writes its checkpoint, exits 128 + signal

No peer is left waiting there, so the ranks may finalize: such an exit is an
`AgreedExit`, and strategies.train's main finalizes MPI before it lets one go
(`finish`), where it runs the command line: a Python caller that runs several
trainings in one process (the tests do) keeps its MPI for the next.  mpi4py's abort at exit then does nothing, since it aborts only an MPI
that is still running.  Whatever else ends a rank (an exception, a wait past
--timeout, a second Ctrl-C) still aborts, as it must.

MPI_Finalize is collective: every process of the job calls it.  A ps or hybrid
server does so at its normal exit, once its workers have closed; under torchrun
there is no MPI to finalize.
"""
import sys


class AgreedExit(SystemExit):
    """SystemExit(status) that every rank of the job raises at the same point."""


def finish():
    """Finalize MPI where this process runs it and has not finalized it yet."""
    MPI = sys.modules.get("mpi4py.MPI")          # not imported: torchrun, or no MPI at all
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
