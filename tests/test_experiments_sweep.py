"""experiments.sweep: bad files rejected with their line before anything runs; real tiny
sweeps that resume, and that record a crashed or timed-out point and go on."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, mpi_env, run

from experiments import shm_segments
from experiments.records import read_jsonl
from experiments.sweep import SweepError, command_line, load_sweep


def write(tmp_path, text, name="s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.timeout(30)
def test_unknown_key_is_rejected_with_its_line(tmp_path):
    path = write(tmp_path, '[sweep]\nname = "x"\n\n[[run]]\ncommand = "allreduce.bench"\n'
                           'world_size = 2\nalgoz = ["ring"]\n')
    with pytest.raises(SweepError, match=r"s\.toml:7: unknown key 'algoz'"):
        load_sweep(path)
    path = write(tmp_path, '[sweep]\nname = "x"\nretries = 3\n')
    with pytest.raises(SweepError, match=r":3: unknown key 'retries' in \[sweep\]"):
        load_sweep(path)
    path = write(tmp_path, '[[run]]\ncommand = "rm -rf"\n')
    with pytest.raises(SweepError, match=r":2: command 'rm -rf' is not one of"):
        load_sweep(path)


@pytest.mark.timeout(30)
def test_impossible_points_are_rejected_with_line_and_reason(tmp_path):
    text = ('[sweep]\nname = "x"\n\n'
            '[[run]]\ncommand = "allreduce.bench"\nworld_size = [4, 3]\n'
            'algos = ["hierarchical"]\nranks_per_node = 2\n\n'                      # line 8
            '[[run]]\ncommand = "strategies.train"\nsync = "ring"\n'
            'world_size = [2, 3]\nglobal_batch = 64\n\n'                   # line 13: world_size
            '[[run]]\ncommand = "allreduce.bench"\nworld_size = 2\nalgos = ["ring", "mpi"]\n'
            'link_latency_us = 50\n\n'                                             # line 20
            '[[run]]\ncommand = "strategies.train"\nsync = "ps"\nworld_size = 3\n'
            'straggler = "5:0.1"\n')                                                # line 26
    with pytest.raises(SweepError) as e:
        load_sweep(write(tmp_path, text))
    lines = str(e.value).splitlines()
    assert len(lines) == 4, lines
    assert ":8: impossible point" in lines[0] and "3 % 2 = 1" in lines[0]
    assert ":13: impossible point" in lines[1] and "64 % dp(3) = 1" in lines[1]
    assert ":20: impossible point" in lines[2] and "drop mpi and torch" in lines[2]
    assert ":26: impossible point" in lines[3] and "is not a rank (world size 3)" in lines[3]
    bad_value = '[[run]]\ncommand = "strategies.train"\nworld_size = 1\nsync = "local"\nlr = -1\n'
    with pytest.raises(SweepError, match=r":5: impossible point .*--lr must be > 0"):
        load_sweep(write(tmp_path, bad_value))


@pytest.mark.timeout(60)
def test_cli_rejects_before_running_anything(tmp_path):
    path = write(tmp_path, '[[run]]\ncommand = "allreduce.bench"\nworld_size = 2\nsizes = 4\n'
                           'bogus = 1\n')
    out = tmp_path / "out"
    result = run([sys.executable, "-m", "experiments.sweep", path, "--out", str(out)], 60)
    assert result.returncode == 2
    assert "s.toml:5: unknown key 'bogus'" in result.stderr
    assert not out.exists()


@pytest.mark.timeout(10)
def test_axes_expand_and_command_lines():
    settings, points = load_sweep(os.path.join(ROOT, "experiments", "demo.toml"))
    assert settings["name"] == "demo"
    commands = [c for c, *_ in points]
    assert commands.count("allreduce.bench") == 5 and commands.count("strategies.train") == 17
    params = {"world_size": 3, "sync": "ps", "overlap": False, "progress": True,
              "straggler": "1:0.02", "steps": 5}
    argv = command_line("strategies.train", params, "/tmp/r.jsonl")
    assert argv[1:3] == ["-n", "3"]
    i = argv.index("strategies.train")
    assert argv[i - 1] == "-m" and "--straggler" in argv
    assert argv[argv.index("--straggler") + 1] == "1:0.02"
    assert "--no-overlap" in argv and "--steps" in argv and "--progress" not in argv
    assert argv[-3:] == ["--no-progress", "--jsonl", "/tmp/r.jsonl"]


TINY = """
[sweep]
name = "tiny"
timeout_s = 90

