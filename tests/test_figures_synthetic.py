"""Every figure draws from small made-up records, with and without rounds, and says
what it shows: sizes as 4K/64K, predicted against measured, one colour a name, the
pipeline's bubble beside its formula, the server's updates.  Checked on what the
figure drew (plots/NAME.json), never on pixels.  No processes: seconds."""
import html
import json
import statistics

import pytest

from conftest import drawn
from experiments import palette, plots, report, screenshot, training_plots
from experiments.palette import COLOURS
from matplotlib.colors import to_hex

PROV = {"provenance": {"cores": 2}}
CAL = {"kind": "calibration", "alpha_s": 1e-5, "beta_s_per_byte": 1e-9,
       "gamma_s_per_byte": 5e-10, "cores": 2, "memcpy_gbps": 5.0}


def bench(algo, n, P, time_us, rounds=None, **config):
    r = {"command": "allreduce.bench", "op": "allreduce", "algo": algo, "dtype": "float32",
         "bytes": n, "world_size": P, "time_us": time_us, "transport": "mpi",
         "busbw_gbps": 2 * (P - 1) / P * n / time_us / 1e3, "config": config, **PROV}
    return {**r, "round_us": rounds} if rounds else r


@pytest.mark.timeout(60)
def test_one_colour_a_name_and_the_spread_of_samples():
    assert palette.colour_of("ring over torch") == palette.colour_of("ring measured") == \
        COLOURS["ring"]
    assert palette.colour_of("ps/ssp(3) +straggler") == COLOURS["ps/ssp"]
    assert palette.colour_of("hierarchical (tree/ring, 2 a node)") == COLOURS["hierarchical"]
    assert palette.colour_of("someday") == palette.colour_of("someday")     # stable, no table
    assert palette.spread([3, 1, 2]) == (2, 1, 3)
    assert palette.spread([1, 2, 3, 4, 5], "iqr") == (3, 2, 4)


@pytest.mark.timeout(60)
def test_busbw_draws_medians_with_min_max_over_rounds_and_size_ticks(tmp_path):
    sizes = (4096, 1 << 20, 64 << 20)
    records = [bench("ring", n, 2, 100.0, rounds=[100.0, 80.0, 200.0]) for n in sizes]
    records += [bench("tree", n, 2, 50.0) for n in sizes] + [CAL]       # tree: no rounds
    assert plots.busbw_vs_size(records, str(tmp_path))
    (panel,) = drawn(tmp_path, "busbw_vs_size")
    assert panel["xticklabels"] == ["4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M"]
    assert "P=2" in panel["title"] and "2 cores" in panel["title"]
    lines = {line["label"]: line for line in panel["lines"]}
    assert lines["ring"]["color"] == to_hex(COLOURS["ring"])
    assert lines["tree"]["color"] == to_hex(COLOURS["tree"])
    busbw = records[0]["busbw_gbps"]       # the round of 200 us is the slowest: busbw / 2
    (bars,) = panel["errorbars"]                                    # the ring's only
    assert bars["low"][0] == pytest.approx(busbw / 2, rel=1e-9)
    assert bars["high"][0] == pytest.approx(busbw * 100 / 80, rel=1e-9)
    assert lines["ring"]["y"][0] == pytest.approx(busbw, rel=1e-9)  # the median round


@pytest.mark.timeout(60)
def test_scaling_draws_measured_solid_and_predicted_dashed_in_one_colour(tmp_path):
    records = [bench(a, 1 << 20, P, 100.0 * P) for a in ("ring", "tree") for P in (2, 3, 4)]
    records += [CAL]
    assert plots.scaling(records, str(tmp_path))
    (panel,) = drawn(tmp_path, "scaling")
    lines = {line["label"]: line for line in panel["lines"]}
    assert {"ring measured", "ring predicted", "tree measured", "tree predicted"} <= set(lines)
    assert lines["ring measured"]["color"] == lines["ring predicted"]["color"] == \
        to_hex(COLOURS["ring"])
    assert "all-reduce of 1M" in panel["title"] and "2 cores" in panel["title"]
    assert panel["errorbars"] == []                                 # no rounds, no bars
    assert plots.scaling([r for r in records if r is not CAL], str(tmp_path))   # no model


