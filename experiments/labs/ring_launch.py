"""How lab 1's check runs a student's ring on P ranks, and learns how each rank ended.

    driver (run_all)                 one `mpiexec -n P` per world size; streams what
      └─ mpiexec -n P                the ranks print, without MPI's own banners
           └─ guard, one a rank      a plain process (no MPI): waits for its worker
                └─ worker            the MPI rank that runs the ring (check_ring.worker)

Why a guard: MPI hides how a rank ended.  When one calls os._exit(3) or crashes,
hydra kills the others and reports the exit code of one of those it killed, and a
rank that exits with status 0 before MPI_Finalize can end the job with status 0.
The guard is the worker's parent, so it sees the real exit status; unless the
worker had reached its verdict, it writes that status down, with the length the
worker was at, for the driver to print.  The worker inherits the guard's file
descriptors, the one it reaches the process manager through among them.

A status directory per world size holds what the processes tell the driver:
  at.R       the length rank R is at          done.R   rank R reached the verdict
  verdict    rank 0's: correct or wrong       dead.R   the guard's: how rank R ended
"""
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

RUN_TIMEOUT_S = 120
# What mpiexec (hydra) and mpi4py print when a job ends early: every rank of a
# wrong ring exits 1 (MPI_Abort), and a dead rank brings hydra's banner.
NOISE = ("application called MPI_Abort", "BAD TERMINATION", "YOUR APPLICATION TERMINATED",
         "This typically refers to a problem", "Please see the FAQ page", "=====")


class Status:
    """The status directory, from the processes' side."""

    def __init__(self, path):
        self.path = path

    def write(self, name, text):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(text)

    def read(self, name):
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def at(self, rank, n):
        self.write(f"at.{rank}", str(n))

    def finish(self, rank, world, verdict):
        """Every rank has its verdict: say so before any of them exits, so that no
        guard takes MPI_Abort's ending of a wrong ring for a death."""
        self.write(f"done.{rank}", verdict)
        if rank == 0:
            self.write("verdict", verdict)
        world.Barrier()


def die_with_parent():
    """In the worker, before it starts: the kernel kills it when its guard dies
    (hydra kills the guards of a job that ends early, not their children)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def guard(path, argv):
    """Run this rank's worker as a child; write down its exit status unless it
    reached the verdict.  Returns the worker's exit status."""
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    argv = list(argv)
    i = argv.index("--guard")
    argv[i:i + 2] = ["--worker", path]
    child = subprocess.Popen([sys.executable, "-m", "mpi4py", "-m", "experiments.labs.check_ring",
                              *argv], close_fds=False, preexec_fn=die_with_parent)
    code = child.wait()
    status = Status(path)
    if status.read(f"done.{rank}") is None:
        how = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
               else f"exited with status {code}")
        at = status.read(f"at.{rank}")
        where = f"at n={at}, before its ring returned" if at else "before the checks began"
        status.write(f"dead.{rank}", f"{how} {where} (os._exit, sys.exit outside the ring, a "
                     f"crash?); the other ranks were stopped")
    return code if code >= 0 else 1


def forward(stream, out):
    """Copy a child's lines to `out` as they come, without MPI's banners."""
    for line in stream:
        if line.strip() and not any(noise in line for noise in NOISE) \
                and not line.startswith("=   "):
            out.write(line)
            out.flush()


def run_one(path, P, timing, calibration):
    """Check the ring at P ranks; True if correct."""
    from experiments import shm_segments
    from experiments.records import mpiexec_path
    before = shm_segments.snapshot()    # a wrong ring ends in MPI_Abort: MPICH leaves its
    with tempfile.TemporaryDirectory(prefix="check-ring-") as tmp:   # segment behind
        status = Status(tmp)
        cmd = [mpiexec_path(), "-n", str(P), sys.executable, "-m", "experiments.labs.check_ring",
               path, "--guard", tmp]
        if not timing:
            cmd.append("--no-timing")
        if calibration:
            cmd += ["--calibration", calibration]
        # its own process group, so that it can be killed whole
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        copiers = [threading.Thread(target=forward, args=(proc.stdout, sys.stdout)),
                   threading.Thread(target=forward, args=(proc.stderr, sys.stderr))]
        for copier in copiers:
            copier.start()
        deadline, hung = time.monotonic() + RUN_TIMEOUT_S, False
        while proc.poll() is None:
            if time.monotonic() > deadline:
                hung = True
                break
            time.sleep(0.05)
        try:                            # whatever of the job is left, hung or not
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        for copier in copiers:
            copier.join()               # every rank has closed its output: they are gone
        shm_segments.remove_left(before, settle_s=2.0)
        dead = sorted(name for name in os.listdir(tmp) if name.startswith("dead."))
        if dead:
            print(f"P={P}: WRONG")
            for name in dead:
                print(f"  rank {name[5:]} {status.read(name)}")
            return False
        if hung:
            print(f"P={P}: no answer in {RUN_TIMEOUT_S} s: does every rank make the same "
                  f"sendrecv calls?")
            return False
        return proc.returncode == 0 and status.read("verdict") == "correct"


def run_all(path, world_sizes, timing, calibration):
    """Check the ring at each P (timing it at the first); exit status 0 if correct."""
    ok = True
    for i, P in enumerate(world_sizes):
        ok &= run_one(path, P, timing and i == 0, calibration)
    print("PASS: your ring all-reduce is correct" if ok else "FAIL: see the lines above")
    return 0 if ok else 1
