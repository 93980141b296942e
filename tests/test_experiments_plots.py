"""Each figure draws exactly the runs it compares: records of other models, worlds,
dtypes or settings in the same results are left out, and runs that share a strategy's
name are told apart.  Checked on what the figure drew (plots/NAME.json)."""
import pytest

from conftest import drawn
from experiments import plots, training_plots

MLP_A = {"model": "mlp", "width": 512, "depth": 3, "global_batch": 96, "world_size": 3}
MLP_B = {"model": "mlp", "width": 128, "depth": 2, "global_batch": 64, "world_size": 2}


def train_run(point, config, steps=3, ranks=2, step_s=0.01):
    return [{"command": "strategies.train", "kind": "step", "point": point, "step": s,
             "rank": r, "loss": 1.0 / (s + 1), "step_time_s": step_s, "compute_time_s": step_s / 2,
             "comm_time_s": step_s / 4, "staleness": 0, "config": config}
            for s in range(steps) for r in range(ranks)]


@pytest.mark.timeout(60)
def test_strategy_breakdown_compares_one_model_and_names_each_run(tmp_path):
    records = (train_run("a-ring", {**MLP_A, "sync": "ring", "overlap": True})
               + train_run("a-ring-serial", {**MLP_A, "sync": "ring", "overlap": False})
               + train_run("a-tree", {**MLP_A, "sync": "tree", "overlap": True})
               + train_run("b-ring", {**MLP_B, "sync": "ring", "overlap": True}, step_s=0.5))
    assert training_plots.strategy_breakdown(records, str(tmp_path))
    rate, breakdown = drawn(tmp_path, "strategy_breakdown")
    assert sorted(rate["bars"][0]["x"]) == ["ring overlap=False", "ring overlap=True", "tree"]
    assert rate["bars"][0]["height"] == pytest.approx([96 / 0.01] * 3)   # model B's 0.5 s: out
    assert "mlp 3 x 512, batch 96, 3 ranks" in rate["title"]


@pytest.mark.timeout(60)
def test_ps_consistency_compares_one_model_and_straggler(tmp_path):
    ps = {"sync": "ps", "servers": 1, "straggler": "1:0.02"}
    records = (train_run("bsp", {**MLP_A, **ps, "consistency": "bsp"})
               + train_run("asp", {**MLP_A, **ps, "consistency": "asp"})
               + train_run("asp-b", {**MLP_B, **ps, "consistency": "asp"}))
    assert training_plots.ps_consistency(records, str(tmp_path))
    by_step = drawn(tmp_path, "ps_consistency")[0]
    assert sorted(line["label"] for line in by_step["lines"]) == [
        "ps/asp +straggler", "ps/bsp +straggler"]
    assert "mlp 3 x 512" in by_step["title"]


def bench_rows(algo, dtype, busbw, P=2, sizes=(4096, 1 << 20), **config):
    return [{"command": "allreduce.bench", "op": "allreduce", "algo": algo, "dtype": dtype,
             "bytes": n, "world_size": P, "busbw_gbps": busbw, "time_us": 100.0 * P,
             "transport": "mpi", "config": config} for n in sizes]


@pytest.mark.timeout(60)
def test_allreduce_figures_keep_one_dtype_and_split_variants(tmp_path):
    records = (bench_rows("ring", "float32", 1.0) + bench_rows("ring", "float32", 1.0, P=3)
               + bench_rows("mpi", "float32", 2.0) + bench_rows("mpi", "float32", 2.0, P=3)
               + bench_rows("ring", "float64", 9.0)                     # another dtype: out
               + bench_rows("hierarchical", "float32", 3.0, inner="ring", ranks_per_node=1)
               + bench_rows("hierarchical", "float32", 4.0, inner="tree", ranks_per_node=1))
    assert plots.busbw_vs_size(records, str(tmp_path))
    (panel,) = drawn(tmp_path, "busbw_vs_size")
    lines = {line["label"]: line for line in panel["lines"]}
    assert set(lines) == {"ring", "mpi", "hierarchical (ring/ring, 1 a node)",
                          "hierarchical (tree/ring, 1 a node)"}
    assert lines["ring"]["x"] == [4096, 1 << 20] and lines["ring"]["y"] == [1.0, 1.0]
    assert "float32" in panel["title"]
    assert plots.scaling(records, str(tmp_path))
    (panel,) = drawn(tmp_path, "scaling")
    ring = next(line for line in panel["lines"] if line["label"] == "ring measured")
    assert ring["x"] == [2, 3] and ring["y"] == [0.2, 0.3]     # no float64 point at P = 2
