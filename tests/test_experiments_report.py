"""Plots and the report from the records of a real (tiny) sweep; the lab-2 check on them."""
import json
import os
import sys

import pytest
from conftest import check_ok, mpi_env, run

from experiments import fidelity, plots, training_plots
from experiments.labs import check_ps
from experiments.records import load, read_jsonl

SWEEP = """
[sweep]
name = "report-test"
timeout_s = 90

[[run]]
command = "experiments.calibrate"
reps = 2
ps = false
verify = []

[[run]]
command = "allreduce.bench"
world_size = [2, 3]
algos = ["ring", "tree", "mpi"]
sizes = ["4K", "1M"]
iters = 2
warmup = 1

[[run]]
command = "strategies.train"
world_size = 2
sync = "ring"
steps = 4

[[run]]
command = "strategies.train"
world_size = 3
sync = "ps"
consistency = ["bsp", "asp"]
straggler = "1:0.02"
steps = 8
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    path = d / "sweep.toml"
    path.write_text(SWEEP)
    out = d / "results"
    check_ok(run([sys.executable, "-m", "experiments.sweep", str(path), "--out", str(out)],
                 200, mpi_env()))
    assert all(s["status"] == "ok" for s in read_jsonl(out / "points.jsonl")), \
        read_jsonl(out / "points.jsonl")
    return out


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_each_plot_from_real_records(results, tmp_path):
    records = load(results)
    for fn in (plots.busbw_vs_size, training_plots.strategy_breakdown, plots.scaling,
               training_plots.ps_consistency):
        path = fn(records, str(tmp_path))
        assert path and os.path.getsize(path) > 5000, fn.__name__
        assert os.path.exists(path[:-4] + ".svg")
    # no grid records yet: no figure rather than a made-up one
    assert training_plots.zero_memory(records, str(tmp_path)) is None
    assert training_plots.pipeline_gantt({}, str(tmp_path)) is None
    assert plots.busbw_vs_size([], str(tmp_path)) is None


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_report_links_figures_and_shows_prediction_errors(results):
    check_ok(run([sys.executable, "-m", "experiments.report", str(results)], 120, mpi_env()))
    md = open(results / "report.md").read()
    for name in ("busbw_vs_size", "strategy_breakdown", "scaling", "ps_consistency",
                 "crossovers"):
        assert f"plots/{name}.png" in md and (results / "plots" / f"{name}.png").exists()
    assert md.count("No figure") == 2          # (d) and (e): no grid runs in this sweep
    assert "predicted ms" in md and "within 15%" in md
    assert "<img src=\"plots/scaling.png\"" in open(results / "report.html").read()
    rows = fidelity.compare(load(results), fidelity.machine_of(load(results)))
    ring = [r for r in rows if r["what"] == "ring" and r["source"].startswith("sweep")]
    cores = fidelity.machine_of(load(results)).cores
    assert {(r["P"], r["source"]) for r in ring} == {
        (P, fidelity.OVERSUBSCRIBED if P > cores else "sweep") for P in (2, 3)}
    assert all(r["predicted_s"] > 0 for r in ring)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_calibration_record_holds_both_kinds_of_ring_step(results):
    from experiments.calibrate import SIZES
    cal = [r for r in load(results) if r.get("kind") == "calibration"][-1]
    scratch, just_read = cal["exchange_scratch_s"], cal["exchange_just_read_s"]
    assert len(scratch) == len(just_read) == len(SIZES) == len(cal["exchange_s"])
    for mean, a, b in zip(cal["exchange_s"], scratch, just_read):
        assert mean == pytest.approx((a + b) / 2) and a > 0 and b > 0
    assert cal["alpha_s"] > 0 and cal["alpha_exchange_s"] >= 0
    assert len(cal["beta_s_per_byte_at"]) == len(cal["beta_bytes"]) == 4
    assert cal["beta_one_way_bytes"] == cal["beta_bytes"]
    assert len(cal["beta_one_way_s_per_byte_at"]) == len(cal["one_way_scratch_s"]) == 4
    assert all(s > 0 for s in cal["one_way_scratch_s"] + cal["one_way_just_read_s"])


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_lab2_check_reads_the_straggler_runs(results, capsys):
    check_ps.main([str(results)])     # timing checks depend on the machine's load; print only
    out = capsys.readouterr().out
    assert "bsp" in out and "asp" in out and "max staleness 0 (must be 0)" in out


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_lab2_figures_clock_is_each_workers_wall_clock(results):
    """The consistency figure reads when each worker ended each step, waits included
    (ended_s), not its step times added up.  Under BSP the fast worker waits for the
    straggler every step: from its first step's end to its last it takes the
    straggler's time, within 10 %; under ASP it ends its last step first."""
    steps = [r for r in load(results) if r.get("kind") == "step"
             and r["config"].get("sync") == "ps"]
    for mode in ("bsp", "asp"):
        mine = [s for s in steps if s["config"]["consistency"] == mode]
        ends = training_plots.step_ends(mine)
        assert ends == {(s["rank"], s["step"]): s["ended_s"] for s in mine}
        last = max(s["step"] for s in mine)
        fast, slow = (ends[(r, last)] - ends[(r, 0)] for r in (0, 1))     # rank 1 straggles
        if mode == "bsp":
            assert fast == pytest.approx(slow, rel=0.1), (fast, slow)
        else:
            assert ends[(0, last)] < ends[(1, last)], ends


