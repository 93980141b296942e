"""The recompute figure: one step's timeline with and without --recompute, from --trace.

    recompute_gantt({"plain": events, "--recompute": events}, "docs/gallery")
        -> docs/gallery/recompute_gantt.png (+ .svg, .json)

The traces are strategies.train's own --trace files (Chrome trace JSON), of two runs
that differ in --recompute only (docs/memory.md):

    .venv/bin/python -m strategies.train --sync local --model gpt --layers 4 --d-model 128 \\
        --seq-len 64 --global-batch 16 --steps 4 --threads 1 --no-progress \\
        --trace results/plain.trace.json
    (the same again with --recompute --trace results/recompute.trace.json)
    .venv/bin/python -m experiments.recompute_gantt results/plain.trace.json \\
        results/recompute.trace.json docs/gallery

A row per run, the last step of rank 0: forward, backward and (drawn over the
backward that contains them) the recompute spans, each block's forward run again
(Chen et al. 2016).  The row's title gives the recompute share of the backward.
"""
import json

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from .palette import PARTS, figure_main, save, timeline_legend

RECOMPUTE = "#8c564b"


def last_step(events):
    """Rank 0's events from the first forward of its last step on (the plain loop names
    its spans "forward 7" or, with --grad-accum, "forward 7.0")."""
    forwards = [e for e in events if e.get("cat") == "forward"]
    if not forwards:
        return []
    step = lambda e: int(e["name"].split()[-1].split(".")[0])      # noqa: E731
    last = max(map(step, forwards))
    start = min(e["ts"] for e in forwards if step(e) == last)
    return [e for e in events if e["ts"] >= start]


def recompute_gantt(traces, out_dir):
    """{label: Chrome-trace events} -> the figure's path, or None with nothing to draw."""
    rows = {}
    for label, events in traces.items():
        mine = [e for e in last_step([e for e in events if e.get("ph") == "X"
                                      and e.get("pid", 0) == 0])
                if e.get("cat") in ("forward", "backward", "recompute")]
        if mine:
            rows[label] = mine
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.8 * len(rows)))
    for y, (label, events) in enumerate(rows.items()):
        t0 = min(e["ts"] for e in events)
        for e in sorted(events, key=lambda e: e["cat"] == "recompute"):   # recompute on top
            colour = RECOMPUTE if e["cat"] == "recompute" else PARTS[e["cat"]]
            height = 0.5 if e["cat"] == "recompute" else 0.8
            ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=height,
                    color=colour, edgecolor="0.3", lw=0.5)
        backward = sum(e["dur"] for e in events if e["cat"] == "backward")
        again = sum(e["dur"] for e in events if e["cat"] == "recompute")
        ax.text(0, y - 0.45, f"recompute {again / backward:.0%} of backward" if backward
                else "", fontsize=8, va="bottom")
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel("time (ms) since the step's first forward")
    timeline_legend(ax, Patch(color=RECOMPUTE, label="recompute (inside backward)"))
    ax.set_title("activation recomputation: each block's forward again, during backward",
                 fontsize=10)
    return save(fig, out_dir, "recompute_gantt", note=(
        "The last step of rank 0 of each run.  With --recompute a block keeps only its "
        "input; backward re-runs its forward (dark spans) just before its gradients."))


def main(argv=None):
    def draw(plain, recomputed, out_dir):
        traces = {label: json.load(open(path))["traceEvents"]
                  for label, path in (("plain", plain), ("--recompute", recomputed))}
        return recompute_gantt(traces, out_dir)
    return figure_main(argv, "experiments.recompute_gantt", __doc__,
                       [("plain", "--trace file of the run without --recompute"),
                                        ("recomputed", "--trace file of the run with it")],
                       draw, "nothing to draw")


if __name__ == "__main__":
    raise SystemExit(main())
