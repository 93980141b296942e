"""experiments.sweep's launchers (experiments/launchers.py): the new keys checked with
their line before anything runs; one tiny point each on a hostfile of localhost, on
an emulated cluster of 2 hosts (root: network namespaces) and under Slurm (when
slurmctld and slurmd can run here); --dry-run shows each point's command line."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import check_ok, mpi_env, run

from experiments.launchers import ClusterPlace, leftovers
from experiments.records import read_jsonl
from experiments.sweep import SweepError, command_line, load_sweep, point_id

BENCH = '[[run]]\ncommand = "allreduce.bench"\nalgos = ["ring"]\nsizes = ["4K"]\n' \
        'iters = 1\nwarmup = 0\n'
# The emulated cluster of these tests: a prefix, subnet and state directory of its own,
# so a cluster someone else brought up is never touched.
PREFIX, SUBNET = "tx-", "10.77.131.0/24"


def write(tmp_path, text, name="s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# (file text, the line and reason the rejection must name)
BAD = {
    "unknown launcher": ('[sweep]\nlauncher = "ssh"\n' + BENCH, ":2: launcher 'ssh' is not one"),
    "launcher is a number": ('[[run]]\ncommand = "allreduce.bench"\nlauncher = 3\n',
                             ":3: launcher must be a string, got 3"),
    "hostfile missing": ('[[run]]\ncommand = "allreduce.bench"\nworld_size = 2\n'
                         'launcher = "hostfile:nowhere"\n', ":4: launcher 'hostfile:nowhere': no"),
    "cluster key unknown": ('[sweep]\ncluster = {nodes = 2, gbps = 1}\n' + BENCH,
                            ":2: unknown key 'gbps' in cluster"),
    "cluster without nodes": ('[[run]]\ncommand = "allreduce.bench"\ncluster = {inter_gbps = 1}\n',
                              ":3: cluster {'inter_gbps': 1} needs nodes"),
    "nodes is text": ('[[run]]\ncommand = "allreduce.bench"\n\ncluster = [{nodes = 2}, '
                      '{nodes = "4"}]\n', ":4: cluster nodes must be a whole number >= 1"),
    "no bandwidth": ('[[run]]\ncommand = "allreduce.bench"\ncluster = {nodes = 2, '
                     'inter_gbps = 0}\n', ":3: cluster inter_gbps must be a number > 0"),
    "world size disagrees": ('[sweep]\ncluster = {nodes = 2, ranks_per_node = 2}\n\n[[run]]\n'
                             'command = "allreduce.bench"\nworld_size = [4, 3]\n',
                             ":6: impossible point (world_size=3, cluster=2 hosts x 2 ranks, "
                             "1 Gbit/s): world_size 3 disagrees with the cluster: nodes(2) x "
                             "ranks_per_node(2) = 4"),
    "psrv on a cluster": ('[sweep]\nlauncher = "slurm"\n\n[[run]]\ncommand = "psrv.bench"\n',
                          ":2: impossible point: psrv.bench starts its own processes"),
    "cluster on this host": ('[[run]]\ncommand = "allreduce.bench"\nlauncher = "local"\n'
                             'cluster = {nodes = 2}\n', ":4: impossible point (cluster=2 hosts"),
    "emulated without a cluster": ('[[run]]\ncommand = "strategies.train"\nsync = "ring"\n'
                                   'world_size = 2\nlauncher = "emulated"\n',
                                   ":5: impossible point (sync=ring, world_size=2): launcher = "
                                   "\"emulated\" needs a cluster"),
    "two emulations": ('[[run]]\ncommand = "allreduce.bench"\nalgos = ["ring"]\n'
                       'cluster = {nodes = 2}\nlink_gbps = 1\n',
                       ":5: impossible point (link_gbps=1, cluster=2 hosts x 1 rank, 1 Gbit/s, "
                       "world_size=2): the emulated cluster shapes its own links"),
    "calibrate on one host": ('[[run]]\ncommand = "experiments.calibrate"\n'
                              'cluster = {nodes = 1, ranks_per_node = 2}\n',
                              ":3: impossible point (cluster=1 host x 2 ranks, 1 Gbit/s): "
                              "experiments.calibrate on a cluster measures the link between "
                              "hosts: it needs nodes >= 2"),
    "predict on this host": (BENCH + 'predict = true\n',
                             ":7: impossible point: predict = true reads the calibration of the "
                             "point's cluster"),
    "slurm shapes no link": ('[[run]]\ncommand = "allreduce.bench"\nlauncher = "slurm"\n'
                             'cluster = {nodes = 1, inter_gbps = 10}\n',
                             ":4: under Slurm the links are the machine's"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD))
def test_launch_keys_are_checked_with_their_line(tmp_path, case):
    text, expected = BAD[case]
    with pytest.raises(SweepError) as e:
        load_sweep(write(tmp_path, text))
    assert f"s.toml{expected}" in str(e.value), str(e.value)


@pytest.mark.timeout(30)
def test_a_sweep_wide_problem_is_said_once(tmp_path):
    with pytest.raises(SweepError) as e:
        load_sweep(write(tmp_path, '[sweep]\nlauncher = "ssh"\n' + BENCH + BENCH))
    assert str(e.value).count("launcher 'ssh'") == 1, str(e.value)


@pytest.mark.timeout(30)
def test_a_cluster_axis_is_one_point_per_cluster(tmp_path):
    (tmp_path / "hosts").write_text("localhost:4\n")
    text = ('[sweep]\ncluster = [{nodes = 2, ranks_per_node = 2, inter_gbps = 1}, '
            '{nodes = 4, inter_gbps = 10}]\n\n' + BENCH +
            '\n[[run]]\ncommand = "strategies.train"\nsync = ["ring", "ps"]\nsteps = 2\n'
            'global_batch = 48\n'
            '\n[[run]]\ncommand = "psrv.bench"\nlauncher = "local"\n'
            '\n[[run]]\ncommand = "allreduce.bench"\nworld_size = 2\n'
            'launcher = "hostfile:hosts"\n')
    _, points = load_sweep(write(tmp_path, text))
    launched = [(c, p.get("launcher"), p.get("cluster", {}).get("nodes"), p.get("world_size"))
                for c, p, *_ in points]
    assert launched == [("allreduce.bench", "emulated", n, 4) for n in (2, 4)] \
        + [("strategies.train", "emulated", n, 4) for n in (2, 4)] * 2 \
        + [("psrv.bench", None, None, None),             # a run on this host: no cluster
           ("allreduce.bench", f"hostfile:{tmp_path / 'hosts'}", None, 2)]
    assert points[1][1]["cluster"] == {"nodes": 4, "ranks_per_node": 1, "inter_gbps": 10,
                                       "inter_latency_us": 0.0}
    assert len({point_id(c, p) for c, p, *_ in points}) == len(points)
    # A local point has no launch keys: the ids of older sweeps' points stay as they were.
    _, (local,) = load_sweep(write(tmp_path, BENCH, "local.toml"))
    assert "launcher" not in local[1] and "cluster" not in local[1]


@pytest.mark.timeout(30)
def test_command_lines_of_each_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    params = {"algos": ["ring"], "sizes": ["4K"], "world_size": 4}
    cluster = {"nodes": 2, "ranks_per_node": 2, "inter_gbps": 1, "inter_latency_us": 0.0}
    place = ClusterPlace(PREFIX, SUBNET, str(tmp_path))
    argv = command_line("allreduce.bench", {**params, "launcher": "emulated", "cluster": cluster},
                        "/r.jsonl", place)
    job = argv.index("--")
    assert argv[1:4] == ["-m", "experiments.cluster", "run"]
    assert argv[argv.index("--nodes") + 1] == "2" and argv[argv.index("--prefix") + 1] == PREFIX
    assert argv[job + 1:] == ["allreduce.bench", "--algos", "ring", "--sizes", "4K",
                              "--jsonl", "/r.jsonl"]
    # The cluster's calibration goes beside the results; its bench points read it.
    argv = command_line("experiments.calibrate", {"reps": 5, "verify": [], "world_size": 4,
                                                  "launcher": "emulated", "cluster": cluster},
                        "/res/raw/c.jsonl", place)
    job = argv.index("--")
    assert argv[job + 1:] == ["experiments.calibrate", "--jsonl", "/res/raw/c.jsonl", "--reps",
                              "5", "--verify", "", "--out", "/res/calibration/2x2-1gbit-0us"]
    argv = command_line("allreduce.bench", {**params, "predict": True, "launcher": "emulated",
                                            "cluster": cluster}, "/res/raw/b.jsonl", place)
    assert argv[argv.index("--predict") + 1] == "/res/calibration/2x2-1gbit-0us"
    argv = command_line("allreduce.bench", {**params, "launcher": "hostfile:/h"}, "/r.jsonl")
    assert argv[1:5] == ["-f", "/h", "-n", "4"] and argv[5:9] == [sys.executable, "-m",
                                                                 "mpi4py", "-m"]
    slurm = {**params, "launcher": "slurm", "cluster": {"nodes": 2, "ranks_per_node": 2}}
    argv = command_line("allreduce.bench", slurm, "/r.jsonl")
    assert argv[:3] == ["salloc", "-n", "4"]                  # outside an allocation
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    argv = command_line("allreduce.bench", slurm, "/r.jsonl")
    assert argv[:8] == ["srun", "-n", "4", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmi2"]


@pytest.mark.timeout(30)
def test_dry_run_prints_the_slurm_command_line(tmp_path):
    path = write(tmp_path, '[sweep]\nlauncher = "slurm"\n' + BENCH.replace("iters", "world_size"
                                                                          " = 3\niters"))
    env = mpi_env()
    env.pop("SLURM_JOB_ID", None)
    result = check_ok(run([sys.executable, "-m", "experiments.sweep", path, "--dry-run",
                           "--out", str(tmp_path / "out")], 25, env))
    line = result.stdout.splitlines()[1].strip()
    raw = tmp_path / "out" / "raw"
    assert line.startswith(f"$ salloc -n 3 srun -n 3 --mpi=pmi2 --kill-on-bad-exit=1 "
                           f"{sys.executable} -m mpi4py -m allreduce.bench --algos ring "), line
    assert f"--jsonl {raw}/" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(30)
def test_what_a_launcher_lacks_stops_the_sweep_before_its_first_point(tmp_path, monkeypatch):
    from experiments.launchers import needs
    _, points = load_sweep(write(tmp_path, '[sweep]\nlauncher = "slurm"\n' + BENCH))
    monkeypatch.setenv("PATH", str(tmp_path))                 # no srun, no salloc
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert needs(points) == ['launcher "slurm": srun, salloc not on PATH (Slurm\'s client '
                             'commands)']
    _, points = load_sweep(write(tmp_path, '[sweep]\ncluster = {nodes = 2}\n' + BENCH))
    (problem,) = needs(points, ClusterPlace("TX", SUBNET))
    assert "prefix 'TX' must be 1-5 lowercase letters" in problem


def sweep(tmp_path, text, timeout=60, **env):
    out = tmp_path / "out"
    result = run([sys.executable, "-m", "experiments.sweep", write(tmp_path, text), "--out",
                  str(out), "--cluster-prefix", PREFIX, "--cluster-subnet", SUBNET],
                 timeout, mpi_env(**env))
    return result, read_jsonl(out / "records.jsonl"), read_jsonl(out / "points.jsonl")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_hostfile_of_localhost_runs_a_point(tmp_path):
    (tmp_path / "hosts").write_text("localhost:4\n")
    result, records, points = sweep(tmp_path, '[sweep]\nlauncher = "hostfile:hosts"\n\n' +
                                    BENCH + 'world_size = 2\n')
    check_ok(result)
    assert points[0]["argv"][1:3] == ["-f", str(tmp_path / "hosts")]
    (r,) = records
    assert r["world_size"] == 2 and r["wrong"] == 0
    assert r["config"]["launcher"] == f"hostfile:{tmp_path / 'hosts'}"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_emulated_point_records_the_bytes_on_each_hosts_link(tmp_path, namespaces):
    place = ClusterPlace(PREFIX, SUBNET, str(tmp_path / "cluster"))
    slow = ('\n[[run]]\ncommand = "allreduce.bench"\nlabel = "times out"\ntimeout_s = 4\n'
            'cluster = {nodes = 2, inter_gbps = 0.05}\nsizes = ["64M"]\n')
    result, records, points = sweep(
        tmp_path, '[sweep]\ncluster = {nodes = 2, inter_gbps = 2}\n\n' + BENCH + slow, 80,
        TOPOLAB_CLUSTER_DIR=place.run_dir)
    assert result.returncode == 1, result.stderr                # the slow point timed out
    assert not leftovers(place) and not os.path.exists(place.run_dir)
    point, timed_out = points
    assert point["status"] == "ok" and timed_out["status"] == "timeout"
    # SIGTERM first: the cluster tool ended its job and removed its hosts itself
    assert "cluster torn down" in open(timed_out["log"]).read()
    bench = [r for r in records if r.get("kind") != "wire"]
    wire = [r for r in records if r.get("kind") == "wire"]
    assert len(bench) == 1 and bench[0]["world_size"] == 2 and bench[0]["wrong"] == 0
    assert sorted(r["host"] for r in wire) == [f"{PREFIX}h0", f"{PREFIX}h1"]
    for r in wire:
        assert r["point"] == point["point"] and r["config"]["cluster"]["nodes"] == 2
        # a checked and a timed all-reduce of 4 KiB on a 2-rank ring: 4 KiB a host each
        assert r["theory_tx_bytes"] == 2 * 4096
        assert 2 * 4096 <= r["tx_payload_bytes"] < 2 * 4096 + 64 * 1024, r   # + MPI's, hydra's


SLURM_CONF = """ClusterName=topolab
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmUser=root
SlurmdUser=root
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld and slurmd on this machine (one node, no munge: auth/none), with a
    slurm.conf of their own; yields the environment that points srun at them.  Skips,
    with the daemons' own words, where they cannot run."""
    missing = [t for t in ("slurmctld", "slurmd", "srun", "salloc", "sinfo")
               if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing; Debian: "
                    f"apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs as root (it starts jobs as their users)")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), d=d, ctld_port=free_port(),
                                      d_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    env.pop("SLURM_JOB_ID", None)
    daemons = [subprocess.Popen([daemon, "-D"], env=env, stdout=subprocess.DEVNULL,
                                stderr=open(d / f"{daemon}.err", "w"), start_new_session=True)
               for daemon in ("slurmctld", "slurmd")]
    try:
        deadline, state = time.monotonic() + 20, ""
        while state not in ("idle", "mixed", "allocated"):
            if time.monotonic() > deadline or any(p.poll() is not None for p in daemons):
                said = " | ".join((d / f"{n}.err").read_text().strip().splitlines()[-1:][0]
                                  for n in ("slurmctld", "slurmd")
                                  if (d / f"{n}.err").read_text().strip())
                pytest.skip(f"slurmctld + slurmd did not bring a node up within 20 s "
                            f"(sinfo: {state or 'nothing'}; {said})")
            time.sleep(0.5)
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                   env=env, timeout=10).stdout.strip()
        yield {"SLURM_CONF": str(conf)}
    finally:
        for p in daemons:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in daemons:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_slurm_runs_a_point_through_pmi(tmp_path, slurm):
    result, records, points = sweep(tmp_path, '[sweep]\nlauncher = "slurm"\n\n' + BENCH +
                                    'world_size = 2\n', 80, **slurm)
    check_ok(result)
    assert points[0]["argv"][:3] == ["salloc", "-n", "2"]
    (r,) = records
    # two ranks of one MPI job, not two jobs of one rank: srun's PMI-2 joined them
    assert r["world_size"] == 2 and r["wrong"] == 0 and r["config"]["launcher"] == "slurm"