@pytest.mark.timeout(10)
def test_the_figures_clock_keeps_a_wait_between_steps():
    """A wait between steps (a checkpoint) is in ended_s, not in any step time."""
    steps = [{"rank": 0, "step": i, "step_time_s": 0.004,
              "ended_s": 0.004 * (i + 1) + (0.5 if i >= 10 else 0.0)} for i in range(20)]
    assert training_plots.step_ends(steps)[(0, 19)] == pytest.approx(0.58)


GRID = """
[sweep]
name = "grid"
timeout_s = 150

[[run]]
command = "strategies.train"
world_size = 2
sync = "ring"
dp = 2
zero = [0, 3]
model = "mlp"
width = 16
optimizer = "adam"
lr = 0.01
global_batch = 16
steps = 2
trace = true

[[run]]
command = "strategies.train"
world_size = 2
sync = "ring"
pp = 2
micro_batches = 2
schedule = "1f1b"
model = "mlp"
width = 64
depth = 2
global_batch = 16
steps = 2
trace = true
"""


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_grid_runs_feed_the_zero_memory_and_pipeline_figures(tmp_path):
    sweep_file, out = tmp_path / "grid.toml", tmp_path / "grid"
    sweep_file.write_text(GRID)
    check_ok(run([sys.executable, "-m", "experiments.sweep", str(sweep_file), "--out", str(out)],
                 200, mpi_env()))
    assert (out / "raw").is_dir() and list((out / "raw").glob("*.trace.json"))
    check_ok(run([sys.executable, "-m", "experiments.report", str(out)], 120, mpi_env()))
    md = open(out / "report.md").read()
    for name in ("zero_memory", "pipeline_gantt"):
        assert f"plots/{name}.png" in md and (out / "plots" / f"{name}.png").exists()
    # The pipeline run (zero 0, a larger model, half of it per rank) is no ZeRO-0 run:
    # the ZeRO-0 bar is the width-16 model's 4 bytes per parameter, exactly.
    (panel,) = json.load(open(out / "plots" / "zero_memory.json"))
    params = next(b for b in panel["bars"] if b["label"] == "params")
    assert params["x"] == ["ZeRO-0", "ZeRO-3"]
    psi = mlp_parameters(in_dim=32, width=16, depth=2, classes=10)
    assert params["height"][0] * 2**20 == pytest.approx(4 * psi, rel=1e-9)
    assert params["height"][1] * 2**20 < 4 * psi                  # ZeRO-3 keeps a shard
    assert "mlp 2 x 16" in panel["title"]
    # the traced ZeRO runs have forward and backward spans but no stages: not a schedule
    gantt = json.load(open(out / "plots" / "pipeline_gantt.json"))
    assert [panel["title"] for panel in gantt] == ["1f1b, m=2 (last step)"]


def mlp_parameters(in_dim, width, depth, classes):
    """Ψ of strategies.model.models.MLP: `depth` hidden Linear layers of `width`, then the head."""
    dims = [in_dim] + [width] * depth + [classes]
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))
