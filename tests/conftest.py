"""Shared by all tiers: run a script under real mpiexec, never hang.

Every launch has a wall-clock limit; on expiry the whole process group is
killed and the test fails, naming the command, instead of hanging CI.
"""
import configparser
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")


def mpi_env(**extra):
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT), "TOPOLAB_CHECK": "1", "TOPOLAB_TIMEOUT": "60",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{env['PATH']}"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, timeout, env=None, cwd=ROOT):
    """Run cmd; on timeout kill its process group and fail the test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or mpi_env(), cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung for more than {timeout} s: {' '.join(map(str, cmd))}\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def mpirun(nprocs, args, timeout=120, **env):
    """`mpiexec -n P python -m mpi4py ARGS`: an exception on one rank aborts all."""
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpich' wheel (make venv does)")
    cmd = [MPIEXEC, "-n", str(nprocs), sys.executable, "-m", "mpi4py", *map(str, args)]
    return run(cmd, timeout, mpi_env(**env))


def torchrun(nprocs, args, timeout=120, **env):
    """`torchrun --standalone --nproc-per-node P python ARGS`: torch.distributed's world
    alone, no MPI (torchrun ends the others when one rank fails)."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nprocs),
           "--no-python", sys.executable, *map(str, args)]
    return run(cmd, timeout, mpi_env(**env))


def check_ok(result):
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """The suite's failing MPI jobs (a rank that raises, exits or is killed; some 40 a
    quick tier) leave MPICH's segments in /dev/shm: at the end, remove those that
    appeared during the session and that no live process maps (shm_segments.py)."""
    from experiments import shm_segments
    before = shm_segments.snapshot()
    yield
    shm_segments.remove_left(before)


@pytest.fixture(scope="session")
def namespaces():
    """Skips unless this process can create (and remove) a network namespace: the
    emulated clusters' hosts (tests/cluster/, tests/test_sweep_launchers.py)."""
    from experiments.cluster.net import ClusterError, require_privileges
    try:
        require_privileges()
    except ClusterError as e:
        pytest.skip(f"cannot create network namespaces: {e}")
    probe = f"tlt-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=30)
    if made.returncode:
        pytest.skip(f"cannot create network namespaces: `ip netns add` says "
                    f"{made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], timeout=30, check=True)


def console_scripts():
    """{name: "module:function"} from setup.cfg [options.entry_points]."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in lines if line)


def drawn(out_dir, name):
    """The numbers a figure drew: the JSON written beside its PNG."""
    with open(Path(out_dir) / f"{name}.json") as f:
        return json.load(f)


def each_bucket(reduce):
    """GradBuckets' reduce_bucket for a test's stand-in collective reduce(flat): run on
    each bucket's flat gradients, the bucket's bytes reported as handed over."""
    def reduce_bucket(bucket, flat):
        reduce(flat)
        return flat.numel() * flat.element_size()
    return reduce_bucket
