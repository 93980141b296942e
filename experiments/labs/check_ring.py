"""Self-check of lab 1: is your ring all-reduce right, is it a ring, and how fast
is it?

    .venv/bin/python -m experiments.labs.check_ring my_ring.py                 # P = 2, 3, 4
    .venv/bin/python -m experiments.labs.check_ring my_ring.py --np 4 \\
        --calibration results/calibration.json

For each P it runs your ring on P ranks under mpiexec (experiments/labs/ring_launch.py).
Your `ring_allreduce(t, x)` gets no communicator, only `t`, the lab's transport
(t.rank, t.size, t.sendrecv; experiments/labs/ring_transport.py), which counts the bytes
each rank sends and watches every exchange.  At lengths 1, P - 1, P, P + 1, 17, 1001
and 12345 it checks

  the values      every rank feeds arange(n) + 1000 (rank + 1): position- and
                  rank-dependent (all-ones would hide a chunk in the wrong place),
                  and no rank adds 0 anywhere, so a missing step or a missing
                  phase leaves some element short at every length
  the ring        every exchange sends to the right neighbour and receives from the
                  left one; no message is longer than a chunk (ceil(n/P)); the chunk
                  a rank sends is as long as the buffer its neighbour receives it in
  the bytes       a ring sends 2(P - 1) chunks of about n/P per rank, 2(P - 1) n
                  elements over all ranks; and nothing goes around t: a call on
                  MPI.COMM_WORLD during the ring (an MPI_Allreduce, say) is named

After each length the ranks exchange their findings (an allgather), so all of
them stop at the same length with one verdict, which rank 0 prints.  A rank whose
ring raises tells the others at once, which stop waiting for it, and rank 0
prints its traceback above the verdict; a rank that exits or dies is named with
its exit status.  Then, at the first P, it times your ring on 16 MiB and prints
its busbw beside the cost model's prediction (costmodel.ring_allreduce; alpha,
beta, gamma and cores from --calibration, else alpha, beta, gamma probed now,
without a cores term).
Exit 0: correct.
"""
import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback

import numpy as np

from .grading import load_student
from .ring_launch import Status, guard, run_all
from .ring_transport import TIMEOUT_S, Alarm, LabTransport, PeerFailed, WatchedWorld

TIME_BYTES = 16 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


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


def student_traceback(error):
    """The traceback of an exception from the student's ring, from its first frame
    outside this package on (the check's own frames say nothing to a student)."""
    frames = traceback.extract_tb(error.__traceback__)
    first = next((i for i, f in enumerate(frames) if not f.filename.startswith(HERE)), 0)
    return "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames[first:]),
                    *traceback.format_exception_only(type(error), error)])


