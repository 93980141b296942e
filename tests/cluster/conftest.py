"""Tier (d): jobs across an emulated cluster (experiments.cluster): each host a network
namespace on this machine, its link shaped by tc, ranks started by mpiexec on every host.

Needs a process that may create network namespaces (root: CI runs as root); the
tests that need one are skipped, with the reason, elsewhere.  Every cluster here
has a prefix and subnet of its own and a run directory under tmp_path, so a
cluster someone brought up by hand is never touched, and each is torn down after.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import check_ok, mpi_env, run


def alive(pid):
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Cluster:
    """The command line of one cluster: `cli(...)` runs `python -m experiments.cluster`
    with this cluster's run directory, prefix and subnet."""

    def __init__(self, run_dir, prefix, subnet):
        self.run_dir, self.prefix, self.subnet = str(run_dir), prefix, subnet
        self.env = mpi_env(TOPOLAB_CLUSTER_DIR=self.run_dir)

    def command(self, subcommand, *args):
        where = ["--prefix", self.prefix] + (["--subnet", self.subnet]
                                             if subcommand in ("up", "run") else [])
        return [sys.executable, "-m", "experiments.cluster", subcommand, *where, *map(str, args)]

    def cli(self, subcommand, *args, timeout=120):
        return run(self.command(subcommand, *args), timeout, env=self.env)

    def job(self, *job, timeout=120):
        """Run a job on the cluster that is up; fails the test unless it exits 0."""
        return check_ok(self.cli("run", "--", *job, timeout=timeout))

    def state(self):
        with open(os.path.join(self.run_dir, self.prefix, "state.json")) as f:
            return json.load(f)

    def leftovers(self):
        """Namespaces and links with this cluster's prefix."""
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                    timeout=30).stdout.split()
        links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True,
                                          text=True, timeout=30).stdout)
        return [n for n in namespaces if n.startswith(self.prefix)] + \
            [link["ifname"] for link in links if link["ifname"].startswith(self.prefix)]


@pytest.fixture(scope="module")
def cluster(namespaces, tmp_path_factory):
    """2 hosts x 2 ranks at 2 Gbit/s, up for a whole test module."""
    c = Cluster(tmp_path_factory.mktemp("cluster"), "tlt-", "10.77.9.0/24")
    try:
        check_ok(c.cli("up", "--nodes", 2, "--ranks-per-node", 2, "--inter-gbps", 2))
        yield c
    finally:
        check_ok(c.cli("down"))
        assert not c.leftovers()
