"""Running one sweep point: its own process group, a time limit, and the stopping signals.

A point's command (mpiexec and its ranks, the cluster tool, srun) runs in a
session of its own, so the terminal's Ctrl-C never reaches it directly; the
sweep's `Stopper` catches SIGINT, SIGTERM and SIGHUP and ends the point's whole
group, so that no rank outlives the sweep, and no shared-memory segment the
point's MPI job left either (shm_segments.py).
"""
import os
import shlex
import signal
import subprocess
import sys
import time

from allreduce.records import checkout_pythonpath

from . import shm_segments
from .records import ROOT


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopper:
    """The handler of the stopping signals: it ends the running point's process group
    at once and remembers the signal; the loop then stops between points.

    The handler acts rather than raising into the loop so that no moment is
    unguarded: a signal during Popen (the child exists, its pid is not yet known)
    is caught by the check right after Popen returns.  A point with `grace_s`
    (the emulated cluster's tool, which must remove its namespaces) gets SIGTERM
    first and SIGKILL when it is still there `grace_s` later; others get SIGKILL."""

    def __init__(self):
        self.signum = None
        self.pgid = None
        self.grace_s = 0.0
        self.asked_at = None                # when SIGTERM went, if it did

    def __call__(self, signum, frame):
        self.signum = signum
        self.kill()

    def kill(self, force=False):
        if self.pgid is None:
            return
        gentle = self.grace_s > 0 and self.asked_at is None and not force
        try:
            os.killpg(self.pgid, signal.SIGTERM if gentle else signal.SIGKILL)
        except ProcessLookupError:
            pass
        if gentle:
            self.asked_at = time.monotonic()

    def overdue(self):
        """Whether SIGTERM went more than grace_s ago (time for SIGKILL)."""
        return self.asked_at is not None and time.monotonic() - self.asked_at > self.grace_s

    def install(self):
        """Handle the stopping signals; returns the previous handlers for `restore`."""
        return {s: signal.signal(s, self) for s in STOP_SIGNALS}

    @staticmethod
    def restore(previous):
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_point(argv, log_path, timeout, stopper=None, env=None, grace_s=0.0):
    """(status, returncode, wall seconds); the whole process group dies on timeout or
    when `stopper` caught a stopping signal (status "stopped"); with grace_s, it is
    asked to end (SIGTERM) that long first.  `env`: more environment for the point."""
    stopper = stopper or Stopper()
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1", "TOPOLAB_TIMEOUT": str(max(10, int(timeout))),
           **(env or {})}
    start, before = time.monotonic(), shm_segments.snapshot()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        stopper.pgid, stopper.grace_s, stopper.asked_at = proc.pid, grace_s, None  # pgid == pid
        timed_out = False
        try:
            if stopper.signum is not None:      # the signal came while Popen ran
                stopper.kill()
            while True:
                try:
                    rc = proc.wait(0.25)
                    break
                except subprocess.TimeoutExpired:
                    if not timed_out and time.monotonic() - start > timeout:
                        timed_out = True
                        stopper.kill()
                    elif stopper.overdue():
                        stopper.kill(force=True)
            status = "timeout" if timed_out else "ok" if rc == 0 else "failed"
            if timed_out:
                log.write(f"\n[sweep] killed after {timeout} s\n")
        except BaseException:                   # anything else: no orphaned ranks either
            stopper.kill(force=True)
            proc.wait()
            raise
        finally:
            stopper.pgid = None
            shm_segments.remove_left(before)   # what a killed or aborted job's MPICH left
        if stopper.signum is not None:
            status = "stopped"
            log.write(f"\n[sweep] killed by {signal.Signals(stopper.signum).name} "
                      f"to the sweep\n")
    return status, rc, time.monotonic() - start
