"""Self-check of lab 1: is your ring all-reduce right, and how fast is it?

    python -m experiments.labs.check_ring my_ring.py                 # P = 2, 3, 4
    python -m experiments.labs.check_ring my_ring.py --np 2 --calibration results/cal.json

For each P it runs `mpiexec -n P python -m mpi4py -m experiments.labs.check_ring
FILE --worker`.  Every rank feeds rank- and position-dependent values
(`arange(n) + 1000 * rank`, never all-ones, which cannot catch a chunk in the
wrong place) of several awkward lengths (1, P - 1, P + 1, 1001, ...) and
compares each element with the sum it computes itself.  Then, at the first P,
it times your ring on 16 MiB and prints its busbw beside the cost model's
prediction (costmodel.ring_allreduce; alpha, beta, gamma from --calibration, or
measured on the spot with a sendrecv and an np.add probe).  Exit 0: correct.
"""
import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

TIME_BYTES = 16 << 20


def load(path):
    spec = importlib.util.spec_from_file_location("student_ring", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "ring_allreduce"):
        raise SystemExit(f"{path} defines no ring_allreduce(t, x)")
    return module.ring_allreduce


def correctness(ring, t):
    """None, or a description of the first wrong element (the same on every rank)."""
    P = t.size
    for n in sorted({1, max(1, P - 1), P, P + 1, 17, 1001, 12345}):
        x = np.arange(n, dtype=np.float64) + 1000 * t.rank
        expect = np.arange(n, dtype=np.float64) * P + 1000 * sum(range(P))
        try:
            out = ring(t, x)
        except Exception as e:          # noqa: BLE001 - the student's code may raise anything
            return f"rank {t.rank}, n={n}: raised {type(e).__name__}: {e}"
        if out is None:
            out = x
        bad = np.flatnonzero(np.asarray(out) != expect)
        if bad.size:
            i = bad[0]
            return (f"rank {t.rank}, n={n}: {bad.size} wrong elements, first at index {i}: "
                    f"got {out[i]:g}, expected {expect[i]:g}")
    return None


def timing(ring, t, calibration):
    """(measured s, predicted s) of one all-reduce of TIME_BYTES."""
    from experiments import costmodel
    n = TIME_BYTES // 8
    x, probe = np.zeros(n), np.zeros(n // t.size)
    peer_r, peer_l = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    small, big = np.zeros(512), np.zeros(n // t.size)

    def med(fn, reps=5):
        times = []
        for _ in range(reps + 1):
            t.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times[1:]))

    measured = med(lambda: ring(t, x))
    if calibration:
        m = costmodel.Machine.from_calibration(calibration)
    else:                               # probe on the spot: what one ring step does
        t_small = med(lambda: t.sendrecv(small, peer_r, np.empty_like(small), peer_l))
        t_big = med(lambda: t.sendrecv(big, peer_r, probe, peer_l))
        t_add = med(lambda: np.add(big, probe, out=big))
        beta = max(t_big - t_small, 1e-12) / (big.nbytes - small.nbytes)
        m = costmodel.Machine(max(t_small - small.nbytes * beta, 0.0), beta,
                              t_add / big.nbytes, None)
    from mpi4py import MPI
    measured = MPI.COMM_WORLD.allreduce(measured, op=MPI.MAX)
    return measured, costmodel.ring_allreduce(TIME_BYTES, t.size, m)


def worker(path, do_timing, calibration):
    from mpi4py import MPI

    from allreduce.transport import MPITransport
    t = MPITransport(MPI.COMM_WORLD, timeout=10)   # a wrong ring may wait forever
    ring = load(path)
    problem = correctness(ring, t)
    problems = [p for p in MPI.COMM_WORLD.allgather(problem) if p]
    if t.rank == 0:
        print(f"P={t.size}: " + ("correct" if not problems else "WRONG\n  " +
                                 "\n  ".join(problems)), flush=True)
    if problems:
        sys.exit(1)
    if do_timing:
        measured, predicted = timing(ring, t, calibration)
        if t.rank == 0:
            factor = 2 * (t.size - 1) / t.size
            busbw = lambda s: TIME_BYTES / s * factor / 1e9  # noqa: E731
            print(f"P={t.size}: 16 MiB in {measured * 1e3:.2f} ms, busbw {busbw(measured):.2f} "
                  f"GB/s; cost model predicts {predicted * 1e3:.2f} ms ({busbw(predicted):.2f} "
                  f"GB/s); you reach {predicted / measured:.0%} of the prediction", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.labs.check_ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="your ring, e.g. a filled-in copy of ring_skeleton.py")
    p.add_argument("--np", default="2,3,4", help="world sizes to check")
    p.add_argument("--calibration", default="", help="experiments.calibrate's JSON")
    p.add_argument("--no-timing", dest="timing", action="store_false")
    p.add_argument("--worker", action="store_true", help="(internal) one rank under mpiexec")
    a = p.parse_args(argv)
    calibration = json.load(open(a.calibration)) if a.calibration else None
    if a.worker:
        return worker(a.file, a.timing, calibration)
    from experiments.records import mpiexec_path
    ok = True
    for i, P in enumerate(int(x) for x in a.np.split(",")):
        cmd = [mpiexec_path(), "-n", str(P), sys.executable, "-m", "mpi4py", "-m",
               "experiments.labs.check_ring", a.file, "--worker"]
        if not (a.timing and i == 0):
            cmd.append("--no-timing")
        if a.calibration:
            cmd += ["--calibration", a.calibration]
        proc = subprocess.Popen(cmd, start_new_session=True)   # its own group: killable
        try:
            ok &= proc.wait(timeout=120) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"P={P}: no answer in 120 s: does every rank make the same sendrecv calls?")
            ok = False
    print("PASS: your ring all-reduce is correct" if ok else "FAIL: see the lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
