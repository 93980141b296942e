"""Tier (c): psrv from the command line: the launcher under a real `mpiexec -n 3` (ranks 0, 1
train, rank 2 serves), on loopback and authenticated off it, the benchmark, the standalone
launch on a network address, and the README's multi-host command (with keys) on one host."""
import json
import subprocess
import sys

import pytest

from conftest import MPIEXEC, ROOT


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
@pytest.mark.parametrize("mode,bind_host", [("bsp", "127.0.0.1"), ("ssp", "127.0.0.1"),
                                            ("bsp", "0.0.0.0")])
def test_example_under_mpiexec_one_server_two_workers(mode, bind_host):
    """Off loopback the ranks exchange CURVE public keys by themselves (launch.mpi_roles)."""
    cmd = [MPIEXEC, "-n", "3", sys.executable, "-m", "mpi4py", "-m", "psrv.example",
           "--servers", "1", "--steps", "20", "--consistency", mode, "--staleness", "1", "--timeout", "20",
           "--bind-host", bind_host]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("CURVE, 2 client keys" in run.stderr) == (bind_host == "0.0.0.0"), run.stderr[-3000:]
    (line,) = [l for l in run.stdout.splitlines() if l.startswith("{")]
    result = json.loads(line)
    assert result["losses"][-1] < result["losses"][0] / 10
    if mode == "bsp":      # the server-side SGD reproduces serial SGD on the global batch
        assert result["max_abs_diff_vs_serial"] < 1e-5
        assert set(result["staleness"]) == {"0"}


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_servers_bind_once_the_workers_declare_their_keys():
    """mpi_roles(await_keys=True), as --sync ps / hybrid and ps_roles use it: the shard
    binds after the workers' declare, its receive queue one step's messages of a worker
    (2 x 6 keys + 4 = 16, not the 8 of a shard that knows nothing), and serves a step;
    workers that never declare leave the server a one-line timeout naming rank 0 after
    its keys_timeout (2 s), not a wait for ever; a SIGINT in that wait ends the server
    at once, in one line; a server that cannot bind or start is one line on every rank
    that would wait for it."""
    cmd = [MPIEXEC, "-n", "3", sys.executable, "-m", "mpi4py", "tests/mpi/keys_first.py"]
    
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained" in run.stdout
    assert ("16 messages queued per connection (a worker's step: 16)" in run.stderr), \
        run.stderr[-3000:]
    run = subprocess.run(cmd + ["silent"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "server: rank 2: waited 2 s for the workers' keys from rank 0" in run.stdout, \
        run.stdout + run.stderr[-3000:]
    assert "queued per connection" not in run.stderr
    run = subprocess.run(cmd + ["signalled"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "server: returned" in run.stdout, run.stderr[-3000:]
    assert "SIGINT before the workers declared their keys" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    # a server that cannot bind, or cannot start: one line on every rank, nobody waits
    run = subprocess.run(cmd + ["unbindable"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    for worker in (0, 1):
        assert f"worker {worker}: server rank 2: ZMQError" in run.stdout, \
            run.stdout + run.stderr[-3000:]
    assert "server: shard 0 could not bind: ZMQError" in run.stdout
    run = subprocess.run(cmd + ["unstartable"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1, 2):
        assert f"rank {rank}: shard 0 (rank 2) could not start: ValueError: worker_timeout" \
            in run.stdout, run.stdout + run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_writes_every_kind_with_throughput_and_cpu(tmp_path):
    """psrv.bench, smallest run: one row per kind (torch_rpc at W = S = 1 only), JSON
    Lines as the README says; psrv and raw_zmq on ipc, torch_rpc on TCP."""
    out = tmp_path / "psrv.jsonl"
    cmd = [sys.executable, "-m", "psrv.bench", "--sizes", "64K", "--workers", "1,2",
           "--servers", "1", "--reps", "1", "--jsonl", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=160)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["kind"], r["workers"]) for r in rows] == [
        ("psrv", 1), ("raw_zmq", 1), ("torch_rpc", 1), ("psrv", 2), ("raw_zmq", 2)]
    for r in rows:
        assert (r["bytes"], r["servers"]) == (65536, 1)
        assert r["transport"] == ("tcp" if r["kind"] == "torch_rpc" else "ipc")
        assert r["gbps"] > 0 and r["time_us"] > 0 and len(r["round_us"]) == 1
        assert r["cpu_ms"] > 0            # workers + servers (or echoes), per iteration
        # ZeroMQ's I/O threads: a part of it (in torch's rpc rows, only psrv's heartbeats)
        assert 0 <= r["io_cpu_ms"] < r["cpu_ms"] and (r["io_cpu_ms"] > 0 or r["kind"] == "torch_rpc")
    assert "psrv/this" in run.stdout and "io_ms" in run.stdout


def host_address():
    """This host's address on its main interface (a UDP connect sends nothing)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
        except OSError:
            return None


def make_keys(directory, workers):
    run = subprocess.run([sys.executable, "-m", "psrv.keys", str(directory), "--workers",
                          str(workers)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr


@pytest.mark.timeout(120)
def test_standalone_server_on_a_network_interface(tmp_path):
    """The across-hosts launch, on one host: a server bound to the host's network
    address (not loopback, so with keys) and a worker given --ps, as two unrelated processes."""
    address = host_address()
    if not address or address.startswith("127."):
        pytest.skip("this host has no network interface besides loopback")
    make_keys(tmp_path / "keys", 1)
    log = open(tmp_path / "server.log", "w")      # a file: a pipe nobody reads could fill up
    server = subprocess.Popen([sys.executable, "-m", "psrv.server", "--shard", "0",
                               "--num-shards", "1", "--bind", f"tcp://{address}:0",
                               "--worker-timeout", "20", "--keys", str(tmp_path / "keys")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = server.stdout.readline()
        endpoint = line.split()[-1]
        assert endpoint.startswith(f"tcp://{address}:"), line
        run = subprocess.run([sys.executable, "-m", "psrv.example", "--ps", endpoint,
                              "--worker-id", "0", "--num-workers", "1", "--steps", "20",
                              "--timeout", "20", "--keys", str(tmp_path / "keys")],
                             cwd=ROOT, capture_output=True, text=True, timeout=100)
        assert run.returncode == 0, run.stderr[-3000:] + (tmp_path / "server.log").read_text()
        (result,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        assert result["losses"][-1] < result["losses"][0] / 10
        assert server.wait(30) == 0          # it exits once its worker said BYE
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)
        server.stdout.close()
        log.close()


@pytest.mark.mpi
@pytest.mark.timeout(150)
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_readme_multi_host_command_with_keys(tmp_path):
    """The README's across-hosts launch as written, on this host: keys, two servers on
    0.0.0.0 with --keys, then `mpiexec -f hostfile -n P ... psrv.example --ps A,B --keys`.
    Every rank must be its own worker (rank of size), so BSP on P workers equals serial
    SGD on the global batch; the servers exit once all P said BYE."""
    keys, workers = tmp_path / "keys", 3
    make_keys(keys, workers)
    (tmp_path / "hostfile").write_text(f"localhost:{workers}\n")
    servers, logs = [], []
    try:
        for shard in range(2):
            logs.append(open(tmp_path / f"server{shard}.log", "w"))
            servers.append(subprocess.Popen(
                [sys.executable, "-m", "psrv.server", "--shard", str(shard), "--num-shards", "2",
                 "--bind", "tcp://0.0.0.0:0", "--keys", str(keys), "--worker-timeout", "20"],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=logs[-1], text=True))
        ports = [s.stdout.readline().split(":")[-1].strip() for s in servers]
        ps = ",".join(f"tcp://127.0.0.1:{p}" for p in ports)
        cmd = [MPIEXEC, "-f", str(tmp_path / "hostfile"), "-n", str(workers), sys.executable,
               "-m", "mpi4py", "-m", "psrv.example", "--ps", ps, "--keys", str(keys),
               "--steps", "20", "--timeout", "20"]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        server_logs = "".join((tmp_path / f"server{i}.log").read_text() for i in range(2))
        assert run.returncode == 0, run.stderr[-3000:] + server_logs[-3000:]
        (result,) = [json.loads(l) for l in run.stdout.splitlines() if l.startswith("{")]
        assert result["worker"] == 0
        assert result["max_abs_diff_vs_serial"] < 1e-5       # all 3 ranks, each its own shard
        assert [s.wait(30) for s in servers] == [0, 0]
        assert "CURVE, 3 client keys" in server_logs
    finally:
        for s in servers:
            if s.poll() is None:
                s.kill()
            s.wait(10)
            s.stdout.close()
        for f in logs:
            f.close()
