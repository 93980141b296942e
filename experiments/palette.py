"""How every figure looks and is written: one colour per algorithm or sync, measured
against predicted, size axes in binary units, the spread over rounds, and the files.

    colour_of("ring") == colour_of("ring over torch") == colour_of("ring measured")
    ax.plot(x, y, label="ring measured", **MEASURED, color=colour_of("ring"))
    ax.plot(x, y, label="ring predicted", **PREDICTED, color=colour_of("ring"))
    size_axis(ax.xaxis, sizes)                # ticks 4K, 16K, ... 64M, labelled like the bench
    med, low, high = spread(samples)          # median and min-max: the error bar
    save(fig, "results/demo/plots", "scaling", note="how to read it")   # PNG, SVG, JSON

A reader who learns that the ring is blue in one figure finds it blue in every
other one and in the report's tables (experiments/report.py shows the swatches):
the colour belongs to the name, never to its position in a legend.
"""
import argparse
import json
import os
import statistics
import textwrap
import zlib

import matplotlib

matplotlib.use("Agg")                       # files only; no display on a cluster node
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.category import UnitData  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.container import BarContainer, ErrorbarContainer  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

from allreduce.units import format_size  # noqa: E402

from .records import most_common, read_jsonl  # noqa: E402

# The tab10 colours, each given to one name for good.  The three consistency models of
# the parameter server are told apart (ps alone is ps/bsp, its default).
COLOURS = {
    "ring": "tab:blue", "ps/bsp": "tab:orange", "tree": "tab:green", "torch": "tab:red",
    "halving_doubling": "tab:purple", "hierarchical": "tab:brown", "hybrid": "tab:pink",
    "mpi": "0.35", "mpi-raw": "black", "auto": "tab:olive", "shm": "tab:cyan",
    "nccl": "gold", "local": "0.6", "ps/ssp": "#c9a000", "ps/asp": "#8b1a1a",
}
COLOURS["ps"] = COLOURS["psrv"] = COLOURS["ps/bsp"]

# The parts of a bar or a timeline, the same in every figure that shows them: pale,
# so that a part is never mistaken for the algorithm of the same hue.
PARTS = {"compute": "#8fbbd9", "forward": "#8fbbd9", "backward": "#f5b971",
         "exposed comm": "#ef9a9a", "comm": "#ef9a9a", "dp-comm": "#f6c9c9", "idle": "0.85",
         "params": "#8fbbd9", "grads": "#f5b971", "optimizer": "#9fd8a8",
         "activations": "#c7a9dc"}

# A name no table knows still keeps one colour from figure to figure: from its letters.
SPARE = ("#17becf", "#9467bd", "#bcbd22", "#e377c2", "#8c564b", "#7f7f7f")

MEASURED = {"linestyle": "-", "marker": "o", "markersize": 4}
PREDICTED = {"linestyle": "--", "marker": None, "alpha": 0.8}


def base_name(label):
    """The algorithm or sync a label is about: "ring over torch", "ring measured",
    "auto→tree", "hierarchical (tree/ring, 2 a node)", "ps/ssp(3) +straggler",
    "ps(S=4)" -> ring, ring, auto, hierarchical, ps/ssp, ps."""
    name = label.split("→")[0].split(" (")[0].split("(")[0].split(" ")[0]
    return name.strip()


def colour_of(label):
    name = base_name(label)
    for key in (name, name.split("/")[0]):
        if key in COLOURS:
            return COLOURS[key]
    return SPARE[zlib.crc32(name.encode()) % len(SPARE)]


def size_axis(axis, sizes):
    """A log2 axis over the byte counts `sizes`, a tick at every power of 4 (at most
    about eight: 4K 16K 64K ... 64M), labelled 4K, 1M, 64M rather than 10^6."""
    axis.axes.set_xscale("log", base=2) if axis.axis_name == "x" else \
        axis.axes.set_yscale("log", base=2)
    lo, hi = min(sizes), max(sizes)
    exponents = range(max(lo, 1).bit_length() - 1, hi.bit_length() + 1)
    ticks = [1 << e for e in exponents if e % 2 == 0 and lo / 2 <= 1 << e <= hi * 2]
    while len(ticks) > 8:
        ticks = ticks[::2]
    axis.set_major_locator(FixedLocator(ticks or [lo]))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda x, _: format_size(x)))


def spread(samples, kind="minmax"):
    """(median, low, high) of a list of samples: min-max (a few rounds) or the
    interquartile range (many steps, where min-max would only show the outliers)."""
    samples = sorted(samples)
    med = statistics.median(samples)
    if len(samples) < 2:
        return med, med, med
    if kind == "iqr":
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return med, q1, q3
    return med, samples[0], samples[-1]


def measured_and_predicted(ax, measured, predicted=None, suffix=""):
    """{label: {x: [samples]}} as measured lines (`label` + `suffix`): the medians, solid
    with markers, with min-max error bars where some point has more than one sample;
    each followed by its prediction {label: {x: y}} where `predicted` has one, dashed."""
    styles, predicted = styles_of(measured), predicted or {}
    for label, at in sorted(measured.items()):
        xs, colour = sorted(at), styles[label]["color"]
        points = [spread(at[x]) for x in xs]
        med = [m for m, _, _ in points]
        ax.plot(xs, med, label=label + suffix, **{**MEASURED, **styles[label]})
        if any(hi > lo for _, lo, hi in points):
            ax.errorbar(xs, med, yerr=[[m - lo for m, lo, _ in points],
                                       [hi - m for m, _, hi in points]],
                        fmt="none", ecolor=colour, elinewidth=1, capsize=2)
        if predicted.get(label):
            xs = sorted(predicted[label])
            ax.plot(xs, [predicted[label][x] for x in xs], color=colour,
                    label=f"{label} predicted", **PREDICTED)


