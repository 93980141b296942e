"""Tier (d): collectives and training across 2 emulated hosts x 2 ranks (one cluster
for the module; see conftest.py).  Ranks on one host share memory; ranks on two
hosts talk TCP over a link shaped to 2 Gbit/s."""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import check_ok, mpirun
from test_train_runs import TINY, assert_same_run, read_records

ALGOS = "ring,tree,halving_doubling,hierarchical,mpi,torch"
OPS = "allreduce,reduce_scatter,allgather,broadcast"


def records(path, kind=None):
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if r.get("kind") == kind]


@pytest.mark.timeout(120)
def test_every_algorithm_matches_the_reference_across_hosts(cluster, tmp_path):
    # allreduce.bench checks every result against a reference each rank computes from
    # rank- and position-dependent inputs; 4 bytes (one element) and an odd length.
    out = tmp_path / "bench.jsonl"
    cluster.job("allreduce.bench", "--algos", ALGOS, "--ops", OPS, "--sizes", "4,400012",
                "--iters", 1, "--warmup", 0, "--jsonl", out)
    rows = records(out)
    assert len(rows) == 6 * 4 * 2
    wrong = [(r["algo"], r["op"], r["bytes"], r["wrong"]) for r in rows if r["wrong"]]
    assert not wrong
    assert {r["host"] for r in records(out, "wire")} == {"tlt-h0", "tlt-h1"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["ring", "hierarchical"])
def test_bytes_on_each_host_link_match_theory(cluster, tmp_path, algo):
    # Hierarchical finds its nodes from MPI (shared memory = same host): had it
    # taken all 4 ranks for one node, or each rank for a node of its own, its
    # bytes across the links would be 0 or 1.5 n a host, not n.
    out = tmp_path / "wire.jsonl"
    cluster.job("allreduce.bench", "--algos", algo, "--sizes", "4M", "--iters", 2,
                "--warmup", 0, "--jsonl", out)
    wire = records(out, "wire")
    assert len(wire) == 2
    for r in wire:
        # 3 all-reduces (the checked call + 2 timed): ring 1.5 n, hierarchical n a host
        assert r["theory_tx_bytes"] == 3 * (1.5 if algo == "ring" else 1.0) * (4 << 20)
        # what remains after the TCP/IP headers: the job's bytes and MPI's own, within 5%
        assert r["theory_tx_bytes"] <= r["tx_payload_bytes"] <= 1.05 * r["theory_tx_bytes"], r
        assert r["tx_bytes"] > r["tx_payload_bytes"]
        assert r["latency_by"] == "none" and r["inter_gbps"] == 2


@pytest.mark.timeout(200)
def test_training_across_hosts_reproduces_one_process(cluster, tmp_path):
    def argv(name, sync):
        return [str(a) for a in TINY + ["--sync", sync, "--jsonl", tmp_path / f"{name}.jsonl",
                                        "--params-out", tmp_path / f"{name}.npz"]]
    check_ok(mpirun(1, ["-m", "strategies.train"] + argv("local", "local"), timeout=120))
    cluster.job("tests/cluster/job.py", "train",
                json.dumps([argv("ring", "ring"), argv("hierarchical", "hierarchical")]),
                timeout=150)

    def load(name):
        return read_records(tmp_path / f"{name}.jsonl"), dict(np.load(tmp_path / f"{name}.npz"))
    for sync in ("ring", "hierarchical"):
        assert_same_run(load(sync), load("local"), 4)


@pytest.mark.timeout(60)
def test_the_tool_exits_with_the_jobs_code(cluster):
    result = cluster.cli("run", "--", "tests/cluster/job.py", "exit", 3, timeout=50)
    assert result.returncode == 3, result.stderr[-2000:]


@pytest.mark.timeout(60)
def test_host_names_resolve_to_their_hosts_addresses(cluster):
    # as on a real cluster: parameter servers advertise tcp://HOSTNAME:PORT
    out = cluster.job("tests/cluster/job.py", "resolve", "tlt-h0,tlt-h1", timeout=50).stdout
    lines = [line for line in out.splitlines() if line.startswith("tlt-h")]
    own = lines[2::3]                 # each rank's own name, ranks 0..3
    assert lines[0::3] == ["tlt-h0 10.77.9.1"] * 4 and lines[1::3] == ["tlt-h1 10.77.9.2"] * 4
    assert own == ["tlt-h0 10.77.9.1"] * 2 + ["tlt-h1 10.77.9.2"] * 2


@pytest.mark.timeout(90)
def test_one_job_at_a_time_and_ctrl_c_leaves_an_up_cluster_up(cluster, tmp_path):
    first = subprocess.Popen(cluster.command("run", "--", "tests/cluster/job.py", "sleep",
                                             tmp_path), env=cluster.env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 4:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.2)
    second = cluster.cli("run", "--", "tests/cluster/job.py", "exit", 0, timeout=50)
    assert second.returncode == 2 and "a job is running on this cluster" in second.stderr
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=30)
    assert first.returncode == 130 and "the cluster stays up" in out
    assert sorted(cluster.leftovers()) == ["tlt-br", "tlt-h0", "tlt-h1", "tlt-v0", "tlt-v1"]
    for host in ("tlt-h0", "tlt-h1"):                                 # the ranks are gone
        assert not subprocess.run(["ip", "netns", "pids", host], capture_output=True,
                                  text=True, timeout=10).stdout.split()
    cluster.job("tests/cluster/job.py", "exit", 0, timeout=50)      # and still works
