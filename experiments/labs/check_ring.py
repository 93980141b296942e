"""Self-check of lab 1: is your ring all-reduce right, does it send what a ring
sends, and how fast is it?

    .venv/bin/python -m experiments.labs.check_ring my_ring.py                 # P = 2, 3, 4
    .venv/bin/python -m experiments.labs.check_ring my_ring.py --np 4 \\
        --calibration results/calibration.json

For each P it runs `.venv/bin/mpiexec -n P .venv/bin/python -m mpi4py -m
experiments.labs.check_ring FILE --worker`.  Your `ring_allreduce(t, x)` gets no
communicator, only `t`, the lab's transport (t.rank, t.size, t.sendrecv), which
counts the bytes each rank sends and checks every sendrecv against the one it
pairs with.  At lengths 1, P - 1, P, P + 1, 17, 1001 and 12345 it checks

  the values      every rank feeds arange(n) + 1000 (rank + 1): position- and
                  rank-dependent (all-ones would hide a chunk in the wrong place),
                  and no rank adds 0 anywhere, so a missing step or a missing
                  phase leaves some element short at every length
  chunk sizes     the chunk a rank sends must be as long as the buffer its right
                  neighbour receives it into
  the bytes       a ring sends chunks of about n/P, 2(P - 1) of them per rank:
                  2(P - 1) n elements over all ranks.  More means whole vectors
                  travel; fewer means part of the sum went around t (a direct
                  MPI call such as MPI_Allreduce moves no bytes through t)

After each length the ranks exchange their findings (an allgather), so all of
them stop at the same length with one verdict, which rank 0 prints.  Then, at
the first P, it times your ring on 16 MiB and prints its busbw beside the cost
model's prediction (costmodel.ring_allreduce; alpha, beta, gamma and cores
from --calibration, else alpha, beta, gamma probed now, without a cores term).
Exit 0: correct.
"""
import argparse
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np

from allreduce.nap import may_nap

from .grading import load_student

TIME_BYTES = 16 << 20
TIMEOUT_S = 10.0        # a wrong ring may wait forever; a right one needs milliseconds
DATA, LENGTH = 0, 1     # message tags


class LabTransport:
    """What a student's ring gets: rank, size and sendrecv, nothing else.

    Not allreduce.MPITransport: that one imports torch (seconds per rank on a
    laptop) and offers more than the lab allows.  This one keeps its
    communicator to itself and counts the bytes sent.  With check=True it sends
    each message's length first, so the receiver can compare it with its
    buffer: on a mismatch it records what differs and receives into scratch, so
    both sides carry on in step (instead of an MPI truncation error on one rank
    and a wait for it on the others)."""

    def __init__(self, comm, check=True, timeout=TIMEOUT_S):
        self._comm, self._check, self._timeout = comm, check, timeout
        self._nap = may_nap()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.reset()

    def reset(self):
        self.bytes_sent, self.calls, self.mismatch = 0, 0, None

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        """Send sendbuf to rank dest while receiving recvbuf from rank source."""
        self.calls += 1
        for name, buf in (("sendbuf", sendbuf), ("recvbuf", recvbuf)):
            if not (isinstance(buf, np.ndarray) and buf.ndim == 1 and buf.flags.c_contiguous
                    and buf.dtype == np.float64):
                raise TypeError(f"t.sendrecv: {name} must be a 1-D float64 numpy array such as "
                                f"x[a:b], got {type(buf).__name__} {getattr(buf, 'dtype', '')}")
        for name, peer in (("dest", dest), ("source", source)):
            if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.size):
                raise ValueError(f"t.sendrecv: {name}={peer!r} is not a rank (0..{self.size - 1})")
        if self._check:
            mine, theirs = np.array([sendbuf.size], np.int64), np.empty(1, np.int64)
            self._wait([self._comm.Irecv(theirs, source, LENGTH),
                        self._comm.Isend(mine, dest, LENGTH)], dest, source)
            if theirs[0] != recvbuf.size:
                if self.mismatch is None:
                    self.mismatch = (
                        f"sendrecv call {self.calls}: rank {source} sent {theirs[0]} elements "
                        f"into a receive buffer of {recvbuf.size}: the send and receive chunk "
                        f"sizes differ (the chunk a rank sends right must be the chunk its "
                        f"right neighbour receives, and receive buffers must be sliced to it)")
                recvbuf = np.empty(int(theirs[0]))
        self.bytes_sent += sendbuf.nbytes
        self._wait([self._comm.Irecv(recvbuf, source, DATA),
                    self._comm.Isend(sendbuf, dest, DATA)], dest, source)

    def __getattr__(self, name):
        raise AttributeError(f"the lab's transport has no {name!r}: a ring needs only "
                             f"t.rank, t.size and t.sendrecv")

    def _wait(self, requests, dest, source):
        from mpi4py import MPI
        deadline = time.monotonic() + self._timeout
        polls = 0
        while not MPI.Request.Testall(requests):
            polls += 1
            if polls > 100:        # then leave the core to a rank that may need it
                time.sleep(50e-6) if self._nap else os.sched_yield()
            if polls % 1000 == 0 and time.monotonic() > deadline:
                for request in requests:
                    request.Cancel()
                raise TimeoutError(
                    f"sendrecv call {self.calls} (to rank {dest}, from rank {source}) found "
                    f"no partner in {self._timeout:g} s")


