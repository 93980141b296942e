"""The planner's figure: predicted step time against memory per rank, the Pareto front marked.

    plan_frontier(records, "results/plan/plots")      # -> plan_frontier.png (+ .svg, .json)

It reads the planner's records (kind "plan", experiments.plan --jsonl) and
nothing else, as every figure reads records (experiments/palette.py's
conventions: save() writes the PNG, the SVG and the numbers drawn).  Each
layout that fits is a dot; the front, the layouts no other beats in both step
time and memory, is joined by a line and its points labelled (a dozen, none on top of another), and
the fastest starred: the labels name dp, pp, tp, ZeRO, the micro-batch size and
recomputation (step.Layout.label).  The usable memory is the dashed line
beyond which the layouts that do not fit lie (drawn as crosses).
"""
from operator import itemgetter

import matplotlib.pyplot as plt

from experiments.palette import save

from .cluster import GIB
from .search import pareto
from .step import Layout

MAX_LABELS = 12        # of the front, the fastest first


def label_of(r):
    return Layout(**{k: r[k] for k in Layout.__dataclass_fields__}).label()


def plan_frontier(records, out_dir, usable_bytes=None):
    """The figure's path, or None when the records hold no layout that fits."""
    plans = [r for r in records if r.get("kind") == "plan"]
    fits = [r for r in plans if r.get("fits")]
    if not fits:
        return None
    out = [r for r in plans if not r.get("fits") and r["step_s"] <= 3 * max(
        f["step_s"] for f in fits)]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.grid(alpha=0.3)
    ax.scatter([r["mem_bytes"] / GIB for r in fits], [r["step_s"] for r in fits], s=10,
               color="0.6", label=f"{len(fits)} layouts that fit")
    if out:
        ax.scatter([r["mem_bytes"] / GIB for r in out], [r["step_s"] for r in out], s=10,
                   marker="x", color="0.8", label="out: too much memory")
    front = pareto(fits, itemgetter("step_s"), itemgetter("mem_bytes"))
    ax.plot([r["mem_bytes"] / GIB for r in front], [r["step_s"] for r in front], "-o",
            color="black", markersize=4, label="Pareto front")
    fastest = min(fits, key=lambda r: (r["step_s"], r["mem_bytes"]))
    ax.scatter([fastest["mem_bytes"] / GIB], [fastest["step_s"]], marker="*", s=160,
               color="tab:red", zorder=3, label="fastest")
    # the front's points labelled to their right, those too close below a label skipped
    gap, last = (front[-1]["step_s"] - front[0]["step_s"]) / 25, -float("inf")
    for r in front[:MAX_LABELS]:
        if r["step_s"] - last >= gap:
            ax.annotate(label_of(r), (r["mem_bytes"] / GIB, r["step_s"]), fontsize=7,
                        xytext=(6, -3), textcoords="offset points")
            last = r["step_s"]
    if usable_bytes:
        ax.axvline(usable_bytes / GIB, color="0.3", linestyle="--", lw=1,
                   label="usable memory a GPU")
    first = fits[0]
    ax.set(xlabel="memory per rank (GiB, the fullest rank)", ylabel="predicted step (s)",
           title=f"every layout on {first['world']} GPUs ({first['cluster']})")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "plan_frontier", note=(
        "Predicted by the planner's model, not measured.  Left and low is better: the front "
        "holds the layouts no other beats in both; a label reads dp pp tp, ZeRO stage (z), "
        "micro-batch size (b), chunks (v, interleaved) and recomputation."))
