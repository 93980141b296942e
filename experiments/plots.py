"""The figures of the report, one function each; every one reads result records only.

    records = experiments.records.load("results/demo")
    path = busbw_vs_size(records, "results/demo/plots")    # -> .../busbw_vs_size.png (+ .svg)

Each function returns the PNG's path, or None when the records hold nothing
for it (the report then says which sweep would produce it).  A figure compares
like with like: it picks, from everything in the records, the one group of runs
that differ only in what the figure compares (the same model, size, batch, world
and dtype), the group with the most variants, and names it in the title.  Figures:
  (a) busbw_vs_size          allreduce.bench: busbw per algorithm, memcpy as roofline
  (b) strategy_breakdown     strategies.train: throughput; compute / exposed comm / idle
  (c) scaling                allreduce.bench: time against ranks, measured and predicted
  (d) zero_memory            strategies.train on dp alone: memory per rank by ZeRO stage
  (e) pipeline_gantt         strategies.train --pp --trace: GPipe beside 1F1B
  (f) ps_consistency         loss against step and wall-clock for BSP/SSP/ASP, staleness
  (g) crossovers             experiments.simulate: predicted time against ranks, two levels
"""
import json
import os
import statistics
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")                       # files only; no display on a cluster node
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.category import UnitData  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402

from . import fidelity  # noqa: E402
from .records import (allreduce_rows, describe, labels_of, model_of,  # noqa: E402
                      one_comparison)