def cores_of(records):
    """", 2 cores": the core count of the machine the records ran on, for a title."""
    cores = most_common(r["provenance"]["cores"] for r in records
                        if (r.get("provenance") or {}).get("cores"))
    return f", {cores} cores" if cores else ""


MARKERS = ("o", "s", "^", "D", "v", "P")
DASHES = ("--", "-.", ":", (0, (5, 1, 1, 1)))


def styles_of(labels, kind="marker", choices=MARKERS):
    """{label: {"color", kind}}: each label its name's colour; labels that share a colour
    (two hierarchical compositions, ring and ring over torch) get other markers, or
    other `choices` of another `kind` of style (dashes: "linestyle", DASHES)."""
    seen, out = {}, {}
    for label in sorted(labels):
        colour = colour_of(label)
        out[label] = {"color": colour, kind: choices[seen.get(colour, 0) % len(choices)]}
        seen[colour] = seen.get(colour, 0) + 1
    return out


def save(fig, out_dir, name, note=""):
    """NAME.png, NAME.svg and NAME.json: the numbers the figure draws (figure_data).
    `note`: a line or two under the axes saying how to read them."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + ".png")
    if note:                     # wrapped to the figure: about 16 characters of 8 pt an inch
        note = "\n".join(textwrap.fill(line, int(16 * fig.get_figwidth()))
                         for line in note.splitlines())
        lines = note.count("\n") + 1
        fig.text(0.01, 0.01, note, fontsize=8, ha="left", va="bottom", color="0.25")
        fig.tight_layout(rect=(0, (0.1 + 0.15 * lines) / fig.get_figheight(), 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.savefig(os.path.join(out_dir, name + ".svg"))
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(figure_data(fig), f, indent=1)
    plt.close(fig)
    return path


def two_panels():
    """A figure of two gridded panels side by side: what a setting buys beside what it costs."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, axes


def timeline_legend(ax, *more):
    """Beside a timeline: the forward and backward patches, then `more` handles."""
    ax.legend(handles=[Patch(color=PARTS[p], label=p) for p in ("forward", "backward")] +
              list(more), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))


def figure_main(argv, module, doc, inputs, draw, nothing):
    """The command line of a module that draws one figure: INPUT ... OUT_DIR and --help
    (`doc`, its docstring).  `inputs`: (name, help) of each input file, handed to
    draw(*paths, out_dir) in that order.  Prints the PNG's path and exits 0, or prints
    `nothing` and exits 1 when the inputs hold nothing to draw."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, what in inputs:
        p.add_argument(name, help=what)
    p.add_argument("out_dir", metavar="OUT_DIR", help="where NAME.png, .svg and .json go")
    a = vars(p.parse_args(argv))
    path = draw(*(a[name] for name, _ in inputs), a["out_dir"])
    print(path or nothing)
    return 0 if path else 1


def records_main(argv, module, doc, figure, nothing):
    """figure_main of a figure of strategies.train's --jsonl: figure(records, out_dir)."""
    return figure_main(argv, module, doc, [("records", "strategies.train's --jsonl of the runs")],
                       lambda path, out_dir: figure(read_jsonl(path), out_dir), nothing)


def figure_data(fig):
    """Per panel: titles, labels, tick labels, texts, each labelled line's colour and
    points, each error bar's low and high, and each bar's label, x (the category for a
    bar chart), bottom and height.
    A reader gets the value behind a bar without measuring pixels; a test checks what
    was drawn, not what was meant."""
    panels = []
    for ax in fig.axes:
        categories = isinstance(ax.xaxis.units, UnitData)      # bars over names, not numbers
        ticks = dict(zip(ax.get_xticks(), (t.get_text() for t in ax.get_xticklabels())))

        def where(patch):
            centre = patch.get_x() + patch.get_width() / 2
            return ticks.get(round(centre), centre) if categories else float(centre)
        panels.append({
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "left_title": ax.get_title(loc="left"), "right_title": ax.get_title(loc="right"),
            "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
            "texts": [t.get_text() for t in ax.texts],
            "lines": [{"label": line.get_label(), "color": to_hex(line.get_color()),
                       "x": [float(x) for x in line.get_xdata()],
                       "y": [float(y) for y in line.get_ydata()]} for line in ax.get_lines()
                      if not line.get_label().startswith("_")],        # not error-bar caps
            "errorbars": [{"x": [float(s[0][0]) for s in c.lines[2][0].get_segments()],
                           "low": [float(s[0][1]) for s in c.lines[2][0].get_segments()],
                           "high": [float(s[1][1]) for s in c.lines[2][0].get_segments()]}
                          for c in ax.containers if isinstance(c, ErrorbarContainer)
                          and c.lines[2]],
            "bars": [{"label": c.get_label(), "x": [where(p) for p in c.patches],
                      "bottom": [float(p.get_y()) for p in c.patches],
                      "height": [float(p.get_height()) for p in c.patches],
                      "width": [float(p.get_width()) for p in c.patches]}
                     for c in ax.containers if isinstance(c, BarContainer)]})
    return panels