@pytest.mark.timeout(60)
def test_crossover_titles_print_sizes_and_every_curve_is_predicted(tmp_path):
    records = [{"kind": "simulation", "algo": algo, "P": P, "bytes": n, "time_s": 1e-3 * P}
               for algo in ("ring", "tree", "ps(S=1)", "ps(S=4)") for P in (8, 64, 512)
               for n in (65536, 16 << 20)]
    assert plots.crossovers(records, str(tmp_path), cluster="8 ranks a node")
    small, large = drawn(tmp_path, "crossovers")
    assert small["title"] == "all-reduce of 64K" and large["title"] == "all-reduce of 16M"
    assert all(line["label"].endswith(" predicted") for line in small["lines"])
    colours = {line["label"]: line["color"] for line in small["lines"]}
    assert colours["ps(S=1) predicted"] == colours["ps(S=4) predicted"] == to_hex(COLOURS["ps"])


# 1F1B on 2 stages, 4 micro-batches, one ms a span: stage 0 forwards one micro-batch
# ahead, then alternates; (start ms of forward mb0..3, of backward mb0..3) per stage
ONE_F_ONE_B = {0: ((0, 1, 4, 6), (3, 5, 7, 9)), 1: ((1, 3, 5, 7), (2, 4, 6, 8))}


def pipeline_trace(p, m, schedule):
    """An ideal schedule's events, forward and backward one ms each per stage."""
    events = [{"name": "process_name", "ph": "M", "pid": s,
               "args": {"name": f"rank {s} (dp 0, pp {s}, tp 0)"}} for s in range(p)]
    for s in range(p):
        if schedule == "gpipe":                  # all m forwards, then all m backwards
            starts = ([i + s for i in range(m)],
                      [(m + p - 1) + i + (p - 1 - s) for i in range(m)])
        else:
            starts = ONE_F_ONE_B[s]
        for cat, at in zip(("forward", "backward"), starts):
            events += [{"name": f"{cat} mb{i}", "cat": cat, "ph": "X", "pid": s,
                        "ts": 1000.0 * t, "dur": 1000.0} for i, t in enumerate(at)]
    return events


@pytest.mark.timeout(60)
def test_pipeline_gantt_numbers_micro_batches_and_measures_the_bubble(tmp_path):
    gpipe = pipeline_trace(2, 4, "gpipe")
    assert training_plots.bubble([e for e in gpipe if e["ph"] == "X"]) == pytest.approx(1 / 5)
    assert training_plots.in_flight([e for e in gpipe if e["ph"] == "X"]) == 4
    traces = {"gpipe, m=4": gpipe, "1f1b, m=4": pipeline_trace(2, 4, "1f1b")}
    assert training_plots.pipeline_gantt(traces, str(tmp_path), about="mlp, p=2 stages")
    panels = {panel["title"]: panel for panel in drawn(tmp_path, "pipeline_gantt")}
    gp = panels["gpipe, m=4 (last step)"]
    assert gp["left_title"] == "bubble 20% measured, 20% by (p-1)/(m+p-1)"
    assert gp["right_title"] == "at most 4 micro-batches in flight"
    assert panels["1f1b, m=4 (last step)"]["right_title"] == "at most 2 micro-batches in flight"
    assert sorted(gp["texts"]) == sorted([str(i) for i in range(4)] * 4)   # F and B, 2 stages
    assert training_plots.pipeline_gantt({}, str(tmp_path)) is None


def ps_steps(consistency, step_s, steps=4, **extra):
    config = {"model": "mlp", "width": 8, "depth": 1, "global_batch": 8, "world_size": 3,
              "sync": "ps", "servers": 1, "consistency": consistency, "straggler": "1:0.01"}
    return [{"command": "strategies.train", "kind": "step", "point": consistency, "step": s,
             "rank": r, "loss": 1.0 / (s + 1), "step_time_s": step_s[r], "compute_time_s": 0,
             "comm_time_s": 0, "staleness": None if consistency == "bsp" else r,
             "config": config, **extra} for s in range(steps) for r in range(2)]