[[run]]
command = "allreduce.bench"
world_size = [1, 2]
algos = ["ring", "mpi"]
sizes = ["4K"]
iters = 2
warmup = 1

[[run]]
command = "psrv.bench"
label = "crashes: psrv.bench refuses a size that is not whole float32s"
sizes = ["3"]

[[run]]
command = "allreduce.bench"
label = "times out on purpose"
timeout_s = 0.2
world_size = 2
algos = ["ring"]
sizes = ["8K"]
"""


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_sweep_records_failures_goes_on_and_resumes(tmp_path):
    path, out = write(tmp_path, TINY), tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.sweep", path, "--out", str(out)]
    segments = shm_segments.snapshot()
    first = run(cmd, 120, mpi_env())
    assert first.returncode == 1, first.stderr         # points failed: the sweep says so
    # no MPICH segment outlives the points (run_point removes what a killed job left)
    assert shm_segments.snapshot() <= segments, shm_segments.snapshot() - segments
    assert "2 of 4 points failed or timed out" in first.stderr
    status = {(s["label"], s["config"].get("world_size")): s
              for s in read_jsonl(out / "points.jsonl")}
    assert status[("", 1)]["status"] == "ok" and status[("", 2)]["status"] == "ok"
    crashed = status[("crashes: psrv.bench refuses a size that is not whole float32s", None)]
    assert crashed["status"] == "failed" and crashed["returncode"] != 0
    assert "multiples of 4" in open(crashed["log"]).read()
    slow = status[("times out on purpose", 2)]
    assert slow["status"] == "timeout" and "killed after" in open(slow["log"]).read()
    assert "4 points, 2 failed" in first.stdout

    records = read_jsonl(out / "records.jsonl")
    assert {r["world_size"] for r in records} == {1, 2} and all(r["wrong"] == 0 for r in records)
    for r in records:
        prov = r["provenance"]
        assert prov["mpi"] and prov["torch"] and prov["host"] and "loadavg" in prov
        assert len(prov["commit"] or "0" * 40) == 40
        assert r["config"]["algos"] == ["ring", "mpi"] and r["point"] and r["sweep"] == "tiny"

    second = run(cmd, 120, mpi_env())
    assert second.returncode == 1                      # the failed points ran again, failed again
    assert second.stdout.count("done before, skipped") == 2
    assert len(read_jsonl(out / "records.jsonl")) == len(records)     # nothing measured twice
    assert json.loads(open(out / "points.jsonl").readline())["status"] == "ok"


SLEEPER = """
[sweep]
name = "sleeper"
timeout_s = 120

[[run]]
command = "strategies.train"
label = "sleeps 30 s a step"
world_size = 1
sync = "local"
steps = 2
straggler = "0:30"
"""


def alive_with(marker):
    """Pids of the live processes (zombies are dead) whose command line holds `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.mark.mpi
@pytest.mark.timeout(150)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stopping_signal_kills_the_running_point_and_exits_non_zero(tmp_path, signum):
    path, out = write(tmp_path, SLEEPER), tmp_path / "out"
    marker = str(out / "raw")                       # in the point's --jsonl: its processes only
    sweep = subprocess.Popen([sys.executable, "-m", "experiments.sweep", path, "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=mpi_env(), cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not any("strategies.train" in open(f"/proc/{p}/cmdline").read()
                      for p in alive_with(marker) if os.path.exists(f"/proc/{p}")):
            assert sweep.poll() is None, sweep.communicate()
            assert time.monotonic() < deadline, "the point never started"
            time.sleep(0.2)
        point = alive_with(marker)                  # mpiexec, its proxy and the rank
        sweep.send_signal(signum)                   # to the driver alone, as `kill PID` does
        _, err = sweep.communicate(timeout=30)
        deadline = time.monotonic() + 5             # SIGKILL is prompt; allow for the scheduler
        while (left := [p for p in point if p in alive_with(marker)]) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
        for pid in alive_with(marker):              # whatever the driver left: clean up
            os.kill(pid, signal.SIGKILL)
    assert point, "no process of the point was seen"
    assert not left, f"orphaned point processes {left} of {point}"
    assert sweep.returncode == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name}" in err
    statuses = read_jsonl(out / "points.jsonl")
    assert statuses == []                           # not recorded: the next run runs it
