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
  (e) pipeline_gantt         strategies.train --pp --trace: GPipe, 1F1B, interleaved; bubble
  (f) ps_consistency         BSP/SSP/ASP: loss, each worker's clock, the server's updates
  (g) crossovers             experiments.simulate: predicted time against ranks, two levels
The collectives' figures (a), (c), (g) are here; training's (b), (d)-(f) in
experiments/training_plots.py.  Colours, the measured/predicted line styles, size
axes, error bars and the files written come from experiments/palette.py, the same
in every figure: measured is solid with markers (the median, bars over rounds where
the records hold several), predicted dashed.
"""
from collections import defaultdict

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullLocator

from allreduce.units import format_size

from . import fidelity
from .palette import DASHES, PREDICTED, cores_of, measured_and_predicted, save, size_axis, styles_of
from .records import allreduce_rows


def rounds_us(r):
    """A bench record's time samples (us): its rounds where it keeps them (round_us),
    else its one median."""
    return [t for t in r.get("round_us") or [r["time_us"]] if t > 0]


def busbw_vs_size(records, out_dir):
    """(a) busbw (nccl-tests) against message size, one line per algorithm, at the
    smallest world size measured without link emulation; memcpy is the ceiling."""
    rows = [r for r in allreduce_rows(records) if not fidelity.emulated(r)]
    if not rows:
        return None
    P = min(r["world_size"] for r in rows)
    rows = [r for r in rows if r["world_size"] == P]
    by_variant = defaultdict(lambda: defaultdict(list))     # busbw of every round or record
    for r in rows:
        by_variant[r["variant"]][r["bytes"]] += [r["busbw_gbps"] * r["time_us"] / t
                                                 for t in rounds_us(r)]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    measured_and_predicted(ax, by_variant)
    cal = fidelity.calibration_of(records)
    if cal and cal.get("memcpy_gbps"):
        ax.axhline(cal["memcpy_gbps"], color="k", ls=":", lw=1,
                   label=f"memcpy {cal['memcpy_gbps']:.1f} GB/s (roofline)")
    size_axis(ax.xaxis, [r["bytes"] for r in rows])
    ax.set(xlabel="message size", ylabel="busbw (GB/s)",
           title=f"all-reduce bus bandwidth, P={P}, {rows[0]['dtype']}{cores_of(rows)}")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "busbw_vs_size", note=measured_note(by_variant))


def measured_note(by_variant):
    """What a measured line and its bars are, said under the figure."""
    many = any(len(s) > 1 for at in by_variant.values() for s in at.values())
    return "measured: the median of each point's " + (
        "rounds; bars: min-max over the rounds" if many else
        "record (the records keep no rounds, so no error bars)")


def scaling(records, out_dir):
    """(c) all-reduce time against the number of ranks at one size: measured
    points, the cost model's prediction as lines (calibrated, experiments.calibrate)."""
    rows = [r for r in allreduce_rows(records) if not fidelity.emulated(r)]
    sizes = {r["bytes"] for r in rows}
    if not rows or len({r["world_size"] for r in rows}) < 2:
        return None
    n = max(s for s in sizes if len({r["world_size"] for r in rows if r["bytes"] == s}) >= 2)
    rows = [r for r in rows if r["bytes"] == n]
    machine = fidelity.machine_of(records)
    by_variant, predicted = defaultdict(lambda: defaultdict(list)), {}
    for r in rows:                                            # ranks -> ms of every round
        by_variant[r["variant"]][r["world_size"]] += [t / 1e3 for t in rounds_us(r)]
    for variant, at in by_variant.items():
        if machine and not variant.endswith(" over torch"):   # the model has MPI's alpha-beta
            first = next(r for r in rows if r["variant"] == variant)
            pred = {p: fidelity.predict({**first, "world_size": p}, machine) for p in at}
            if None not in pred.values():
                predicted[variant] = {p: 1e3 * x for p, x in pred.items()}
    fig, ax = plt.subplots(figsize=(8.6, 4.4))
    measured_and_predicted(ax, by_variant, predicted, " measured")
    ranks = sorted({r["world_size"] for r in rows})
    cores = machine.cores if machine else None
    if cores and ranks[-1] > cores:
        # Ranks beyond the cores take turns on them: the measured times include
        # waiting for the scheduler, which the model's P / cores stretch omits.
        ax.axvspan(cores + 0.5, ranks[-1] + 0.5, color="0.9", zorder=0,
                   label=f"P > {cores} cores: ranks share cores")
    ax.set(xlabel="ranks P", ylabel="time (ms)", xticks=ranks,
           title=f"all-reduce of {format_size(n)}, {rows[0]['dtype']}, "
                 f"P = {ranks[0]}..{ranks[-1]}{cores_of(rows)}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))   # beside: no point hidden
    return save(fig, out_dir, "scaling", note="solid with markers: " + measured_note(by_variant) + (
        "\ndashed: predicted by the cost model from this machine's calibration" if machine else
        "\nno calibration record: no predictions (add an experiments.calibrate run to the sweep)"))


def crossovers(records, out_dir, cluster=""):
    """(g) experiments.simulate: predicted all-reduce time against ranks on a
    two-level cluster (`cluster` says which, for the title), one panel per size."""
    rows = [r for r in records if r.get("kind") == "simulation"]
    if not rows:
        return None
    sizes = sorted({r["bytes"] for r in rows})
    # one colour a name: ps with 1, 4 and 16 servers share ps's, each its own dashes
    styles = styles_of({r["algo"] for r in rows}, "linestyle", DASHES)
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.4 * len(sizes), 4.2), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for algo, style in sorted(styles.items()):
            pts = sorted((r["P"], r["time_s"]) for r in rows
                         if r["bytes"] == n and r["algo"] == algo)
            ax.plot([p for p, _ in pts], [1e3 * t for _, t in pts],
                    label=f"{algo} predicted", **{**PREDICTED, **style})
        ranks = sorted({r["P"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="ranks P", ylabel="predicted time (ms)",
               xticks=ranks[::max(1, len(ranks) // 5)], title=f"all-reduce of {format_size(n)}")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle("predicted by the cost model, not measured (every curve dashed)"
                 + (f"\n{cluster}" if cluster else ""), fontsize=10)
    return save(fig, out_dir, "crossovers", note=(
        "where two curves cross, the faster algorithm changes: the tree leads while latency "
        "dominates, the ring once bandwidth does; hierarchical keeps most bytes inside a node."))
