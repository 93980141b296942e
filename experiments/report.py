"""Every plot the results have data for, and a one-page report linking them.

    python -m experiments.report results/demo        # -> results/demo/report.md, report.html,
                                                     #    results/demo/plots/*.png, *.svg
    python -m experiments.report results/demo --cluster-ranks-per-node 4 --inter-gbps 25
    python -m experiments.report results/demo --gallery docs/gallery \
        --screenshot docs/gallery/report.png         # the README's pictures (make gallery)

Reads RESULTS_DIR/records.jsonl and points.jsonl (experiments.sweep writes them),
fits nothing itself: predictions come from the sweep's calibration record
(experiments.calibrate) through the cost model, shown beside the measurements
with their error.  Also writes the simulation records it plots (simulation.jsonl).
Points that ran on a cluster (experiments/launchers.py) have a section of their
own: a busbw figure per cluster setting, the bytes on each host's link beside
theory, and training per setting; figures (a)-(f) and the cost model's
comparison are drawn from this host's points only.

Every figure sits in report.html with a line saying what to look at.  --screenshot
draws the page with a headless Chromium (Debian's `chromium` package) into a PNG;
without one it says so and the report is written all the same.
"""
import argparse
import html
import json
import os
import shutil
import sys
from collections import Counter

from allreduce.units import format_size
from matplotlib.colors import to_hex       # "tab:blue", "0.35" as CSS

from . import cluster_figures, fidelity, plots, simulate, training_plots
from .palette import COLOURS, cores_of
from .records import describe, load, model_of, one_comparison, read_jsonl
from .screenshot import screenshot

FIGURES = [  # (function, title, what to look at, what produces its records)
    (plots.busbw_vs_size, "(a) all-reduce busbw against message size",
     "Which algorithm leads below 64K, where latency rules, and which from 1M, where "
     "bandwidth does; how close the best comes to memcpy's roofline.",
     "an allreduce.bench [[run]]"),
    (training_plots.strategy_breakdown, "(b) throughput and step-time breakdown per strategy",
     "How much of each step is exposed communication or waiting, not compute: that share "
     "is what a faster --sync can win back.",
     "strategies.train [[run]]s with several --sync"),
    (plots.scaling, "(c) scaling with ranks, measured and predicted",
     "How far each measured line (solid) sits from its prediction (dashed), and how the "
     "gap opens once ranks outnumber the cores (grey).",
     "allreduce.bench at two or more world sizes, and experiments.calibrate"),
    (training_plots.zero_memory, "(d) memory per rank by ZeRO stage",
     "Each stage removes one part from the rank: optimizer state at ZeRO-1, gradients at "
     "2, parameters at 3; activations stay.",
     "strategies.train [[run]]s on the grid (dp = 2) with zero = [0, 1, 2, 3]"),
    (training_plots.pipeline_gantt, "(e) pipeline Gantt chart, GPipe, 1F1B and interleaved 1F1B",
     "The hatched bubble is about as large in GPipe and 1F1B; 1F1B holds fewer "
     "micro-batches' activations at once (the count on the right); the interleaved "
     "schedule's v chunks a rank shrink the bubble.",
     "strategies.train [[run]]s with pp = 2, schedule = [\"gpipe\", \"1f1b\"] (and "
     "\"interleaved\" with virtual_stages = 2), trace = true"),
    (training_plots.ps_consistency, "(f) parameter-server consistency with a straggler",
     "BSP's clocks move in lockstep with staleness 0; under SSP and ASP the fast worker "
     "runs ahead and the straggler's pushes grow stale.",
     "strategies.train --sync ps with bsp/ssp/asp and a straggler"),
    (plots.crossovers, "(g) simulated crossovers on a two-level cluster",
     "Where the curves cross: the P and size at which the fastest algorithm changes "
     "(predicted, not measured).",
     "experiments.simulate (this report runs it)"),
]


def pipeline_traces(d, points):
    """({"gpipe, m=4": Chrome-trace events}, a few words on the model) of the pipeline
    points (pp > 1) that ran with trace = true: of one model, pipeline depth and batch,
    the group with the most schedules.  A traced data-parallel run has forward and
    backward spans too, but no stages: it is not a pipeline schedule."""
    traced = {p.get("point"): [p] for p in points if p.get("status") == "ok"
              and p.get("config", {}).get("trace") and p.get("config", {}).get("pp", 1) > 1
              and os.path.exists(os.path.join(d, "raw", f"{p.get('point')}.trace.json"))}
    chosen = one_comparison(traced, lambda c: model_of(c, "pp", "tp", "zero"),
                            lambda k, c: (c.get("schedule"), c.get("micro_batches", 1),
                                          c.get("virtual_stages", 1)))
    traces, about = {}, ""
    for point, (p,) in chosen.items():
        cfg = p["config"]
        with open(os.path.join(d, "raw", f"{point}.trace.json")) as f:
            events = json.load(f).get("traceEvents", [])
        v = cfg.get("virtual_stages", 1)
        traces[f"{cfg.get('schedule', '?')}, m={cfg.get('micro_batches', 1)}" +
               (f", v={v}" if v > 1 else "")] = events
        about = f"{describe(cfg)}{cores_of([p])}, p={cfg.get('pp')} stages"
    return traces, about


