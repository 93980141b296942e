"""Runs that end through the worker's own paths leave no MPICH segment in /dev/shm.

    a refused flag      every rank prints its line and exits 2, MPI finalized
    Ctrl-C (SIGINT)     the workers stop at one step, checkpoint, exit 130, MPI finalized
                        (ring; and ps, whose server finalizes at its own normal exit)
    a rank that raises  its traceback; the others a line naming it once their wait on
                        it ends; every rank says it ends, exit 1, MPI finalized

(strategies/runtime/exits.py.)  Tier (c): real mpiexec runs, each in a mount namespace
of its own with a fresh tmpfs on /dev/shm, so that what is left there is this run's
alone, whatever other jobs on the machine do, and vanishes with the namespace.  That
needs root (or unprivileged user namespaces); elsewhere the tests are skipped.
"""
import json
import shutil
import subprocess
import sys

import pytest
from conftest import MPIEXEC, ROOT, mpi_env

PRIVATE_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
MLP = ["-m", "strategies.train", "--model", "mlp", "--width", "8", "--depth", "1",
       "--in-dim", "4", "--classes", "3", "--dataset-size", "96", "--global-batch", "12",
       "--threads", "1", "--no-progress", "--seed", "3"]

# Runs inside the namespace: mpiexec, a SIGINT to it once a checkpoint is on disk (when
# asked), then what /dev/shm holds once mpiexec has returned.
DRIVER = """
import json, os, signal, subprocess, sys, time
cmd, ckpt = json.loads(sys.argv[1]), sys.argv[2]
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
if ckpt:
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(ckpt, "checkpoint.pt")) and proc.poll() is None \\
            and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
try:
    out, err = proc.communicate(timeout=120)
except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
print(json.dumps({"rc": proc.returncode, "err": err, "left": sorted(os.listdir("/dev/shm"))}))
"""


def private_shm_possible():
    if shutil.which("unshare") is None or MPIEXEC is None:
        return False
    probe = subprocess.run(PRIVATE_SHM + ["true"], capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not private_shm_possible(),
                                reason="no private /dev/shm here (unshare needs root)")


def in_private_shm(nprocs, args, ckpt=""):
    """mpiexec -n nprocs python -m mpi4py ARGS in a namespace of its own ->
    (exit status, stderr, the names left in its /dev/shm)."""
    cmd = [MPIEXEC, "-n", str(nprocs), sys.executable, "-m", "mpi4py", *map(str, args)]
    done = subprocess.run(PRIVATE_SHM + [sys.executable, "-c", DRIVER, json.dumps(cmd),
                                         str(ckpt)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=mpi_env())
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    return report["rc"], report["err"], report["left"]


@pytest.mark.timeout(120)
def test_a_refused_flag_leaves_no_segment():
    rc, err, left = in_private_shm(2, MLP + ["--sync", "ring", "--global-batch", "-12"])
    assert rc == 2, err[-3000:]
    assert err.count("error: --global-batch") == 2 and "MPI_Abort" not in err, err[-3000:]
    assert not [n for n in left if n.startswith("mpich_shm_")], left


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,sync", [
    pytest.param(2, ["--sync", "ring"], id="ring"),
    pytest.param(3, ["--sync", "ps", "--servers", "1"], id="ps", marks=pytest.mark.slow)])
def test_ctrl_c_leaves_no_segment(tmp_path, nprocs, sync):
    ckpt = tmp_path / "ckpt"
    rc, err, left = in_private_shm(nprocs, MLP + sync + ["--steps", "100000",
                                                         "--checkpoint-dir", ckpt,
                                                         "--checkpoint-every", "4"], ckpt)
    assert rc == 130, err[-3000:]
    assert "stopped by SIGINT" in err and "MPI_Abort" not in err, err[-3000:]
    assert not [n for n in left if n.startswith("mpich_shm_")], left


# Runs as the job's script (argv None: main on the command line): rank 1 raises (or
# stops itself: SIGSTOP) inside the metrics flush of step 3, while the others wait for
# it there (ring) or in the servers' next reply (ps).
FAULT_IN_FLUSH = """
import os, signal, sys
from mpi4py import MPI
from strategies.runtime import metrics
fault = sys.argv.pop(1)
if MPI.COMM_WORLD.rank == 1:
    flush = metrics.Metrics.flush
    def flush_then_fail(self):
        if self.pending and self.pending[-1]["step"] == 3:
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise ValueError("a fault injected into rank 1")
        flush(self)
    metrics.Metrics.flush = flush_then_fail
from strategies.train import main
sys.argv = ["strategies.train", *sys.argv[1:]]
sys.exit(main())
"""


def fault_in_flush(tmp_path, fault, sync):
    script = tmp_path / "fault_in_flush.py"
    script.write_text(FAULT_IN_FLUSH)
    return in_private_shm(3, [script, fault, *MLP[2:], *sync, "--steps", "1000",
                              "--timeout", "5"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync", [
    pytest.param(["--sync", "ring"], id="ring"),
    pytest.param(["--sync", "ps", "--servers", "1"], id="ps", marks=pytest.mark.slow)])
def test_a_failed_rank_ends_the_run_without_abort(tmp_path, sync):
    """Its traceback; on the others one line naming it and what it said; exit 1, MPI
    finalized on every rank (runtime/exits.py: end_together)."""
    rc, err, left = fault_in_flush(tmp_path, "raise", sync)
    assert rc == 1, err[-3000:]
    assert "ValueError: a fault injected into rank 1" in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("strategies.train: error:")]
    assert lines and all("rank 1 failed: ValueError: a fault injected into rank 1" in line
                         for line in lines), err[-3000:]
    assert "MPI_Abort" not in err and "BAD TERMINATION" not in err, err[-3000:]
    assert not [n for n in left if n.startswith("mpich_shm_")], left


@pytest.mark.timeout(300)
def test_a_stopped_rank_still_aborts_the_run(tmp_path):
    """A rank that cannot say it ends (SIGSTOP): MPI_Finalize would wait for it for ever,
    so the others name it and abort, within --timeout of the first timeout."""
    rc, err, _ = fault_in_flush(tmp_path, "stop", ["--sync", "ring"])
    assert rc != 0 and "ValueError" not in err, err[-3000:]
    assert "rank 1 did not say it ends within 5 s (stopped or hung): MPI_Abort" in err, \
        err[-3000:]
