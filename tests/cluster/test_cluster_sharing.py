"""Tier (d): clusters side by side on one machine (experiments/cluster/state.py).

`up` never touches a live cluster, whatever directory it was made from: one that is
up, or runs a job, is refused by name and left whole.  What a crashed `up` left is
stale: `status` and `run` say so in one line, and the next `up` removes it.
One cluster (2 hosts x 1 rank) serves the module; the others are made beside it.
"""
import json
import os
import signal
import stat
import subprocess
import time

import pytest

from conftest import check_ok

from .conftest import Cluster, alive

PREFIX, SUBNET = "tlq-", "10.77.20.0/24"


@pytest.fixture(scope="module")
def first(namespaces, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"), PREFIX, SUBNET)
    try:
        check_ok(c.cli("up", "--nodes", 2))
        yield c
    finally:
        check_ok(c.cli("down"))
        assert not c.leftovers()


def bridge(prefix):
    """(ifindex, IPv4 addresses) of a cluster's bridge: a bridge made again has a new index."""
    link = json.loads(subprocess.run(["ip", "-j", "addr", "show", "dev", f"{prefix}br"],
                                     capture_output=True, text=True, timeout=30).stdout)[0]
    return link["ifindex"], [a["local"] for a in link["addr_info"] if a["family"] == "inet"]


def refused(result, *words):
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    for w in words:
        assert w in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_up_refuses_a_cluster_that_is_up_from_this_directory_or_another(first, tmp_path):
    before = bridge(PREFIX), sorted(first.leftovers())
    refused(first.cli("up", "--nodes", 2, timeout=50), f"cluster {PREFIX} is in use", "it is up",
            f"down --prefix {PREFIX}")
    elsewhere = Cluster(tmp_path / "elsewhere", PREFIX, "10.77.21.0/24")
    refused(elsewhere.cli("up", "--nodes", 2, timeout=50), f"cluster {PREFIX} is in use",
            f"its files in {first.run_dir}")
    # the same bridge, addresses and hosts; the record still right, and nothing recorded
    # in the other directory
    assert (bridge(PREFIX), sorted(first.leftovers())) == before
    assert before[0][1] == ["10.77.20.254"] and first.state()["subnet"] == SUBNET
    assert not os.path.exists(os.path.join(elsewhere.run_dir, PREFIX))
    assert "MISSING" not in check_ok(first.cli("status")).stdout


@pytest.mark.timeout(120)
def test_a_running_job_survives_up_beside_it_and_up_over_it(first, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    job = subprocess.Popen(first.command("run", "--", "tests/cluster/job.py", "sleep", pid_dir),
                           env=first.env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while len(os.listdir(pid_dir)) < 2:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
        time.sleep(0.2)
    time.sleep(0.2)                                   # the pid files are written
    ranks = [int((pid_dir / f).read_text()) for f in os.listdir(pid_dir)]
    beside = Cluster(first.run_dir, "tlr-", "10.77.22.0/24")    # the same state directory
    try:
        made = check_ok(beside.cli("up", "--nodes", 1, timeout=50))
        assert "removed" not in made.stderr
        refused(first.cli("up", "--nodes", 2, timeout=50), "a job runs on it")
        same_subnet = Cluster(first.run_dir, "tlu-", SUBNET)
        refused(same_subnet.cli("up", "--nodes", 1, timeout=50), f"overlaps {SUBNET} on tlq-br")
        assert not same_subnet.leftovers()
        assert job.poll() is None and all(alive(p) for p in ranks)
    finally:
        check_ok(beside.cli("down", timeout=60))
    assert job.poll() is None and all(alive(p) for p in ranks)
    job.send_signal(signal.SIGINT)                    # the job ends as its owner asks
    out, _ = job.communicate(timeout=30)
    assert job.returncode == 130 and "the cluster stays up" in out
    assert not [p for p in ranks if alive(p)]


@pytest.fixture
def crashed_up(namespaces, tmp_path):
    """A cluster whose `up` was killed with SIGKILL while it made the hosts' links:
    a `tc` first on PATH stops it there (it writes its pid and sleeps)."""
    c = Cluster(tmp_path / "run", "tlv-", "10.77.23.0/24")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "tc").write_text(f"#!/bin/sh\necho $$ > {tmp_path}/tc.pid\nexec sleep 100\n")
    (fake / "tc").chmod(stat.S_IRWXU)
    tool = subprocess.Popen(c.command("up", "--nodes", 2), text=True,
                            env={**c.env, "PATH": f"{fake}:{c.env['PATH']}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "tc.pid").exists() or not (tmp_path / "tc.pid").read_text():
            assert tool.poll() is None and time.monotonic() < deadline, tool.communicate()[0]
            time.sleep(0.05)
        tool.kill()
        tool.communicate(timeout=10)
        os.kill(int((tmp_path / "tc.pid").read_text()), signal.SIGKILL)
        yield c
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait(10)
        c.cli("down", timeout=60)
        assert not c.leftovers()


@pytest.mark.timeout(90)
def test_after_up_is_killed_mid_creation_status_and_run_say_so_and_up_starts_clean(crashed_up):
    cluster = crashed_up
    assert sorted(cluster.leftovers()) == ["tlv-br", "tlv-h0", "tlv-h1", "tlv-v0", "tlv-v1"]
    status = check_ok(cluster.cli("status", timeout=30))
    assert "Traceback" not in status.stderr and len(status.stdout.strip().splitlines()) == 1
    assert "tlv- is not ready" in status.stdout and "ended before it was made" in status.stdout
    assert "down --prefix tlv-" in status.stdout
    refused(cluster.cli("run", "--", "tests/cluster/job.py", "exit", 0, timeout=30),
            "tlv- is not ready", "ended before it was made")
    again = check_ok(cluster.cli("up", "--nodes", 2, timeout=60))
    removed = again.stderr.split("removed stale ", 1)[1].splitlines()[0].split(", ")
    assert sorted(removed) == ["tlv-br", "tlv-h0", "tlv-h1", "tlv-v0", "tlv-v1"]
    assert cluster.state()["phase"] == "up"
    assert "MISSING" not in check_ok(cluster.cli("status")).stdout