def save(fig, out_dir, name):
    """NAME.png, NAME.svg and NAME.json: the numbers the figure draws (figure_data)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + ".png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.savefig(os.path.join(out_dir, name + ".svg"))
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(figure_data(fig), f, indent=1)
    plt.close(fig)
    return path


def figure_data(fig):
    """Per panel: title, labels, each line's points and each bar's label, x (the category
    for a bar chart), bottom and height.  A reader gets the value behind a bar without
    measuring pixels; a test checks what was drawn, not what was meant."""
    panels = []
    for ax in fig.axes:
        categories = isinstance(ax.xaxis.units, UnitData)      # bars over names, not numbers
        ticks = dict(zip(ax.get_xticks(), (t.get_text() for t in ax.get_xticklabels())))

        def where(patch):
            centre = patch.get_x() + patch.get_width() / 2
            return ticks.get(round(centre), centre) if categories else float(centre)
        panels.append({
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "lines": [{"label": line.get_label(), "x": [float(x) for x in line.get_xdata()],
                       "y": [float(y) for y in line.get_ydata()]} for line in ax.get_lines()],
            "bars": [{"label": c.get_label(), "x": [where(p) for p in c.patches],
                      "bottom": [float(p.get_y()) for p in c.patches],
                      "height": [float(p.get_height()) for p in c.patches],
                      "width": [float(p.get_width()) for p in c.patches]}
                     for c in ax.containers if isinstance(c, BarContainer)]})
    return panels


def emulated(r):
    c = r.get("config", {})
    return bool(c.get("link_latency_us") or c.get("link_gbps"))


def busbw_vs_size(records, out_dir, world_size=None):
    """(a) busbw (nccl-tests) against message size, one line per algorithm, at the
    smallest world size measured without link emulation; memcpy is the ceiling."""
    rows = [r for r in allreduce_rows(records) if not emulated(r)]
    if not rows:
        return None
    P = world_size or min(r["world_size"] for r in rows)
    by_variant = defaultdict(lambda: defaultdict(list))       # a size measured twice: median
    for r in rows:
        if r["world_size"] == P:
            by_variant[r["variant"]][r["bytes"]].append(r["busbw_gbps"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for variant, at in sorted(by_variant.items()):
        sizes = sorted(at)
        ax.plot(sizes, [statistics.median(at[b]) for b in sizes], "o-", label=variant)
    cals = [r for r in records if r.get("kind") == "calibration"]
    if cals:
        ax.axhline(cals[-1]["memcpy_gbps"], color="k", ls="--", lw=1,
                   label=f"memcpy {cals[-1]['memcpy_gbps']:.1f} GB/s (roofline)")
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)",
           title=f"all-reduce bus bandwidth, P={P}, {rows[0]['dtype']}")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "busbw_vs_size")


def strategy_name(r):
    c = r.get("config", {})
    name = c.get("sync", "?")
    if name in ("ps", "hybrid"):
        name += f"/{c.get('consistency', 'bsp')}" + (
            f"({c['staleness']})" if c.get("consistency") == "ssp" else "")
    if c.get("straggler"):
        name += " +straggler"
    return name


def on_grid(record):
    """Whether a training record comes from the dp x pp x tp worker (--dp/--pp/--tp/--zero)."""
    cfg = record.get("config", {})
    return bool(cfg.get("dp") or cfg.get("zero") or cfg.get("pp", 1) > 1 or
                cfg.get("tp", 1) > 1 or cfg.get("micro_batches", 1) > 1)


def train_steps(records):
    runs = defaultdict(list)
    for r in records:
        if r.get("command") == "strategies.train" and r.get("kind") == "step":
            runs[(strategy_name(r), r.get("point"))].append(r)
    return runs


def strategy_breakdown(records, out_dir):
    """(b) samples/s per strategy, and a rank's mean step split into compute, exposed
    communication and idle: the time a rank's step ends before the slowest rank's
    of the same step.  Waiting for a slower peer *inside* a collective cannot be
    told apart from moving bytes in these records: it counts as exposed comm."""
    # plain data-parallel runs only: grid runs (ZeRO, pipeline) have plots (d) and (e)
    runs = {k: v for k, v in train_steps(records).items()
            if "straggler" not in k[0] and not on_grid(v[0])}
    runs = one_comparison(runs, model_of, lambda k, c: k[0])
    if not runs:
        return None
    labels = labels_of(runs)
    names, compute, comm, idle, rate = [], [], [], [], []
    for run_key, steps in sorted(runs.items(), key=lambda kv: labels[kv[0]]):
        name = labels[run_key]
        timed = [s for s in steps if s["step"] > 0] or steps      # step 0 warms up
        mean = lambda key: sum(s[key] for s in timed) / len(timed)  # noqa: E731
        names.append(name)
        compute.append(1e3 * mean("compute_time_s"))
        comm.append(1e3 * mean("comm_time_s"))
        slowest = defaultdict(float)                 # a step lasts as long as its slowest rank
        for s in timed:
            slowest[s["step"]] = max(slowest[s["step"]], s["step_time_s"])
        idle.append(1e3 * sum(slowest[s["step"]] - s["step_time_s"] for s in timed) / len(timed))
        batch = steps[0].get("config", {}).get("global_batch", 64)
        rate.append(batch * len(slowest) / sum(slowest.values()))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    a1.bar(names, rate, color="tab:gray")
    a1.set(ylabel="samples / s", title=f"throughput ({describe(steps[0]['config'])})")
    a2.bar(names, compute, label="compute")
    a2.bar(names, comm, bottom=compute, label="exposed comm")
    a2.bar(names, idle, bottom=[c + m for c, m in zip(compute, comm)], label="idle")
    a2.set(ylabel="ms per step (mean over ranks)", title="step-time breakdown")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=20)
    return save(fig, out_dir, "strategy_breakdown")


def scaling(records, out_dir, nbytes=None):
    """(c) all-reduce time against the number of ranks at one size: measured
    points, the cost model's prediction as lines (calibrated, experiments.calibrate)."""
    rows = [r for r in allreduce_rows(records) if not emulated(r)]
    sizes = {r["bytes"] for r in rows}
    if not rows or len({r["world_size"] for r in rows}) < 2:
        return None
    n = nbytes or max(s for s in sizes
                      if len({r["world_size"] for r in rows if r["bytes"] == s}) >= 2)
    machine = fidelity.machine_of(records)
    fig, ax = plt.subplots(figsize=(8.4, 4.2))
    for i, variant in enumerate(sorted({r["variant"] for r in rows})):
        pts = sorted((r["world_size"], r["time_us"] / 1e3) for r in rows
                     if r["variant"] == variant and r["bytes"] == n)
        first, color = next(r for r in rows if r["variant"] == variant), f"C{i}"
        ax.plot([p for p, _ in pts], [t for _, t in pts], "o", color=color,
                label=f"{variant} measured")
        if machine and not variant.endswith(" over torch"):   # the model has MPI's alpha-beta
            ranks = sorted({p for p, _ in pts})
            pred = [fidelity.predict({**first, "bytes": n, "world_size": p}, machine)
                    for p in ranks]
            if all(x is not None for x in pred):
                ax.plot(ranks, [1e3 * x for x in pred], "-", color=color, alpha=0.6,
                        label=f"{variant} predicted")
    ranks = sorted({r["world_size"] for r in rows})
    cores = machine.cores if machine else None
    if cores and ranks[-1] > cores:
        # Ranks beyond the cores take turns on them: the measured times include
        # waiting for the scheduler, which the model's P / cores stretch omits.
        ax.axvspan(cores + 0.5, ranks[-1] + 0.5, color="0.9", zorder=0,
                   label=f"P > {cores} cores: ranks share cores")
    ax.set(xlabel="ranks P", ylabel="time (ms)", title=f"all-reduce of {n / 2**20:g} MiB",
           xticks=ranks)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))   # beside: no point hidden
    return save(fig, out_dir, "scaling")


