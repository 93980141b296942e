"""How fast is a ring that lab 1's check has passed: one `mpiexec -n P` run.

    driver (time_ring)          mpiexec -n P python -m mpi4py -m experiments.labs.ring_launch
      └─ one rank each          FILE [--calibration C]; rank 0 prints one line

The verdict comes from the sandboxed run (ring_network.py); this run only times
the ring on TIME_BYTES over MPI, where the cost model's alpha, beta and gamma were
measured, and prints its busbw beside the model's prediction.  It is not part of
the verdict: it runs only after PASS, and what it prints grades nothing.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from allreduce.nap import may_nap

from .grading import load_student

TIME_BYTES = 16 << 20
RUN_TIMEOUT_S = 120


class MPILink:
    """t over MPI for the timing run: rank, size, sendrecv.  Polls with a yield
    (ranks share the cores; a busy-waiting rank would starve its neighbour)."""

    def __init__(self, comm):
        self._comm, self._nap = comm, may_nap()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        from mpi4py import MPI
        requests = [self._comm.Irecv(recvbuf, source, 0), self._comm.Isend(sendbuf, dest, 0)]
        polls = 0
        while not MPI.Request.Testall(requests):
            polls += 1
            if polls > 100:
                time.sleep(50e-6) if self._nap else os.sched_yield()


def timing(ring, comm, calibration):
    """(measured s, predicted s, what the model is) of one all-reduce of TIME_BYTES."""
    from mpi4py import MPI
    t = MPILink(comm)
    n = TIME_BYTES // 8
    x, probe = np.zeros(n), np.zeros(n // t.size)
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    small, big = np.zeros(512), np.zeros(n // t.size)

    def med(fn, reps=5):
        times = []
        for _ in range(reps + 1):
            comm.Barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times[1:]))

    measured = comm.allreduce(med(lambda: ring(t, x)), op=MPI.MAX)
    if not calibration:                 # probe on the spot: what one ring step does
        t_small = med(lambda: t.sendrecv(small, right, np.empty_like(small), left))
        t_big = med(lambda: t.sendrecv(big, right, probe, left))
        t_add = med(lambda: np.add(big, probe, out=big))
    if t.rank != 0:
        return measured, None, None
    from experiments import costmodel   # imports torch: once, on rank 0
    if calibration:
        m = costmodel.Machine.from_calibration(calibration)
        about = f"calibration: cores={m.cores}, bandwidth terms x {m.stretch(t.size):g}"
    else:
        beta = max(t_big - t_small, 1e-12) / (big.nbytes - small.nbytes)
        m = costmodel.Machine(max(t_small - small.nbytes * beta, 0.0), beta,
                              t_add / big.nbytes, None)
        about = "probed now: no cores term"
    return measured, costmodel.ring_allreduce(TIME_BYTES, t.size, m), about


def rank_main(path, calibration):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    P = comm.Get_size()
    ring = load_student(path, "student_ring").ring_allreduce
    measured, predicted, about = timing(ring, comm, calibration)
    if comm.Get_rank() == 0:
        busbw = lambda s: TIME_BYTES / s * 2 * (P - 1) / P / 1e9  # noqa: E731
        print(f"P={P}: 16 MiB in {measured * 1e3:.2f} ms, busbw {busbw(measured):.2f} GB/s; "
              f"cost model ({about}) predicts {predicted * 1e3:.2f} ms "
              f"({busbw(predicted):.2f} GB/s); you reach {predicted / measured:.0%} of the "
              f"prediction", flush=True)
    return 0


def time_ring(path, P, calibration_path):
    """Time the ring at P ranks under mpiexec; prints rank 0's line.  True if it ran."""
    from experiments.records import mpiexec_path
    cmd = [mpiexec_path(), "-n", str(P), sys.executable, "-m", "mpi4py", "-m",
           "experiments.labs.ring_launch", path]
    if calibration_path:
        cmd += ["--calibration", calibration_path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        print(f"P={P}: the timing run took over {RUN_TIMEOUT_S} s; stopped")
        return False
    lines = [line for line in out.splitlines() if line.startswith(f"P={P}: 16 MiB")]
    print("\n".join(lines) if lines and proc.returncode == 0
          else f"P={P}: the timing run failed (status {proc.returncode}):\n{out[-2000:]}")
    return bool(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.labs.ring_launch")
    p.add_argument("file")
    p.add_argument("--calibration", default="")
    a = p.parse_args(argv)
    return rank_main(a.file, json.load(open(a.calibration)) if a.calibration else None)


if __name__ == "__main__":
    sys.exit(main())