def one_length(ring, t, alarm, world, n):
    """(kind, text) of what went wrong on this rank at length n, or None; a ring
    that raised adds its traceback, which rank 0 prints above the verdict (printed
    here, another rank's pipe under mpiexec could deliver it after the verdict)."""
    t.reset(n)                          # world.calls: kept from the module's loading on
    x, want = inputs(n, t.rank, t.size)
    try:
        out = ring(t, x)
    except TimeoutError as e:
        return ("ring", f"{t.not_a_ring}, then waited in vain") if t.not_a_ring else \
            ("timeout", str(e))
    except PeerFailed:
        return "stopped", ""
    except SystemExit as e:             # sys.exit() in the ring: the rank lives on to say so
        alarm.ring()
        return "raised", f"exited with status {e.code!r} (sys.exit) inside the ring"
    except Exception as e:              # noqa: BLE001 - the student's code may raise anything
        alarm.ring()
        return ("raised", f"raised {type(e).__name__}: {e} (its traceback is above)",
                f"rank {t.rank}, n={n}: your ring raised\n{student_traceback(e)}")
    if world.calls:
        return "around", (
            f"called MPI.COMM_WORLD.{', '.join(dict.fromkeys(world.calls))}: those bytes "
            f"go around t, and the check cannot call that a ring (send everything with "
            f"t.sendrecv)")
    if t.mismatch:
        return "chunks", t.mismatch
    if t.not_a_ring:
        return "ring", t.not_a_ring
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
        waits = ("timeout", "stopped")
        causes = [p for p in problems if p[1] not in waits] or problems
        ranks_of = {}                   # the same text from several ranks: said once
        for r, _, text in causes:
            ranks_of.setdefault(text, []).append(str(r))
        lines = [f"rank{'s' * (len(rs) > 1)} {', '.join(rs)}, n={n}: {text}"
                 for text, rs in ranks_of.items()]
        stopped = [str(r) for r, kind, _ in problems if kind == "stopped"]
        waited = [str(r) for r, kind, _ in problems if kind == "timeout"]
        if stopped:
            lines.append(f"rank(s) {', '.join(stopped)} were waiting for it, and stopped")
        if waited and len(causes) < len(problems):
            lines.append(f"rank(s) {', '.join(waited)} then waited for it in vain "
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
                f"than the 2(P-1)*n*8 = {ring_total} of a ring: the data went around t; send "
                f"everything with t.sendrecv"]
    heaviest = int(np.argmax(sent))
    if total > ring_total or sent[heaviest] > most:
        return [f"n={n}: the sums are right, but rank {heaviest} sent {sent[heaviest]} bytes and "
                f"all ranks {total}; a ring sends 2(P-1)*n*8 = {ring_total} in all, chunks of "
                f"about n/P (at most {most} from one rank), never whole vectors: are whole "
                f"vectors going round the ring?"]
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


def worker(path, do_timing, calibration, status):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    comm, alarm_comm = world.Dup(), world.Dup()     # the ring's messages, the alarm's
    watched = MPI.COMM_WORLD = WatchedWorld(world)   # what the student's module sees
    P, rank = world.Get_size(), world.Get_rank()
    try:
        ring = load(path)
    except Exception as e:              # noqa: BLE001 - the student's file may raise anything
        if rank == 0:
            print(f"P={P}: WRONG\n  cannot load {path}: {type(e).__name__}: {e}", flush=True)
        status.finish(rank, world, "wrong")
        return 1
    alarm = Alarm(alarm_comm)
    t = LabTransport(comm, alarm=alarm)
    for n in lengths(P):
        status.at(rank, n)
        problem = one_length(ring, t, alarm, watched, n)
        watched.calls.clear()
        shown = problem[2] if problem and len(problem) > 2 else ""
        findings = world.allgather((problem and problem[:2], t.bytes_sent, shown))
        lines = verdict([(p, sent) for p, sent, _ in findings], n, P)
        if lines:
            if rank == 0:
                for text in (shown for _, _, shown in findings if shown):
                    print(text, end="", flush=True)
                print(f"P={P}: WRONG\n  " + "\n  ".join(lines), flush=True)
            status.finish(rank, world, "wrong")
            return 1
    alarm.close()
    if rank == 0:
        print(f"P={P}: correct: a ring, and every rank sent 2(P-1)/P*n*8 bytes (to a chunk's "
              f"rounding)", flush=True)
    status.finish(rank, world, "correct")
    if do_timing:
        measured, predicted, about = timing(ring, comm, calibration)
        if rank == 0:
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
    p.add_argument("--guard", metavar="DIR", help="(internal) one rank's guard under mpiexec")
    p.add_argument("--worker", metavar="DIR", help="(internal) one rank, under the guard")
    a = p.parse_args(argv)
    if a.guard:
        return guard(a.guard, argv if argv is not None else sys.argv[1:])
    calibration = json.load(open(a.calibration)) if a.calibration else None
    if a.worker:
        return worker(a.file, a.timing, calibration, Status(a.worker))
    return run_all(a.file, [int(x) for x in a.np.split(",")], a.timing, a.calibration)


if __name__ == "__main__":
    sys.exit(main())