MEMORY_PARTS = ("params", "grads", "optimizer", "activations")


def zero_memory_data(records):
    """(title, {stage: {part: bytes on the largest rank}}) of the ZeRO comparison, or None.
    Only runs on data parallelism alone (pp = tp = 1: every rank holds the whole model,
    so stage 0 holds 4Ψ bytes of fp32 parameters) of one model, world, optimizer and
    micro-batching, that differ in the stage; a pipeline run is not a ZeRO-0 run."""
    runs = defaultdict(list)
    for r in records:
        c = r.get("config", {})
        if r.get("command") == "strategies.train" and r.get("kind") == "step" and \
                isinstance(r.get("memory"), dict) and c.get("pp", 1) == 1 and c.get("tp", 1) == 1:
            runs[r.get("point")].append(r)
    runs = one_comparison(runs, lambda c: model_of(c, "optimizer", "micro_batches"),
                          lambda k, c: c.get("zero", 0))
    if not runs:
        return None
    by_stage = defaultdict(lambda: defaultdict(int))
    for steps in runs.values():
        for r in steps:
            stage, memory = r["config"].get("zero", 0), r["memory"]
            for part in MEMORY_PARTS:
                value = memory.get(part, memory.get(f"{part}_peak", 0))
                by_stage[stage][part] = max(by_stage[stage][part], value)
    c = next(iter(runs.values()))[0]["config"]
    return f"{describe(c)}, {c.get('optimizer', 'sgd')}", by_stage


def zero_memory(records, out_dir):
    """(d) bytes per rank by ZeRO stage, stacked by part, from the `memory` dict that
    strategies.train writes in each step's record on the grid (--dp/--zero):
    params, grads, optimizer (measured from the tensors) and activations_peak."""
    data = zero_memory_data(records)
    if not data:
        return None
    title, by_stage = data
    stages = sorted(by_stage)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bottom = [0.0] * len(stages)
    for part in MEMORY_PARTS:
        mib = [by_stage[s][part] / 2**20 for s in stages]
        ax.bar([f"ZeRO-{s}" for s in stages], mib, bottom=bottom, label=part)
        bottom = [b + m for b, m in zip(bottom, mib)]
    ax.set(ylabel="MiB per rank (largest rank)", title=f"memory per rank by ZeRO stage\n{title}")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "zero_memory")


def last_step(events):
    """The events of the trace's last step: from the earliest start, over the ranks,
    of each rank's last "step" span (the first step carries one-time start-up costs)."""
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "step"]
    if not steps:
        return events
    last = {}
    for e in steps:
        last[e.get("pid", 0)] = max(last.get(e.get("pid", 0), 0), e["ts"])
    start = min(last.values())
    return [e for e in events if e.get("ts", 0) >= start]


