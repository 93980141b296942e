"""Tier (c): hostile command lines end at once, exit 2, one line, no traceback.

Each used to give a traceback (--width 3000000: the allocator's 36 TB; a seed past
int64; a torch timeout of 1e300 s; a straggler's sleep), to grow until killed
(--global-batch 10**12: 18 GiB and counting), to spin for ever (allreduce.bench
--min-bytes 0), to crash (--threads 10**8: SIGSEGV), or to measure everything and
then fail (allreduce.bench --jsonl /nonexistent/x).  Each must now be refused
before any work, naming the flag, within 20 s.
"""
import sys
import time

import pytest

from conftest import mpi_env, mpirun, run

LIMIT = 20.0
TRAIN = [sys.executable, "-m", "strategies.train", "--steps", "2", "--no-progress",
         "--threads", "1"]
BENCH = [sys.executable, "-m", "allreduce.bench", "--iters", "2"]

CASES = [
    (TRAIN, ["--width", "3000000"], "--width"),                 # 36 TB of parameters
    (TRAIN, ["--model", "moe", "--experts", "100000000"], "--experts"),
    (TRAIN, ["--global-batch", "1000000000000"], "--global-batch"),
    (TRAIN, ["--dataset-size", "100000000000"], "--dataset-size"),
    (TRAIN, ["--model", "gpt", "--vocab", "100000000"], "--vocab"),
    (TRAIN, ["--in-dim", "100000000"], "--in-dim"),
    (TRAIN, ["--seed", "1180591620717411303424"], "--seed"),
    (TRAIN, ["--steps", "100000000000000000000000"], "--steps"),
    (TRAIN, ["--timeout", "1e300", "--sync", "torch"], "--timeout"),
    (TRAIN, ["--timeout", "nan"], "--timeout"),
    (TRAIN, ["--lr", "inf"], "--lr"),
    (TRAIN, ["--straggler", "0:1e300"], "--straggler"),
    (TRAIN, ["--link-gbps", "1e-300", "--sync", "ring"], "--link-gbps"),
    (TRAIN, ["--threads", "100000000"], "--threads"),
    (TRAIN, ["--jsonl", "/nonexistent/x"], "--jsonl"),
    (BENCH, ["--jsonl", "/nonexistent/x"], "--jsonl"),
    (BENCH, ["--min-bytes", "0"], "--min-bytes"),
    (BENCH, ["--iters", "100000000000000000000000"], "--iters"),
    (BENCH, ["--link-latency-us", "nan", "--algos", "ring"], "--link-latency-us"),
    (BENCH, ["--link-gbps", "-1", "--algos", "ring"], "--link-gbps"),
    (BENCH, ["--sizes", "1T"], "1T"),
]


def assert_one_line(result, flag, ranks=1):
    err = result.stderr
    assert result.returncode == 2, f"exit {result.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) >= 1 and all(flag in line for line in lines[:ranks]), err[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tool,argv,flag", CASES,
                         ids=[f"{t[2]}{' '.join(a)[:40]}" for t, a, _ in CASES])
def test_a_hostile_flag_is_refused_at_once(tool, argv, flag):
    started = time.monotonic()
    result = run([*tool, *argv], timeout=90, env=mpi_env())
    assert_one_line(result, flag)
    assert time.monotonic() - started < LIMIT, time.monotonic() - started


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tool,argv,flag", [
    ("strategies.train", ["--sync", "ring", "--width", "3000000"], "--width"),
    ("allreduce.bench", ["--jsonl", "/nonexistent/x"], "--jsonl")], ids=["train", "bench"])
def test_every_rank_refuses(tool, argv, flag):
    """Under mpiexec: exit 2 and no rank left waiting (the trainer's every rank says it)."""
    started = time.monotonic()
    result = mpirun(2, ["-m", tool, "--no-progress" if tool == "strategies.train" else
                        "--iters=2", *argv], timeout=90)
    assert_one_line(result, flag, ranks=2 if tool == "strategies.train" else 1)
    assert time.monotonic() - started < LIMIT