def load(path):
    module = load_student(path, "student_ring")
    if not hasattr(module, "ring_allreduce"):
        raise ImportError(f"{path} defines no ring_allreduce(t, x)")
    return module.ring_allreduce


def lengths(P):
    return sorted({1, max(1, P - 1), P, P + 1, 17, 1001, 12345})


def inputs(n, rank, P):
    """(what `rank` feeds, the sum every rank must end with)."""
    x = np.arange(n, dtype=np.float64) + 1000.0 * (rank + 1)
    return x, np.arange(n, dtype=np.float64) * P + 1000.0 * P * (P + 1) / 2


def diagnose(value, i, n, P):
    """What a wrong element holds, read back from the inputs: the sum of which
    ranks' element j.  Complete sums of another element come from a chunk in the
    wrong place; partial sums of this one from a missing step or phase."""
    options = []
    for k in range(P, 0, -1):
        for ranks in itertools.combinations(range(P), k):
            j = (value - 1000.0 * sum(r + 1 for r in ranks)) / k
            if j == int(j) and 0 <= j < n:
                options.append((int(j) != i, ranks, int(j)))
    if not options:
        return ""
    moved, ranks, j = min(options)
    if len(ranks) == P:
        return f" (the complete sum of element {j}: a chunk in the wrong place)"
    missing = sorted(set(range(P)) - set(ranks))
    where = f"element {j}'s" if moved else "its"
    return (f" ({where} sum over ranks {list(ranks)} only: rank(s) {missing} never added "
            f"theirs; a missing step, a missing addition, or no all-gather?)")


def one_length(ring, t, n):
    """(kind, text) of what went wrong on this rank, or None."""
    t.reset()
    x, want = inputs(n, t.rank, t.size)
    try:
        out = ring(t, x)
    except TimeoutError as e:
        return "timeout", str(e)
    except Exception as e:              # noqa: BLE001 - the student's code may raise anything
        return "raised", f"raised {type(e).__name__}: {e}"
    if t.mismatch:
        return "chunks", t.mismatch
    out = np.asarray(x if out is None else out)
    if out.shape != want.shape:
        return "values", f"returned an array of shape {out.shape}, not ({n},)"
    bad = np.flatnonzero(out != want)
    if bad.size:
        i = int(bad[0])
        return "values", (f"wrong elements: {bad.size}, the first at index {i}: got {out[i]:g}, "
                          f"expected {want[i]:g}" + diagnose(float(out[i]), i, n, t.size))
    return None