def pipeline_gantt(traces, out_dir):
    """(e) one timeline per schedule, the last step of each: {schedule: Chrome-trace
    events} (strategies.train --trace; experiments.report collects them by schedule).
    Forward and backward spans only: the gaps between them are the bubbles."""
    traces = {k: [e for e in last_step(v) if e.get("ph") == "X"
                  and e.get("cat") in ("forward", "backward")]
              for k, v in (traces or {}).items()}
    traces = {k: v for k, v in traces.items() if v}
    if not traces:
        return None
    colors = {"forward": "tab:blue", "backward": "tab:orange"}
    fig, axes = plt.subplots(len(traces), 1, figsize=(8, 2 + 1.2 * len(traces)), squeeze=False)
    for ax, (schedule, events) in zip(axes[:, 0], sorted(traces.items())):
        t0 = min(e["ts"] for e in events)
        for e in events:
            ax.barh(e.get("pid", 0), e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3,
                    color=colors.get(e.get("cat"), "tab:gray"), edgecolor="k", lw=0.3)
        stages = sorted({e.get("pid", 0) for e in events})
        ax.set_yticks(stages)
        ax.set(ylabel="stage", title=f"{schedule} (last step)")
        ax.invert_yaxis()
    from matplotlib.patches import Patch
    axes[0, 0].legend(handles=[Patch(color=c, label=cat) for cat, c in colors.items()],
                      fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time (ms)")
    fig.tight_layout()
    return save(fig, out_dir, "pipeline_gantt")


def ps_consistency(records, out_dir):
    """(f) the consistency models with a straggler: the global loss against step and
    against wall-clock (a step ends when its slowest worker ends it), and how stale
    the parameters a worker computed on were."""
    runs = {k: v for k, v in train_steps(records).items() if k[0].startswith(("ps/", "hybrid/"))}
    if any("straggler" in name for name, _ in runs):          # compare like with like
        runs = {k: v for k, v in runs.items() if "straggler" in k[0]}
    runs = one_comparison(runs, lambda c: model_of(c, "straggler", "servers"),
                          lambda k, c: k[0])
    if not runs:
        return None
    labels = labels_of(runs)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.8))
    for run_key, steps in sorted(runs.items(), key=lambda kv: labels[kv[0]]):
        name = labels[run_key]
        by_step = defaultdict(list)
        for s in steps:
            by_step[s["step"]].append(s)
        order = sorted(by_step)
        clocks = defaultdict(float)                     # each rank's own elapsed time
        wall = []
        for st in order:
            for s in by_step[st]:
                clocks[s["rank"]] += s["step_time_s"]
            wall.append(max(clocks[s["rank"]] for s in by_step[st]))
        loss = [by_step[st][0]["loss"] for st in order]
        a1.plot(order, loss, label=name)
        a2.plot(wall, loss, label=name)
        stale = [s["staleness"] for s in steps if s.get("staleness") is not None]
        if stale:
            a3.hist(stale, bins=range(0, max(stale) + 2), alpha=0.5, label=name, align="left")
    a1.set(xlabel="step", ylabel="global-batch loss",
           title=f"loss against step ({describe(steps[0]['config'])})")
    a2.set(xlabel="wall-clock (s)", title="loss against time")
    a3.set(xlabel="staleness (steps)", ylabel="steps", title="staleness of pulled parameters")
    for ax in (a1, a2, a3):
        ax.legend(fontsize=7)
    return save(fig, out_dir, "ps_consistency")


def crossovers(records, out_dir):
    """(g) experiments.simulate: predicted all-reduce time against ranks on a
    two-level cluster, one panel per message size."""
    rows = [r for r in records if r.get("kind") == "simulation"]
    if not rows:
        return None
    sizes = sorted({r["bytes"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.8), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for algo in sorted({r["algo"] for r in rows}):
            pts = sorted((r["P"], r["time_s"]) for r in rows
                         if r["bytes"] == n and r["algo"] == algo)
            ax.plot([p for p, _ in pts], [1e3 * t for _, t in pts], "-", label=algo)
        ax.set(xscale="log", yscale="log", xlabel="ranks P", ylabel="predicted time (ms)",
               title=f"{n / 2**20:g} MiB")
    axes[0][0].legend(fontsize=7)
    return save(fig, out_dir, "crossovers")
