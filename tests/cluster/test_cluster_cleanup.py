"""Tier (d): the cluster tool leaves nothing behind: no namespace, link, bridge or
process, whether the tool is killed with SIGKILL mid-job (then `down` cleans up;
`up` refuses while the job runs), ended with SIGTERM or Ctrl-C (it cleans up
itself), or refused for want of privileges (it makes nothing)."""
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import check_ok

from .conftest import Cluster, alive


def start_sleeping_job(cluster, pid_dir, timeout=60):
    """`run --nodes 2` of a job that sleeps; returns (tool process, rank pids, mpiexec pid)
    once every rank is up."""
    tool = subprocess.Popen(cluster.command("run", "--nodes", 2, "--ranks-per-node", 1,
                                            "--inter-gbps", 1, "--", "tests/cluster/job.py",
                                            "sleep", pid_dir),
                            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + timeout
    while len(os.listdir(pid_dir)) < 2:
        if tool.poll() is not None or time.monotonic() > deadline:
            tool.kill()
            pytest.fail(f"the job did not start: {tool.communicate()[0][-3000:]}")
        time.sleep(0.2)
    time.sleep(0.2)                                   # the pid files are written
    ranks = [int(open(os.path.join(pid_dir, f)).read()) for f in os.listdir(pid_dir)]
    return tool, ranks, cluster.state()["mpiexec_pid"]


@pytest.fixture
def own_cluster(namespaces, tmp_path):
    c = Cluster(tmp_path / "run", "tlk-", "10.77.10.0/24")
    (tmp_path / "pids").mkdir()
    try:
        yield c, str(tmp_path / "pids")
    finally:
        c.cli("down", timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["down", "up"])
def test_kill_9_mid_job_then_down_leaves_nothing_stale(own_cluster, then):
    """The job outlives its killed tool; `up` leaves a cluster with a job on it alone
    (state.py: it is live), `down` ends the job and removes everything."""
    cluster, pid_dir = own_cluster
    tool, ranks, mpiexec = start_sleeping_job(cluster, pid_dir)
    tool.send_signal(signal.SIGKILL)                  # no chance to clean up
    tool.wait(timeout=10)
    assert cluster.leftovers() and any(alive(p) for p in ranks)
    if then == "up":
        result = cluster.cli("up", "--nodes", 2, "--inter-gbps", 1, timeout=60)
        assert result.returncode == 2 and "a job runs on it" in result.stderr, result.stderr
        assert all(alive(p) for p in ranks)
    check_ok(cluster.cli("down", timeout=60))
    assert cluster.leftovers() == []
    assert not os.path.exists(cluster.run_dir)
    assert not [p for p in ranks + [mpiexec] if alive(p)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_ends_the_job_and_tears_down(own_cluster, signum, code):
    cluster, pid_dir = own_cluster
    tool, ranks, mpiexec = start_sleeping_job(cluster, pid_dir)
    tool.send_signal(signum)
    out, _ = tool.communicate(timeout=30)
    assert tool.returncode == code, out[-3000:]
    assert "torn down" in out
    assert cluster.leftovers() == []
    assert not [p for p in ranks + [mpiexec] if alive(p)]


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("capsh") is None, reason="needs capsh to drop capabilities")
def test_without_privileges_it_says_so_and_makes_nothing(own_cluster):
    cluster, _ = own_cluster
    cmd = " ".join(cluster.command("run", "--nodes", 2, "--", "allreduce.bench"))
    out = subprocess.run(["capsh", "--drop=cap_net_admin,cap_sys_admin", "--", "-c", cmd],
                         env=cluster.env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 2
    assert "needs root" in out.stderr and "--link-gbps" in out.stderr
    assert cluster.leftovers() == []