@pytest.mark.timeout(30)
def test_the_report_draws_each_cluster_and_its_link_bytes(tmp_path):
    import json

    from experiments import cluster_figures as cf
    from experiments.report import write_report as report
    cluster = {"nodes": 2, "ranks_per_node": 2, "inter_gbps": 1, "inter_latency_us": 0.0}
    config = {"launcher": "emulated", "cluster": cluster, "world_size": 4, "algos": ["ring"],
              "sizes": ["4K", "1M"]}
    common = {"command": "allreduce.bench", "point": "p1", "config": config}
    records = [{**common, "algo": "ring", "op": "allreduce", "bytes": n, "world_size": 4,
                "dtype": "float32", "time_us": t, "busbw_gbps": 1.5 * n / t / 1e3,
                "predicted_us": 0.9 * t} for n, t in ((4096, 100.0), (1 << 20, 9000.0))]
    records += [{**common, "kind": "wire", "host": f"tx-h{i}", "tx_payload_bytes": 1010,
                 "theory_tx_bytes": 1000.0} for i in range(2)]
    records.append({**records[0], "config": {"world_size": 4}, "point": "here"})   # local
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (setting,) = cf.cluster_settings(records)
    assert cf.setting_name(setting) == "2 hosts x 2 ranks, 1 Gbit/s"
    head, rows = cf.wire_table(records)
    assert rows == [("2 hosts x 2 ranks, 1 Gbit/s", "bench ring, 4K..1M", 2, "0.00", "0.00",
                     "1.010..1.010")]
    assert cf.predicted_table(records)[1][0][-1] == "-10%"
    alltoall = [{**records[0], "op": "alltoall", "predicted_us": 50.0}]
    assert cf.predicted_table(alltoall) is None        # the table is the all-reduce's
    written = report([str(tmp_path)])
    assert any(p.endswith("busbw_cluster_2x2_1gbps.png") for p in written)
    drawn = json.load(open(tmp_path / "plots" / "busbw_cluster_2x2_1gbps.json"))[0]
    assert [line["label"] for line in drawn["lines"]] == ["ring", "ring predicted",
                                                           "host link 1 Gbit/s"]
    text = (tmp_path / "report.md").read_text()
    assert "## Points on a cluster" in text and "| 1.010..1.010 |" in text