@pytest.mark.timeout(60)
def test_ps_consistency_puts_each_worker_against_the_servers_updates(tmp_path):
    asp = ps_steps("asp", {0: 1.0, 1: 2.0})
    # one update a push: rank 0 ends its steps at 1, 2, 3, 4 s, rank 1 at 2, 4, 6, 8 s
    assert [training_plots.server_updates(asp, "asp")[(0, s)] for s in range(4)] == [1, 3, 4, 6]
    bsp = ps_steps("bsp", {0: 1.0, 1: 1.0})
    assert [training_plots.server_updates(bsp, "bsp")[(1, s)] for s in range(4)] == [1, 2, 3, 4]
    told = ps_steps("ssp", {0: 1.0, 1: 1.0}, server_version=7)     # records that carry it
    assert set(training_plots.server_updates(told, "ssp").values()) == {7}
    assert training_plots.ps_consistency(asp + bsp, str(tmp_path))
    by_step, by_time, clocks, stale = drawn(tmp_path, "ps_consistency")
    assert sorted(line["label"] for line in by_step["lines"]) == [
        "ps/asp +straggler", "ps/bsp +straggler"]
    workers = {line["label"]: line for line in clocks["lines"]}
    assert workers["ps/asp +straggler, rank 0"]["x"] == [1, 3, 4, 6]
    assert workers["ps/asp +straggler, rank 0"]["y"] == [1, 2, 3, 4]
    assert "ps/asp +straggler, rank 1 (straggler)" in workers
    assert [line["label"] for line in stale["lines"]] == [          # bsp's records: no staleness
        "ps/asp +straggler, rank 0", "ps/asp +straggler, rank 1 (straggler)"]
    assert "counted from the step ends" in clocks["xlabel"]


def train_runs():
    cfg = {"model": "mlp", "width": 8, "depth": 1, "global_batch": 8, "world_size": 2}
    out = []
    for sync in ("ring", "tree"):
        out += [{"command": "strategies.train", "kind": "step", "point": sync, "step": s,
                 "rank": r, "loss": 1.0, "step_time_s": 0.01 * (s + 1), "compute_time_s": 0.005,
                 "comm_time_s": 0.002, "staleness": None, "config": {**cfg, "sync": sync}, **PROV}
                for s in range(5) for r in range(2)]
    for zero in (0, 3):
        out += [{"command": "strategies.train", "kind": "step", "point": f"z{zero}", "step": 0,
                 "rank": r, "loss": 1.0, "step_time_s": 0.01, "compute_time_s": 0.01,
                 "comm_time_s": 0, "config": {**cfg, "sync": "ring", "dp": 2, "zero": zero},
                 "memory": {"params": 4096 >> (zero and 1), "grads": 4096, "optimizer": 8192,
                            "activations_peak": 100}} for r in range(2)]
    return out


@pytest.mark.timeout(60)
def test_training_figures_draw_with_interquartile_bars(tmp_path):
    records = train_runs()
    assert training_plots.strategy_breakdown(records, str(tmp_path))
    rate, _ = drawn(tmp_path, "strategy_breakdown")
    # steps 1..4 (step 0 warms up) take 20..50 ms: the bar is the median of their rates
    assert rate["bars"][0]["height"][0] == pytest.approx(
        statistics.median([8 / t for t in (0.02, 0.03, 0.04, 0.05)]))
    assert len(rate["errorbars"]) == 1 and "2 cores" in rate["title"]
    assert training_plots.zero_memory(records, str(tmp_path))
    (panel,) = drawn(tmp_path, "zero_memory")
    assert panel["bars"][0]["x"] == ["ZeRO-0", "ZeRO-3"]


@pytest.mark.timeout(120)
def test_report_embeds_every_figure_with_a_caption_and_survives_no_browser(tmp_path,
                                                                         monkeypatch):
    records = ([bench(a, n, P, 100.0 * P, rounds=[90.0 * P, 100.0 * P, 130.0 * P])
                for a in ("ring", "tree") for P in (2, 3) for n in (4096, 1 << 20)]
               + [CAL] + train_runs() + ps_steps("asp", {0: 0.01, 1: 0.02}))
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(screenshot.shutil, "which", lambda name: None)
    shot = tmp_path / "shot.png"
    written = report.write_report([str(tmp_path), "--screenshot", str(shot)])
    page = (tmp_path / "report.html").read_text()
    for path in written:
        name = path.split("/")[-1]
        assert f'<img src="plots/{name}"' in page
    assert len(written) == 6                        # every figure but the pipeline's
    for _, title, look, _ in report.FIGURES:
        if "Gantt" not in title:
            assert html.escape(look.split(",")[0]) in page
    assert "Colours, the same in every figure" in page and not shot.exists()
    assert screenshot.screenshot(str(tmp_path / "report.html"), str(shot)).startswith(
        "no screenshot: none of chromium")
