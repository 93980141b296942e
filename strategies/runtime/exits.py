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
that is still running.

A rank's failure is the third such point, once the others have seen it.  A worker
that raises, and the workers that then wait for it in vain (a wait past --timeout
naming it, or under --sync ps the servers' error naming it), each end with an error;
`end_together` has every one of them say so to the others (waits.Bounded.agree_to_end)
and finalizes when all of them did: MPI_Finalize waits for every rank of the job
(MPICH's does), so it is safe only once none will wait for another again.  A ps
server finalizes at its normal exit, once its workers have closed (the failed
worker's ABORT and the others' reach it).  The rank whose error it is waits longest,
END_WAIT, since the others notice only at their next wait on it.

Where a rank cannot say so, the run still aborts, as it must: a rank stopped
(SIGSTOP, a debugger), hung, or killed (MPICH's launcher then kills the job itself);
a wait that --timeout does not bound (torch's C++ collectives); an error before the
workers' control exists (while the run is prepared); a second Ctrl-C.  A collective
that can never complete leaves no rank free to finalize: MPI_Abort is the only end.

MPI_Finalize is collective: every process of the job calls it.  A ps or hybrid
server does so at its normal exit, once its workers have closed; under torchrun
there is no MPI to finalize.
"""
import sys

from .waits import WaitTimeout

# The agreement's bounds, in --timeout's: a rank that timed out waiting for a peer has
# met the failure already and hears the others within one more; the rank whose own
# error it is waits for every other to notice it (each within --timeout of its next
# wait) and to say so, twice that and END_MARGIN_S for a step still being computed.
END_WAIT = 2
END_MARGIN_S = 5.0


class AgreedExit(SystemExit):
    """SystemExit(status) that every rank of the job raises at the same point."""


class FailedRank(Exception):
    """This rank's run stopped on an error (its __cause__) once the workers' bounded
    control existed: `control`, on which the ranks may agree to end (end_together)."""

    def __init__(self, control):
        super().__init__("this rank failed")
        self.control = control


def end_together(control, why, timeout, own):
    """After an error on this rank (`why`, its line; `own`: raised here, not met
    waiting for a peer), hear every rank of control say it ends too, within timeout s
    (own: END_WAIT x timeout + END_MARGIN_S), and finalize MPI -> ({rank: (own, why)}
    of every rank, None); or, when some stayed silent, (None, the text naming them),
    MPI left running: the caller's exit aborts it."""
    within = END_WAIT * timeout + END_MARGIN_S if own else timeout
    try:
        notices = control.agree_to_end((own, why), within)
    except WaitTimeout as e:
        silent = ", ".join(f"rank {p}" for p in e.silent)
        return None, f"{silent} did not say it ends within {within:g} s (stopped or hung): " \
                     f"MPI_Abort"
    finish()
    return notices, None


def finish():
    """Finalize MPI where this process runs it and has not finalized it yet."""
    MPI = sys.modules.get("mpi4py.MPI")          # not imported: torchrun, or no MPI at all
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
