"""Tier (c): the training benchmarks run briefly on two ranks and write what they print.

strategies.bench builds its methods as strategies.train does (DistributedOptimizer's
syncs) beside DDP; strategies.bench_parallel times whole training launches with the
harness's own_clock rounds and sets ZeRO's memory (strategies/runtime/memory.py, fp32 and bf16)
and traffic (allreduce/theory.py) against the formulas.
"""
import pytest

from allreduce.records import read_jsonl
from conftest import check_ok, mpirun

TINY_MLP = ["--model", "mlp", "--width", "32", "--depth", "2", "--in-dim", "16",
            "--classes", "4", "--dataset-size", "64", "--global-batch", "16", "--threads", "1"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_times_every_method_in_the_same_rounds(tmp_path):
    out = tmp_path / "bench.jsonl"
    check_ok(mpirun(2, ["-m", "strategies.bench", "--syncs", "ring,local,ring:fp16,ddp",
                        "--rounds", "2", "--steps-per-round", "1", "--warmup", "1",
                        "--jsonl", str(out)] + TINY_MLP, timeout=100))
    rows = read_jsonl(str(out))
    assert [r["method"] for r in rows] == ["ring", "local", "ring:fp16", "ddp"]
    for r in rows:
        assert r["world_size"] == 2 and len(r["step_s_per_round"]) == 2
        assert r["median_step_s"] > 0 and r["speedup_vs_ddp"] > 0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_parallel_zero_matches_the_formulas(tmp_path):
    out = tmp_path / "zero.jsonl"
    check_ok(mpirun(2, ["-m", "strategies.bench_parallel", "--part", "zero", "--rounds", "1",
                        "--steps", "2", "--jsonl", str(out)], timeout=130))
    rows = read_jsonl(str(out))
    assert [(r["precision"], r["stage"]) for r in rows] == \
        [("fp32", s) for s in range(4)] + [("bf16", s) for s in range(4)]
    for r in rows:       # tolerance: a few bytes of buffers beside the parameters
        assert r["state_over_formula"] == pytest.approx(1.0, rel=1e-3)
    for r in rows[:4]:
        assert r["sent_over_theory"] == pytest.approx(1.0, rel=1e-3)
        assert r["median_step_s"] > 0 and r["over_plain"] > 0


@pytest.mark.timeout(120)
def test_bench_sets_the_trainer_against_the_bare_loop_round_by_round(tmp_path):
    out = tmp_path / "bare.jsonl"
    check_ok(mpirun(1, ["-m", "strategies.bench", "--syncs", "local,bare", "--rounds", "3",
                        "--steps-per-round", "1", "--warmup", "1", "--jsonl", str(out)]
                    + TINY_MLP, timeout=100))
    rows = {r["method"]: r for r in read_jsonl(str(out))}
    local, bare = rows["local"], rows["bare"]
    rounds = sorted(a / b for a, b in zip(local["step_s_per_round"], bare["step_s_per_round"]))
    assert local["vs_bare"] == pytest.approx(rounds[1]) and bare["vs_bare"] == 1.0
