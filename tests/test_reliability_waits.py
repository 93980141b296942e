"""Tier (c): every wait of a training run is bounded by --timeout (strategies/runtime/waits.py).

A rank stopped by SIGSTOP (a debugger, a frozen host) between two steps' collectives
used to leave the others spinning for ever in the metrics flush's allgather.  Rank 1
here stops itself inside the flush of step 3 (a deterministic spot: the one the
gradients' own timeouts never covered), or is stopped from outside at a random one;
under --timeout 5 the run ends within 15 s of the stop, non-zero, and a line names
rank 1 as the one that never came.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import MPIEXEC, ROOT, mpi_env

TINY = ["--model", "mlp", "--width", "16", "--global-batch", "12", "--threads", "1",
        "--no-progress", "--timeout", "5"]
BOUND = 15.0                    # seconds from the stop to the run's end

# rank 1 stops itself inside the metrics flush of step 3, after writing the time
STOP_IN_FLUSH = '''
import os, signal, sys, time
from mpi4py import MPI
from strategies.runtime import metrics
if MPI.COMM_WORLD.rank == 1:
    flush = metrics.Metrics.flush
    def flush_then_stop(self):
        if self.pending and self.pending[-1]["step"] == 3:
            with open(sys.argv[1], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        flush(self)
    metrics.Metrics.flush = flush_then_stop
from strategies.train import main
sys.exit(main(sys.argv[2:]))
'''


def launch(nprocs, args):
    cmd = [MPIEXEC, "-n", str(nprocs), sys.executable, "-m", "mpi4py", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(STOPPED_BY=os.getpid()), cwd=ROOT,
                            start_new_session=True)


def finish(proc, limit):
    """(rc, stderr, time it ended); kills the job and fails past `limit` s."""
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"still running {limit} s on: a wait without a bound\n{err[-3000:]}")
    return proc.returncode, err, time.time()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,flags", [
    (3, ["--sync", "ring"]),
    (2, ["--sync", "ring", "--pp", "2", "--micro-batches", "2"]),
    (3, ["--sync", "ps", "--servers", "1"])], ids=["ring", "pp2", "ps"])
def test_a_rank_stopped_in_the_metrics_flush_ends_the_run(tmp_path, nprocs, flags):
    script, stopped = tmp_path / "stop_in_flush.py", tmp_path / "stopped_at"
    script.write_text(STOP_IN_FLUSH)
    proc = launch(nprocs, [script, stopped, *TINY, "--steps", "1000", *flags])
    rc, err, ended = finish(proc, 240)
    assert stopped.exists(), err[-3000:]
    assert rc != 0 and ended - float(stopped.read_text()) < BOUND, (rc, err[-3000:])
    assert "timed out after 5 s waiting for rank 1" in err, err[-3000:]
    assert "the metrics flush" in err, err[-3000:]


def rank_pid(rank):
    """The pid of training rank `rank` of the job this test started."""
    mark = f"STOPPED_BY={os.getpid()}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if mark in env and f"PMI_RANK={rank}".encode() in env and b"strategies.train" in cmdline:
            return int(pid)
    return None


@pytest.mark.timeout(300)
def test_a_rank_stopped_from_outside_ends_the_run(tmp_path):
    """SIGSTOP to rank 1 mid-training, wherever it is."""
    progress = tmp_path / "run.jsonl"
    proc = launch(3, ["-m", "strategies.train", *TINY, "--steps", "100000", "--sync", "ring",
                      "--jsonl", progress])
    deadline = time.time() + 120
    while not (progress.exists() and progress.read_text().count('"kind": "step"') >= 30):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    pid = rank_pid(1)
    assert pid
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    rc, err, ended = finish(proc, 120)
    assert rc != 0 and ended - stopped < BOUND, (rc, ended - stopped, err[-3000:])
    assert "waiting for rank 1" in err, err[-3000:]
