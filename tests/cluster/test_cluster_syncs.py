"""Tier (d): torch, ps and hybrid training, and standalone parameter servers, across
3 emulated hosts x 2 ranks (one cluster for the module; see conftest.py).

With --servers 2 the last two ranks serve, so the servers have host 2 to themselves
and every push and pull crosses a link: ps has 4 workers on hosts 0 and 1, hybrid
two nodes of 2 workers whose leaders talk to the servers.  Off loopback the servers
are CURVE servers (keys made and exchanged by the ranks under mpiexec, or made by
`python -m psrv.keys` for standalone servers).  Training must reproduce one process
(`--sync local`) within test_train_runs.py's tolerance.
"""
import concurrent.futures
import json
import re
import select
import subprocess
import sys

import numpy as np
import pytest

from experiments.cluster.net import Layout
from psrv.keys import load_worker_keys
from psrv.server import receive_hwm

from conftest import ROOT, check_ok, mpi_env, mpirun, run
from test_train_runs import TINY, assert_same_run, read_records

from .conftest import Cluster

PREFIX, SUBNET = "tls-", "10.77.12.0/24"
NODES, PER_NODE, SERVERS = 3, 2, 2
SERVER_HOST = f"{PREFIX}h{NODES - 1}"
WORKERS = (NODES - 1) * PER_NODE
SYNCS = {"torch": [], "ps": ["--servers", SERVERS], "hybrid": ["--servers", SERVERS]}
JOB = "tests/mpi/cluster_syncs_job.py"


@pytest.fixture(scope="module")
def hosts(namespaces, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"), PREFIX, SUBNET)
    try:
        check_ok(c.cli("up", "--nodes", NODES, "--ranks-per-node", PER_NODE, "--inter-gbps", 2))
        yield c
    finally:
        check_ok(c.cli("down"))
        assert not c.leftovers()


@pytest.fixture(scope="module")
def trained(hosts, tmp_path_factory):
    """Every sync of SYNCS in one launch across the hosts and, meanwhile, the one-process
    reference; returns ({name: (records, params)}, the launch's stderr)."""
    out = tmp_path_factory.mktemp("runs")

    def argv(name, extra):
        return [str(a) for a in TINY + ["--steps", 3, "--sync", name, *extra,
                                        "--jsonl", out / f"{name}.jsonl",
                                        "--params-out", out / f"{name}.npz"]]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        local = pool.submit(mpirun, 1, ["-m", "strategies.train"] + argv("local", []))
        job = hosts.job(JOB, "train", json.dumps([argv(s, x) for s, x in SYNCS.items()]),
                        timeout=150)
        check_ok(local.result(timeout=150))
    return ({name: (read_records(out / f"{name}.jsonl"), dict(np.load(out / f"{name}.npz")))
             for name in ["local", *SYNCS]}, job.stderr)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sync", list(SYNCS))
def test_training_across_hosts_reproduces_one_process(trained, sync):
    runs, _ = trained
    assert_same_run(runs[sync], runs["local"], PER_NODE * NODES if sync == "torch" else WORKERS)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_servers_host_serves_off_loopback_with_curve(trained):
    # each server rank's psrv log, in its order: ps (4 workers), then hybrid (2 leaders)
    _, stderr = trained
    for shard, rank in enumerate(range(WORKERS, WORKERS + SERVERS)):
        mine = [line.split(" INFO ", 1)[1] for line in stderr.splitlines()
                if line.startswith(f"{SERVER_HOST} rank {rank} psrv.server INFO")]
        # --sync ps/hybrid bind their shards once the workers declared their buckets:
        # a queue of one step's messages of a worker (2 x the shard's keys + 4)
        listening = (f"shard {shard} on tcp://0\\.0\\.0\\.0:\\d+: CURVE, {WORKERS} client keys; "
                     f"(\\d+) messages queued per connection \\(a worker's step: (\\d+)\\)")
        expected = [listening, f"shard {shard} done: workers closed \\[0, 1, 2, 3\\], dead \\[\\]",
                    listening, f"shard {shard} done: workers closed \\[0, 1\\], dead \\[\\]"]
        assert len(mine) == len(expected), stderr[-3000:]
        for line, pattern in zip(mine, expected):
            match = re.fullmatch(pattern, line)
            assert match, (line, pattern)
            if pattern is listening:
                queued, step = map(int, match.groups())
                assert queued == receive_hwm(step), line


def keys(where, workers):
    return check_ok(run([sys.executable, "-m", "psrv.keys", where, "--workers", str(workers)],
                        30))


def on_host(host, *args, **popen):
    """`python ARGS` inside host's network namespace (its address, not its hostname)."""
    return subprocess.Popen(["ip", "netns", "exec", host, sys.executable, *map(str, args)],
                            env=mpi_env(), cwd=ROOT, text=True, **popen)


@pytest.mark.timeout(120)
def test_standalone_servers_across_hosts_admit_only_their_workers_keys(hosts, tmp_path):
    state = hosts.state()
    address = Layout(state["nodes"], state["prefix"], state["subnet"]).address(NODES - 1)
    keydir, stranger = str(tmp_path / "keys"), str(tmp_path / "stranger")
    keys(keydir, WORKERS)
    keys(stranger, 1)                         # a keypair the server does not know, and
    with open(f"{keydir}/server.key") as src, open(f"{stranger}/server.key", "w") as dst:
        dst.write(src.read())                 # ... the right server key to connect with
    log = open(tmp_path / "server.log", "w+")
    server = on_host(SERVER_HOST, "-m", "psrv.server", "--bind", f"tcp://{address}:0",
                     "--keys", keydir, stdout=subprocess.PIPE, stderr=log)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 30)
        line = server.stdout.readline() if ready else ""
        assert "listening on" in line, open(log.name).read()
        endpoint = line.split()[-1]
        worker = ["-m", "psrv.example", "--ps", endpoint, "--worker-id", 0,
                  "--num-workers", WORKERS, "--steps", 3]
        # a refused key is reported at once, whatever the timeout; no key before connecting
        refused = [on_host(f"{PREFIX}h0", *worker, *extra, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
                   for extra in (["--keys", stranger, "--timeout", 20], ["--timeout", 1])]
        wrong_key, no_key = (p.communicate(timeout=30)[0] for p in refused)
        assert refused[0].returncode and "refused the CURVE handshake: handshake_failed_auth " \
            "(status 400): is this worker's public key in the server's key set" in wrong_key
        # without keys the client refuses to talk in clear to a server off loopback
        assert refused[1].returncode and "off loopback: pass keys" in no_key, no_key
        # the workers on hosts 0 and 1; BSP must reproduce the serial run
        out = hosts.job(JOB, "psrv-workers", SERVER_HOST, "--ps", endpoint, "--keys", keydir,
                        "--steps", 10, timeout=90).stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        assert result["worker"] == 0 and len(result["losses"]) == 10
        assert result["max_abs_diff_vs_serial"] < 1e-5
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)
        server.stdout.close()
    text = open(log.name).read()
    assert f"shard 0 on {endpoint}: CURVE, {WORKERS} client keys" in text
    public = load_worker_keys(stranger, 0).public.decode()
    assert f"client key {public} is not in the key set" in text                  # wrong key
    assert f"done: workers closed {list(range(WORKERS))}, dead []" in text
