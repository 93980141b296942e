"""JSON Lines integrity: a torn last line (a writer killed mid-write) costs that line only,
every tool writes through allreduce.records, and --resume writes each step once."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, mpi_env, run

from allreduce.records import append_jsonl, read_jsonl, rewrite_jsonl, scan_jsonl

TORN = '{"kind": "step", "step": 7, "lo'          # what a kill in the middle of a write leaves


def test_append_after_a_torn_line_starts_on_a_fresh_line(tmp_path, capfd):
    path = str(tmp_path / "r.jsonl")
    append_jsonl(path, [{"i": 0}])
    with open(path, "a") as f:
        f.write(TORN)
    append_jsonl(path, [{"i": 1}, {"i": 2}])
    assert open(path).read().splitlines()[1:] == [TORN, '{"i": 1}', '{"i": 2}']
    records, bad = scan_jsonl(path)
    assert records == [{"i": 0}, {"i": 1}, {"i": 2}] and bad == [2]
    assert read_jsonl(path) == records
    assert "skipped 1 unreadable line(s) (line 2)" in capfd.readouterr().err


def test_reader_edge_cases(tmp_path, capfd):
    path = str(tmp_path / "r.jsonl")
    assert read_jsonl(path) == []                     # no file yet: no records
    append_jsonl(path, [])                            # nothing to write: no file made
    assert not os.path.exists(path)
    with open(path, "w") as f:                        # a blank line, a non-object, a bad byte
        f.write('{"a": 1}\n\n[1, 2]\n\xff\n{"a": 2}\n')
    assert read_jsonl(path, warn=False) == [{"a": 1}, {"a": 2}]
    assert capfd.readouterr().err == ""
    assert scan_jsonl(path)[1] == [3, 4]
    rewrite_jsonl(path, [{"b": 1}])
    assert open(path).read() == '{"b": 1}\n'
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


def test_every_jsonl_writer_goes_through_allreduce_records():
    """No module opens a file and writes json.dumps(...) itself: one home for appending."""
    offenders = []
    for package in ("allreduce", "psrv", "strategies", "experiments"):
        for folder, _, files in os.walk(ROOT / package):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path.endswith(os.path.join("allreduce",
                                                                          "records.py")):
                    continue
                text = open(path).read()
                if re.search(r"\.write\(\s*json\.dumps|writelines\(.*json\.dumps", text):
                    offenders.append(os.path.relpath(path, ROOT))
    assert not offenders, f"write JSON Lines with allreduce.records.append_jsonl: {offenders}"


@pytest.mark.timeout(60)
def test_a_tool_appending_after_a_torn_line_keeps_its_records(tmp_path):
    path = tmp_path / "sim.jsonl"
    path.write_text('{"kind": "earlier"}\n' + TORN)
    cmd = [sys.executable, "-m", "experiments.simulate", "--sizes", "1M", "--jsonl", str(path)]
    result = run(cmd, 50, mpi_env())
    assert result.returncode == 0, result.stderr
    assert path.read_text().splitlines()[1] == TORN   # the first new record is not glued on
    records, bad = scan_jsonl(str(path))
    assert bad == [2]                                 # only the torn line itself is lost
    assert records[0] == {"kind": "earlier"} and len(records) > 2
    assert all(r["kind"] in ("simulation", "crossover") for r in records[1:])


TRAIN = [sys.executable, "-m", "strategies.train", "--sync", "local", "--model", "mlp",
         "--width", "8", "--depth", "1", "--in-dim", "4", "--classes", "3",
         "--dataset-size", "64", "--global-batch", "8", "--threads", "1", "--no-progress"]


def steps_in(path):
    return [r["step"] for r in read_jsonl(path, warn=False) if r.get("kind") == "step"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_resume_after_a_crash_writes_each_step_once(tmp_path):
    """Train with a checkpoint every 3 steps, kill the run after step 4 is recorded (the
    checkpoint holds step 3), tear the last line as a crash mid-write would, resume: the
    file lists steps 0..7 once each, and the resumed steps are those of the checkpoint."""
    jsonl, ckpt = str(tmp_path / "run.jsonl"), tmp_path / "ckpt"
    common = ["--jsonl", jsonl, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    # the straggler sleep makes each step 0.5 s: the kill lands long before checkpoint 6
    proc = subprocess.Popen(TRAIN + common + ["--steps", "30", "--straggler", "0:0.5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
                            env=mpi_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 100
        while not (4 in steps_in(jsonl) and (ckpt / "checkpoint.pt").exists()):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the run never reached step 4"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    before = steps_in(jsonl)
    assert before[:5] == [0, 1, 2, 3, 4] and max(before) < 6, before
    with open(jsonl, "a") as f:
        f.write(TORN)
    result = run(TRAIN + common + ["--steps", "8", "--resume"], 100, mpi_env())
    assert result.returncode == 0, result.stderr
    assert steps_in(jsonl) == list(range(8))          # unique and complete, in order
    configs = [r for r in read_jsonl(jsonl, warn=False) if r["kind"] == "config"]
    assert [c["start_step"] for c in configs] == [0, 3]
    assert open(jsonl).read().endswith("\n") and scan_jsonl(jsonl)[1] == []