def render(blocks, fmt):
    out = []
    for kind, *a in blocks:
        if kind == "h":
            out.append(f"{'#' * a[0]} {a[1]}\n" if fmt == "md" else
                       f"<h{a[0]}>{html.escape(a[1])}</h{a[0]}>")
        elif kind == "p":
            out.append(a[0] + "\n" if fmt == "md" else f"<p>{html.escape(a[0])}</p>")
        elif kind == "img":
            out.append(f"![{a[1]}]({a[0]})\n" if fmt == "md" else
                       f'<p><a href="{a[0]}"><img src="{a[0]}" alt="{html.escape(a[1])}" '
                       f'style="max-width:100%"></a></p>')
        elif kind == "figure":         # title, image, what to look at; two abreast in HTML
            title, path, caption = a
            out.append(f"### {title}\n\n![{title}]({path})\n\n{caption}\n" if fmt == "md" else
                       f'<div class=fig><h3>{html.escape(title)}</h3><a href="{path}"><img '
                       f'src="{path}" alt="{html.escape(title)}"></a><p>{html.escape(caption)}'
                       f'</p></div>')
        elif kind == "swatches":       # the colours every figure gives these names
            out.append("Colours: " + ", ".join(f"{name} {colour}" for name, colour in a[0])
                       + "\n" if fmt == "md" else "<p>Colours, the same in every figure: " +
                       " ".join(f'<span style="white-space:nowrap"><span style="display:'
                                f'inline-block;width:1em;height:1em;background:'
                                f'{to_hex(colour)};vertical-align:middle"></span> '
                                f'{html.escape(name)}</span>' for name, colour in a[0])
                       + "</p>")
        elif kind == "table":
            head, rows = a
            if fmt == "md":
                out.append("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
                out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
                out.append("")
            else:
                out.append("<table border=1 cellpadding=3><tr>" + cells(head, "th") + "</tr>" +
                           "".join(f"<tr>{cells(r, 'td')}</tr>" for r in rows) + "</table>")
    body = "\n".join(out)
    if fmt == "html":
        body = f"<!doctype html><meta charset=utf-8><title>topolab report</title>" \
               f"<style>{STYLE}</style><body>{body}</body>"
    return body


STYLE = ("body{font-family:sans-serif;max-width:1240px;margin:1em auto}"
         ".fig{display:inline-block;width:49%;vertical-align:top;margin-bottom:1em}"
         ".fig img{max-width:98%}.fig h3{margin:.3em 0}.fig p{margin:.2em 1em 0 0}"
         "table{border-collapse:collapse;font-size:90%}")


def cells(row, tag):
    return "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in row)


def provenance_block(records, points):
    prov = [r.get("provenance", {}) for r in records + points if r.get("provenance")]
    if not prov:
        return [("p", "No records yet: run `python -m experiments.sweep FILE.toml` first.")]
    loads = [p["loadavg"][0] for p in prov if p.get("loadavg")]
    status = Counter(p.get("status") for p in points)
    rows = [(k, ", ".join(sorted({str(p.get(k)) for p in prov})))
            for k in ("commit", "host", "mpi", "torch", "cores")]
    rows.append(("1-min load average at launch", f"{min(loads):.1f} .. {max(loads):.1f}"
                 if loads else "?"))
    envs = {" ".join(f"{k}={v}" for k, v in p.get("env", {}).items()) for p in prov}
    rows.append(("MPI and topolab settings", "; ".join(sorted(e or "defaults" for e in envs))))
    rows.append(("points", ", ".join(f"{v} {k}" for k, v in status.items()) or "?"))
    blocks = [("table", ["provenance", "value"], rows)]
    for p in points:
        if p.get("status") != "ok" and not any(q.get("point") == p["point"] and
                                               q.get("status") == "ok" for q in points):
            blocks.append(("p", f"FAILED point {p['point']} ({p['command']} "
                                f"{p.get('config')}): {p['status']}, log {p['log']}"))
    return blocks


def fidelity_blocks(records):
    machine = fidelity.machine_of(records)
    if machine is None:
        return [("p", "No calibration record: add an experiments.calibrate [[run]] to the "
                      "sweep to see predictions.")]
    blocks = [("p", f"Calibrated on this machine: alpha {machine.alpha * 1e6:.1f} us, "
                    f"1/beta {1e-9 / machine.beta:.2f} GB/s, 1/gamma {1e-9 / machine.gamma:.2f}"
                    f" GB/s, cores {machine.cores}" + (
                        f"; psrv alpha {machine.ps_alpha * 1e6:.0f} us, 1/beta "
                        f"{1e-9 / machine.ps_beta:.2f} GB/s at >= 1 MiB" if machine.ps_beta
                        else "") + ".")]
    cal = fidelity.calibration_of(records)
    if cal.get("loadavg"):
        blocks.append(("p", f"Load during calibration: 1-min load average {cal['loadavg'][0]:.1f}"
                            f" on {cal.get('cores')} cores. Above the core count, other "
                            "processes take turns with the measured ones and times vary by 2x "
                            "from run to run: read the errors with that in mind."))
    rows = fidelity.compare(records, machine)
    summ = fidelity.summary(rows)
    if summ:
        blocks.append(("p", "Fidelity target: ring and PS within "
                            f"{fidelity.TARGET:.0%} at >= 1 MiB (no emulated link). "
                            "The fair test is the interleaved rows: calibrate --verify timed "
                            "them in the same rounds as its probes. The sweep's rows were "
                            "measured minutes later, and this machine's speed may have moved "
                            "since; rows with more MPI ranks than cores measure the "
                            "scheduler as much as the algorithm."))
        spread = fidelity.drift(cal)
        if spread:
            blocks.append(("p", "How far this machine moved by itself during the calibration: "
                                "the ring's median per round took " + "; ".join(
                                    f"{format_size(b)} {lo * 1e3:.2f}-{hi * 1e3:.2f} ms "
                                    f"(slowest {hi / lo - 1:+.0%})" for b, lo, hi, _ in spread)
                           + f", over {spread[0][3]} rounds. A point measured minutes away "
                             "from the calibration cannot be predicted more closely than that."))
        blocks.append(("table", ["model", "measured", "points >= 1 MiB", "median |error|",
                                 "max |error|", f"within {fidelity.TARGET:.0%}"],
                       [(k, src, n, f"{med:.0%}", f"{mx:.0%}", f"{ok:.0%}")
                        for (k, src), (n, med, mx, ok) in summ.items()]))
    blocks.append(("table", ["algorithm", "P (or workers/servers)", "size", "measured",
                             "emulated link",
                             "measured ms", "predicted ms", "error"],
                   [(r["what"], r["P"], format_size(r["bytes"]), r["source"],
                     "yes" if r["emulated"] else "",
                     f"{r['measured_s'] * 1e3:.3f}", f"{r['predicted_s'] * 1e3:.3f}",
                     f"{r['error']:+.0%}") for r in sorted(rows, key=lambda r: (
                         r["what"], str(r["P"]), r["source"], r["emulated"], r["bytes"]))]))
    return blocks


def cluster_blocks(records, d):
    """(blocks, PNG paths) of the points that ran on a cluster; nothing when none did."""
    settings = cluster_figures.cluster_settings(records)
    if not settings:
        return [], []
    blocks = [("h", 2, "Points on a cluster"),
              ("p", "Each point ran on a cluster of its own: launcher \"emulated\" is "
                    "network namespaces on this machine, each host's link shaped by tc "
                    "(experiments/cluster); the dotted line is that link's rate, which the "
                    "ring's busbw cannot pass; dashed lines, where the records carry "
                    "predicted_us, are a cost model's predictions.")]
    written = []
    for setting in settings:
        path = cluster_figures.busbw_on_cluster(records, os.path.join(d, "plots"), setting)
        if path:
            written.append(path)
            blocks.append(("img", os.path.relpath(path, d),
                           f"busbw, {cluster_figures.setting_name(setting)}"))
            blocks.append(("p", "Look at where the ring's line meets the dotted link rate, "
                                "and at the sizes where another algorithm beats it."))
    blocks.append(("h", 3, "Bytes on each host's link, measured and in theory"))
    blocks.append(("p", "Measured: the kernel's counters of each host's link during the point, "
                        "less 66 bytes of TCP/IP headers a packet; MPI's own messages and the "
                        "launcher's control traffic are in it. Theory: "
                        "allreduce.theory.host_link_bytes for every all-reduce the bench ran "
                        "(checked call, warm-up, timed iterations); none for mpi (its "
                        "schedule is the library's) or training."))
    blocks.append(("table", *cluster_figures.wire_table(records)))
    head, rows = cluster_figures.training_table(records)
    if rows:
        blocks += [("h", 3, "Training on the clusters"), ("table", head, rows)]
    predicted = cluster_figures.predicted_table(records)
    if predicted:
        blocks += [("h", 3, "All-reduce time on the clusters, measured and predicted"),
                   ("table", *predicted)]
    return blocks, written


def main(argv=None):
    """The command: writes the report; exit status 0 (errors raise)."""
    write_report(argv)
    return 0


def write_report(argv=None):
    """Parse the flags, draw every figure, write report.md and .html; returns the PNGs."""
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results_dir", help="a sweep's results directory (records.jsonl)")
    simulate.add_cluster_flags(ap, "--cluster-ranks-per-node")   # of the crossover figure
    ap.add_argument("--gallery", default="", help="also copy every PNG here (make gallery: "
                                                  "docs/gallery, the README's pictures)")
    ap.add_argument("--screenshot", default="", metavar="FILE.png",
                    help="also draw report.html into this PNG with a headless Chromium")
    a = ap.parse_args(argv)
    d = a.results_dir
    everything, points = load(d), read_jsonl(os.path.join(d, "points.jsonl"))
    records = [r for r in everything if not cluster_figures.on_cluster(r)]     # this host's
    sim_file = os.path.join(d, "simulation.jsonl")
    if os.path.exists(sim_file):
        os.unlink(sim_file)
    os.makedirs(d, exist_ok=True)
    _, cross = simulate.main(simulate.cluster_argv(a) + ["--jsonl", sim_file])
    sim_records = read_jsonl(sim_file)
    blocks = [("h", 1, f"topolab report: {os.path.normpath(d)}")]     # as given: no host paths
    blocks += provenance_block(everything, points)
    blocks.append(("h", 2, "Figures"))
    blocks.append(("swatches", [(name, COLOURS[name]) for name in SWATCHES]))
    written = []
    traces, about = pipeline_traces(d, points)
    cluster = (f"{a.ranks_per_node} ranks a node, {a.inter_gbps:g} Gbit/s and "
               f"{a.inter_latency_us:g} us between nodes")
    cluster_only = len(records) == 0 < len(everything)
    if cluster_only:
        blocks.append(("p", "Figures (a)-(f) need points run on this host (launcher \"local\"); "
                            "this sweep ran on clusters only: see Points on a cluster."))
    for fn, title, look, needs in FIGURES:
        out = os.path.join(d, "plots")
        path = (fn(sim_records, out, cluster=cluster) if fn is plots.crossovers else
                fn(traces, out, about=about) if fn is training_plots.pipeline_gantt else
                fn(records, out))
        if path:
            rel = os.path.relpath(path, d)
            written.append(path)
            blocks.append(("figure", title, rel, f"{look} (SVG: {rel[:-4]}.svg; the numbers "
                                                 f"drawn: {rel[:-4]}.json)"))
        elif not cluster_only:
            blocks += [("h", 3, title),
                       ("p", f"No figure: the records hold no data for it. Needs: {needs}.")]
    blocks.append(("h", 2, "Cost model: predicted beside measured"))
    blocks += fidelity_blocks(records)
    more, paths = cluster_blocks(everything, d)
    blocks += more
    written += paths
    blocks.append(("h", 2, "Simulated crossovers (cost model, not measured)"))
    blocks.append(("p", f"{a.ranks_per_node} ranks a node, {a.intra_gbps:g} GB/s and "
                        f"{a.intra_latency_us:g} us inside, {a.inter_gbps:g} Gbit/s and {a.inter_latency_us:g} us between "
                        f"nodes; `python -m experiments.simulate --help` for other clusters."))
    blocks.append(("table", ["P", "nodes", "PS servers to beat ring (256 MiB)",
                             "tree beats ring up to", "hierarchical beats ring from"],
                   [(x["P"], x["nodes"], x["ps_servers_to_beat_ring"] or "never",
                     simulate.human(x["tree_beats_ring_up_to_bytes"]),
                     simulate.human(x["hierarchical_beats_ring_from_bytes"])) for x in cross]))
    for fmt in ("md", "html"):
        with open(os.path.join(d, f"report.{fmt}"), "w") as f:
            f.write(render(blocks, fmt))
    if a.gallery:
        os.makedirs(a.gallery, exist_ok=True)
        for path in written:
            shutil.copyfile(path, os.path.join(a.gallery, os.path.basename(path)))
    print(f"wrote {len(written)} figures and {os.path.join(d, 'report.md')} (+ .html)"
          + (f"; copied the PNGs to {a.gallery}" if a.gallery else ""))
    if a.screenshot:
        print(screenshot(os.path.join(d, "report.html"), a.screenshot))
    return written


SWATCHES = ("ring", "tree", "halving_doubling", "hierarchical", "mpi", "torch", "ps/bsp",
            "ps/ssp", "ps/asp")


if __name__ == "__main__":
    sys.exit(main())