def verdict(findings, n, P):
    """Lines saying what is wrong at length n, from every rank's (problem, bytes
    sent), or [] if nothing is.  The same on every rank."""
    problems = [(r, *p) for r, (p, _) in enumerate(findings) if p]
    if problems:
        causes = [p for p in problems if p[1] != "timeout"] or problems
        ranks_of = {}                   # the same text from several ranks: said once
        for r, _, text in causes:
            ranks_of.setdefault(text, []).append(str(r))
        lines = [f"rank{'s' * (len(rs) > 1)} {', '.join(rs)}, n={n}: {text}"
                 for text, rs in ranks_of.items()]
        waited = [r for r, kind, _ in problems if kind == "timeout"]
        if len(causes) < len(problems):
            lines.append(f"rank(s) {', '.join(map(str, waited))} then waited for it in vain "
                         f"({TIMEOUT_S:g} s)")
        elif waited:
            lines.append("every rank waited: does each sendrecv to the right pair with one "
                         "from the left on the neighbour, the same number of times on every rank?")
        return lines
    sent = [b for _, b in findings]
    total, ring_total = sum(sent), 2 * (P - 1) * n * 8
    most = 2 * (P - 1) * math.ceil(n / P) * 8
    if total < ring_total:
        return [f"n={n}: the sums are right, but the ranks sent {total} bytes through t, fewer "
                f"than the 2(P-1)*n*8 = {ring_total} of a ring: the data went around t (a direct "
                f"MPI call such as MPI_Allreduce?); send everything with t.sendrecv"]
    heaviest = int(np.argmax(sent))
    if total > ring_total or sent[heaviest] > most:
        return [f"n={n}: the sums are right, but rank {heaviest} sent {sent[heaviest]} bytes and "
                f"all ranks {total}; a ring sends 2(P-1)*n*8 = {ring_total} in all, chunks of "
                f"about n/P (at most {most} from one rank): are whole vectors going round the "
                f"ring?"]
    return []


def timing(ring, comm, calibration):
    """(measured s, predicted s, what the model is) of one all-reduce of TIME_BYTES."""
    from mpi4py import MPI
    t = LabTransport(comm, check=False, timeout=600)
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


def worker(path, do_timing, calibration):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    comm = world.Dup()                  # the ring's messages on a communicator of their own
    P = comm.Get_size()
    try:
        ring = load(path)
    except Exception as e:              # noqa: BLE001 - the student's file may raise anything
        if world.rank == 0:
            print(f"P={P}: WRONG\n  cannot load {path}: {type(e).__name__}: {e}", flush=True)
        return 1
    t = LabTransport(comm)
    for n in lengths(P):
        problem = one_length(ring, t, n)
        lines = verdict(world.allgather((problem, t.bytes_sent)), n, P)
        if lines:
            if world.rank == 0:
                print(f"P={P}: WRONG\n  " + "\n  ".join(lines), flush=True)
            return 1
    if world.rank == 0:
        print(f"P={P}: correct, and every rank sent 2(P-1)/P*n*8 bytes (to a chunk's rounding)",
              flush=True)
    if do_timing:
        measured, predicted, about = timing(ring, comm, calibration)
        if world.rank == 0:
            factor = 2 * (P - 1) / P
            busbw = lambda s: TIME_BYTES / s * factor / 1e9  # noqa: E731
            print(f"P={P}: 16 MiB in {measured * 1e3:.2f} ms, busbw {busbw(measured):.2f} "
                  f"GB/s; cost model ({about}) predicts {predicted * 1e3:.2f} ms "
                  f"({busbw(predicted):.2f} GB/s); you reach {predicted / measured:.0%} of the "
                  f"prediction", flush=True)
    return 0


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
        # its own process group, so that it can be killed whole; stderr read back so
        # that mpi4py's "application called MPI_Abort" lines (every rank exits 1 on a
        # wrong ring) do not bury the verdict
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=120)
            ok &= proc.returncode == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            print(f"P={P}: no answer in 120 s: does every rank make the same sendrecv calls?")
            ok = False
        sys.stderr.write("".join(line for line in err.splitlines(keepends=True)
                                 if "application called MPI_Abort" not in line))
    print("PASS: your ring all-reduce is correct" if ok else "FAIL: see the lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
