"""SIGINT or SIGTERM during training: the workers end the run at ONE step they agree on.

mpiexec forwards a signal to every rank, but each receives it at its own moment,
and under SSP or ASP the workers are at different steps anyway.  A worker that
stopped where it stood would checkpoint another step than the others, and the
servers' shards would hold a third.  So a worker, on its signal, tells every
other worker how far it will get: the steps it has begun (`started`, the step it
is in plus one), its proposal.  Every worker then runs on to the largest
proposal S and stops there; the loop writes the checkpoint set of step S
(loop.py, runtime/checkpoint/sets.py).  No worker ever passes its own proposal before it
knows S, and S is at least every proposal, so nobody has to go back.

    stop = SignalStop(control, timeout)   # every worker (it duplicates the communicator)
    with stop:                            # our handlers in; the old ones back after
        for step in range(start, steps):
            if stop.at(step):             # the workers agreed to stop before `step`
                break
            ...                           # stop.signum: which signal it was

Why nobody waits forever (this holds for --sync ps, whose sync says so with
signal_stop): a worker at its own proposal waits for the others' proposals.
Each other worker is waiting for a server (a ZeroMQ poll, which runs Python's
signal handlers), computing (handlers run between torch calls), in a polled
barrier (runtime/waits.py's, where the loop meets before the records'
allgather under SSP and ASP), or, under BSP, in the allgather of the records
after a step, which the waiting worker has left: one still inside needs nothing
more from it.  So every handler runs, and every proposal comes.  Proposals are
tiny point-to-point messages, sent whole at once, that need no more progress
from their sender.  A worker whose signal never comes (only one rank was sent
one) is waited for `timeout` seconds; then the run fails without a new
checkpoint, and the last complete set stands.

The first signal puts the previous handlers back, so a second one interrupts at
once (KeyboardInterrupt for SIGINT), still leaving the last complete set.
"""
import signal
import threading
import time

import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)
TAG = 7                        # on the stop's own communicator, so nothing else matches


class SignalStop:
    def __init__(self, control, timeout):
        from mpi4py import MPI          # here: torchrun runs never stop this way
        self.MPI = MPI
        self.comm = control.comm.Dup()
        self.timeout = timeout
        self.started = 0               # steps this worker has begun
        self.signum = self.proposal = self.agreed = None
        self.sends, self.receives, self.previous = [], [], {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, kind, error, trace):
        self._restore()
        for _, receive in self.receives:               # a proposal that never came
            if not receive.Test():
                receive.Cancel()
                receive.Wait()
        self.MPI.Request.Waitall(self.sends)          # tiny sends: already delivered
        if kind is None:                               # a failing run aborts instead
            self.comm.Free()

    def _restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    def _on_signal(self, signum, frame):
        """The first signal: propose `started` to every other worker, listen for theirs."""
        self._restore()
        self.signum, self.proposal = signum, self.started
        mine = np.array([self.proposal], np.int64)
        peers = [p for p in range(self.comm.size) if p != self.comm.rank]
        self.sends = [self.comm.Isend(mine, dest=p, tag=TAG) for p in peers]
        self._mine = mine                            # alive until the sends complete
        self.receives = [(np.zeros(1, np.int64), p) for p in peers]
        self.receives = [(buf, self.comm.Irecv(buf, source=p, tag=TAG))
                         for buf, p in self.receives]

    def at(self, step):
        """Before `step`: True if the workers agreed to stop here, else go on with it.
        Waits (at most `timeout` s) where this worker reached its proposal."""
        self.started = step + 1        # first: a signal from now on proposes step + 1
        if self.signum is None:
            return False
        if self.agreed is None:
            if step >= self.proposal:
                self._wait()
            else:
                self._heard()
        return self.agreed is not None and step >= self.agreed

    def _heard(self):
        """Whether every other worker's proposal is in; then `agreed` is the largest."""
        if not self.MPI.Request.Testall([r for _, r in self.receives]):
            return False
        self.agreed = max([self.proposal] + [int(buf[0]) for buf, _ in self.receives])
        return True

    def _wait(self):
        deadline = time.monotonic() + self.timeout
        while not self._heard():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"stopped by {signal.Signals(self.signum).name} at step {self.proposal}, "
                    f"but not every worker said within {self.timeout:g} s how far it gets "
                    f"(were they all sent the signal?): no final checkpoint, the last "
                    f"complete one stands")
            time.sleep(0.001)


class NoStop:
    """Where a sync's waits may hold signal handlers back: signals act as Python's
    defaults (KeyboardInterrupt for SIGINT)."""
    signum = agreed = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def at(self, step):
        return False
