"""Tiers (b) and (c): real processes under mpiexec (and torchrun)."""
import json
import sys
import time

import pytest

from conftest import BIN, check_ok, mpirun, run, mpi_env

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(420)
@pytest.mark.parametrize("P", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_algorithm_matches_the_reference(P):
    result = check_ok(mpirun(P, ["tests/mpi/collectives_matrix.py"], timeout=400))
    assert f"OK P={P}" in result.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_shm_reduces_window_buffers_in_place(P):
    result = check_ok(mpirun(P, ["tests/mpi/shm_window.py"], timeout=170))
    assert f"OK P={P}" in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,words", [
    ("count", ["ranks disagree", "rank(s) 0, 1 called allreduce(count=10",
               "rank(s) 2 called allreduce(count=12"]),
    ("collective", ["ranks disagree", "rank(s) 1 called broadcast"]),
    ("dtype", ["ranks disagree", "float64", "float32"]),
    ("op", ["ranks disagree", "op=max", "op=sum"]),
    ("bad_input_one_rank", ["invalid input on rank(s) 1"]),
])
def test_mismatched_calls_raise_on_every_rank(case, words):
    result = check_ok(mpirun(3, ["tests/mpi/mismatch.py", case], timeout=100))
    lines = [line for line in result.stdout.splitlines() if "raised" in line]
    assert len(lines) == 3, result.stdout + result.stderr
    for line in lines:
        for w in words:
            assert w in line, line
    assert "read-only" in [ln for ln in lines if ln.startswith("rank 1")][0] or case != "bad_input_one_rank"


@pytest.mark.timeout(60)
def test_matching_calls_pass_the_check():
    result = check_ok(mpirun(3, ["tests/mpi/mismatch.py", "matching"], timeout=50))
    assert result.stdout.count("ok") == 3


@pytest.mark.timeout(90)
@pytest.mark.parametrize("algo", ["ring", pytest.param("tree", marks=pytest.mark.slow),
                                  pytest.param("mpi", marks=pytest.mark.slow)])
def test_a_missing_rank_ends_in_a_timeout_not_a_hang(algo):
    start = time.monotonic()
    result = mpirun(2, ["tests/mpi/hang.py", algo], timeout=80, TOPOLAB_TIMEOUT=3)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "timed out after 3 s waiting for rank 1" in result.stderr
    assert f"{algo} allreduce" in result.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s: the abort did not reach rank 1"


@pytest.mark.timeout(150)
def test_ring_over_torch_distributed_under_torchrun():
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "tests/mpi/torchrun_ring.py"]
    result = run(cmd, 140, mpi_env(OMP_NUM_THREADS=1))
    check_ok(result)
    assert result.stdout.count(" ok, sent ") == 2


@pytest.mark.timeout(240)
def test_benchmark_writes_table_and_records(tmp_path):
    out = tmp_path / "bench.jsonl"
    result = check_ok(mpirun(2, ["-m", "allreduce.bench", "--algos",
                                 "ring,tree,halving_doubling,hierarchical,mpi,torch",
                                 "--ops", "allreduce,reduce_scatter,allgather,broadcast",
                                 "--sizes", "4K,100K", "--iters", "3", "--ranks-per-node", "1",
                                 "--jsonl", out], timeout=220))
    assert "busbw" in result.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6 * 4 * 2
    for r in records:
        for field in ("algo", "op", "bytes", "time_us", "algbw_gbps", "busbw_gbps", "wrong"):
            assert field in r
        assert r["wrong"] == 0, r
        if r["algo"] in ("ring", "tree", "halving_doubling"):
            assert r["sent_bytes"] == r["theory_bytes"], r


@pytest.mark.timeout(60)
def test_benchmark_rejects_unknown_names():
    result = run([sys.executable, "-m", "allreduce.bench", "--algos", "rign"], 50)
    assert result.returncode != 0 and "unknown algorithm 'rign'" in result.stderr
