"""Tier (c): techniques that used to live in one engine each, composed on the one worker.

Each run is compared with `--sync local` on one process over the same global
batch.  Tolerance: rtol = 1e-4, atol = 1e-6 over the steps stated (at least 3):
these runs stack more reorderings of float additions than the single-technique
runs of test_parallel_runs.py (1e-5) (the dp average, the tp partial sums, the
micro-batch sum, the sequence shards' gathers, a replayed forward), each a few
ulps; a wrong shard, micro-batch or replay moves values by O(lr * grad) ~ 1e-3.

The lossy settings (bf16 through the parameter servers, top-k on the grid's dp
axis) train rather than reproduce: their final loss against the dense fp32 run
in the same launch.
"""
import numpy as np
import pytest
from test_parallel_runs import GPT, MLP_SGD, assert_same_run, launch

from conftest import check_ok, mpirun

RTOL, ATOL = 1e-4, 1e-6
# In the quick tier too: these compositions are the one worker's proof, for every change.


def assert_close_run(run, ref, world):
    """assert_same_run at this file's tolerance."""
    import test_parallel_runs as base
    saved = base.RTOL, base.ATOL
    base.RTOL, base.ATOL = RTOL, ATOL
    try:
        assert_same_run(run, ref, world)
    finally:
        base.RTOL, base.ATOL = saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 3 and 4 steps of the GPT (the 4-step one for the resumed run)."""
    return launch(tmp_path_factory.mktemp("reference"), 1,
                  [("gpt", GPT + ["--sync", "local"]),
                   ("gpt4", GPT + ["--sync", "local", "--steps", "4"]),
                   ("mlp4", MLP_SGD + ["--sync", "local", "--steps", "4"])])


@pytest.mark.timeout(600)
def test_four_ranks_every_technique_composes(tmp_path, reference):
    """dp2 x tp2 with sequence parallelism, ZeRO-2, recompute and 2 micro-batches;
    dp2 x pp2 with ZeRO-1 and gradient accumulation 2 (on the grid, micro-batches);
    dp2 x pp2 checkpointed at step 2 and resumed to step 4, equal to the run that
    was not interrupted and to one process."""
    ckpt = tmp_path / "ckpt"
    split = GPT + ["--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "2"]
    runs = launch(tmp_path, 4, [
        ("dp2_tp2_sp_zero2_recompute", GPT + ["--dp", "2", "--tp", "2", "--sequence-parallel",
                                             "--zero", "2", "--recompute",
                                             "--micro-batches", "2", "--trace",
                                             tmp_path / "recompute.json"]),
        ("dp2_pp2_zero1_accum", GPT + ["--dp", "2", "--pp", "2", "--zero", "1",
                                       "--grad-accum", "2"]),
        ("first", split + ["--steps", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "1"]),
        ("resumed", split + ["--steps", "4", "--checkpoint-dir", ckpt, "--resume"]),
        ("whole", split + ["--steps", "4"]),
    ], timeout=500)
    assert_close_run(runs["dp2_tp2_sp_zero2_recompute"], reference["gpt"], 4)
    assert_close_run(runs["dp2_pp2_zero1_accum"], reference["gpt"], 4)
    assert_close_run(runs["whole"], reference["gpt4"], 4)
    resumed, whole = runs["resumed"], runs["whole"]
    assert sorted({r["step"] for r in resumed[0]}) == [2, 3]
    for name, value in whole[1].items():          # exact: the same layout, the same order
        np.testing.assert_array_equal(resumed[1][name], value, err_msg=name)
    # the recompute replays ran inside the grid's backward, on the trace
    import json
    cats = {e["cat"] for e in json.load(open(tmp_path / "recompute.json"))["traceEvents"]
            if e.get("ph") == "X"}
    assert {"recompute", "dp-comm"} <= cats


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_zero3_and_fp16_resume_exactly(tmp_path, reference):
    """ZeRO-3 (parameters as shards only) and fp16 (the loss scale in the file) resume
    to the same parameters as the uninterrupted run, on 2 ranks."""
    runs = {}
    for name, extra in (("z3", ["--zero", "3"]),
                        ("fp16", ["--zero", "2", "--precision", "fp16", "--loss-scale", "1e6",
                                  "--loss-scale-window", "2"])):
        ckpt = tmp_path / name
        flags = MLP_SGD + extra
        runs.update(launch(tmp_path, 2, [
            (f"{name}_first", flags + ["--steps", "2", "--checkpoint-dir", ckpt]),
            (f"{name}_resumed", flags + ["--steps", "4", "--checkpoint-dir", ckpt, "--resume"]),
            (f"{name}_whole", flags + ["--steps", "4"])]))
    assert_close_run(runs["z3_whole"], reference["mlp4"], 2)
    for name in ("z3", "fp16"):
        whole, resumed = runs[f"{name}_whole"], runs[f"{name}_resumed"]
        for key, value in whole[1].items():
            np.testing.assert_array_equal(resumed[1][key], value, err_msg=f"{name} {key}")
        last = [r for r in whole[0] if r["step"] == 3]
        again = [r for r in resumed[0] if r["step"] == 3]
        assert [r.get("loss_scale") for r in again] == [r.get("loss_scale") for r in last]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_in_another_layout_is_refused_on_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--steps", "2", "--threads", "1", "--no-progress", "--sync", "ring"] + GPT + \
        ["--checkpoint-dir", ckpt]
    check_ok(mpirun(2, ["-m", "strategies.train", *flags, "--tp", "2"], timeout=180))
    result = mpirun(2, ["-m", "strategies.train", *flags, "--pp", "2", "--resume"],
                    timeout=180)
    assert result.returncode == 2, result.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank}: error: --resume:" in result.stderr
    assert "pp 1, tp 2" in result.stderr and "a split run resumes in its own layout" \
        in result.stderr


def final_loss(steps):
    return np.mean([r["loss"] for r in steps if r["step"] == max(s["step"] for s in steps)])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bf16_through_parameter_servers_and_topk_on_the_grid_train(tmp_path):
    """--sync ps --precision bf16 ends within 2 % of fp32 through the same servers after
    20 steps (2 workers + 1 server); top-k 10 % on the dp axis of a dp2 x tp2 grid ends
    within 5 % of the dense grid after 30 steps, sending a fraction of its bytes."""
    ps = ["--sync", "ps", "--servers", "1", "--steps", "20"] + MLP_SGD
    runs = launch(tmp_path, 3, [("ps_fp32", ps), ("ps_bf16", ps + ["--precision", "bf16"])])
    fp32, bf16 = final_loss(runs["ps_fp32"][0]), final_loss(runs["ps_bf16"][0])
    assert abs(bf16 - fp32) / fp32 < 0.02, (bf16, fp32)
    grid = GPT + ["--dp", "2", "--tp", "2", "--steps", "30", "--momentum", "0"]
    runs = launch(tmp_path, 4, [("dense", grid),
                                ("topk", grid + ["--compress", "topk:0.1"])], timeout=300)
    dense, topk = final_loss(runs["dense"][0]), final_loss(runs["topk"][0])
    assert abs(topk - dense) / dense < 0.05, (topk, dense)
    records = runs["topk"][0]
    assert all(r["wire_bytes"] < 0.5 * r["dense_bytes"] for r in records)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lossy_compression_shrinks_the_wire_at_every_zero_stage(tmp_path):
    """Top-k and PowerSGD compress an all-reduce whose result each rank cuts its shard
    from (zero.py), so stages 1 and 2 send a fraction of the dense bytes too."""
    runs = launch(tmp_path, 2, [(f"{kind}_zero{s}", MLP_SGD + ["--zero", str(s), "--momentum",
                                                              "0", "--compress", spec])
                                for s in (1, 2) for kind, spec in (("topk", "topk:0.1"),
                                                                  ("powersgd", "powersgd:1"))])
    for name, (records, _) in runs.items():
        assert all(r["wire_bytes"] < 0.6 * r["dense_bytes"] for r in records), name
        assert all(np.isfinite(r["loss"]) for r in records), name
