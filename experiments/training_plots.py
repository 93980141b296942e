"""The training figures of the report: (b) strategies, (d) ZeRO memory, (e) the
pipeline's timeline, (f) the parameter server's consistency models.  Each reads
strategies.train's step records (or its Chrome traces) only; experiments/plots.py
lists every figure.

    records = experiments.records.load("results/demo")
    strategy_breakdown(records, "results/demo/plots")     # -> .../strategy_breakdown.png
"""
import re
from bisect import bisect_right
from collections import defaultdict

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from strategies.parallel.bubble import bubble_fraction
from strategies.config.choices import SCHEDULES
from strategies.config.mesh import needs_grid

from .palette import PARTS, colour_of, cores_of, save, spread, timeline_legend
from .records import describe, labelled, model_of, one_comparison, slowest_rank


def strategy_name(r):
    c = r.get("config", {})
    name = c.get("sync", "?")
    if name in ("ps", "hybrid"):
        name += f"/{c.get('consistency', 'bsp')}" + (
            f"({c['staleness']})" if c.get("consistency") == "ssp" else "")
    if c.get("straggler"):
        name += " +straggler"
    return name


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
            if "straggler" not in k[0] and not needs_grid(v[0].get("config", {}))}
    runs = one_comparison(runs, model_of, lambda k, c: k[0])
    if not runs:
        return None
    names, compute, comm, idle, rate = [], [], [], [], []
    for name, steps in labelled(runs):
        timed = [s for s in steps if s["step"] > 0] or steps      # step 0 warms up
        mean = lambda key: sum(s[key] for s in timed) / len(timed)  # noqa: E731
        names.append(name)
        compute.append(1e3 * mean("compute_time_s"))
        comm.append(1e3 * mean("comm_time_s"))
        slowest = slowest_rank(timed)
        idle.append(1e3 * sum(slowest[s["step"]] - s["step_time_s"] for s in timed) / len(timed))
        batch = steps[0].get("config", {}).get("global_batch", 64)
        rate.append(spread([batch / t for t in slowest.values() if t > 0], "iqr"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    a1.bar(names, [m for m, _, _ in rate], color=[colour_of(n) for n in names],
           yerr=[[m - lo for m, lo, _ in rate], [hi - m for m, _, hi in rate]], capsize=3)
    a1.set(ylabel="samples / s",
           title=f"throughput ({describe(steps[0]['config'])}{cores_of(steps)})")
    a2.bar(names, compute, label="compute", color=PARTS["compute"])
    a2.bar(names, comm, bottom=compute, label="exposed comm", color=PARTS["exposed comm"])
    a2.bar(names, idle, bottom=[c + m for c, m in zip(compute, comm)], label="idle",
           color=PARTS["idle"])
    a2.set(ylabel="ms per step (mean over ranks)", title="step-time breakdown")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=20)
    return save(fig, out_dir, "strategy_breakdown", note=(
        "throughput: the median over steps (the first, a warm-up, left out) of samples/s, "
        "a step as long as its slowest rank; bars: the interquartile range over steps.\n"
        "breakdown: means over ranks and steps; idle is the time a rank waited for the "
        "slowest rank's step to end."))


MEMORY_PARTS = ("params", "grads", "optimizer", "activations")


def zero_memory_data(records):
    """(title, {(precision, stage): {part: bytes on the largest rank}}) of the ZeRO
    comparison, or None; fp32 and mixed precision (--precision) runs side by side.
    Only runs on data parallelism alone (pp = tp = 1: every rank holds the whole model,
    so stage 0 holds 4Ψ bytes of fp32 parameters) of one model, world, optimizer and
    micro-batching, that differ in the stage; a pipeline run is not a ZeRO-0 run."""
    runs = {k: v for k, v in train_steps(records).items() if isinstance(v[0].get("memory"), dict)
            and v[0]["config"].get("pp", 1) == 1 and v[0]["config"].get("tp", 1) == 1}
    runs = one_comparison(runs, lambda c: model_of(c, "optimizer", "micro_batches"),
                          lambda k, c: (c.get("precision", "fp32"), c.get("zero", 0)))
    if not runs:
        return None
    by_stage = defaultdict(lambda: defaultdict(int))
    for steps in runs.values():
        for r in steps:
            c, memory = r["config"], r["memory"]
            bar = (c.get("precision", "fp32"), c.get("zero", 0))
            for part in MEMORY_PARTS:
                value = memory.get(part, memory.get(f"{part}_peak", 0))
                by_stage[bar][part] = max(by_stage[bar][part], value)
    first = next(iter(runs.values()))
    c = first[0]["config"]
    return f"{describe(c)}, {c.get('optimizer', 'sgd')}{cores_of(first)}", by_stage


def zero_memory(records, out_dir):
    """(d) bytes per rank by ZeRO stage, stacked by part, from the `memory` dict that
    strategies.train writes in each step's record on the grid (--dp/--zero):
    params, grads, optimizer (measured from the tensors) and activations_peak."""
    data = zero_memory_data(records)
    if not data:
        return None
    title, by_stage = data
    # fp32 first, then each 16-bit precision, each by stage
    bars = sorted(by_stage, key=lambda b: (b[0] != "fp32", b))
    names = [f"ZeRO-{s}" if p == "fp32" else f"ZeRO-{s} {p}" for p, s in bars]
    fig, ax = plt.subplots(figsize=(6.6 + 0.5 * max(0, len(bars) - 4), 4.4))
    bottom = [0.0] * len(bars)
    for part in MEMORY_PARTS:
        mib = [by_stage[b][part] / 2**20 for b in bars]
        ax.bar(names, mib, bottom=bottom, label=part, color=PARTS[part],
               edgecolor="0.3", lw=0.5)
        bottom = [b + m for b, m in zip(bottom, mib)]
    ax.set(ylabel="MiB per rank (largest rank)", title=f"memory per rank by ZeRO stage\n{title}")
    ax.legend(fontsize=8)
    if any(p != "fp32" for p, _ in bars):
        ax.tick_params(axis="x", rotation=20)
    return save(fig, out_dir, "zero_memory", note=(
        "measured from the tensors each rank holds; ZeRO-1 shards the optimizer's state,\n"
        "ZeRO-2 also the gradients, ZeRO-3 also the parameters (each over the dp ranks).\n"
        "bf16/fp16 (--precision): 16-bit params and grads, the fp32 master weights counted\n"
        "with the optimizer's state: 2 + 2 + 12 bytes a parameter with Adam, as in the paper."))


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


MICRO_BATCH = re.compile(r"mb ?(\d+)")          # strategies/parallel/pipeline.py: "forward mb3"
CHUNK = re.compile(r"chunk ?(\d+)")             # interleaved: "forward mb3 chunk1"


def row_names(events):
    """{pid: "stage 1"} from the trace's process names ("rank 1 (dp 0, pp 1, tp 0)")."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            stage = re.search(r"pp (\d+)", e.get("args", {}).get("name", ""))
            names[e.get("pid", 0)] = f"stage {stage.group(1)}" if stage else f"rank {e['pid']}"
    return names


def bubble(events):
    """The measured bubble: the share of (stages x the step's span) that no stage spent
    in forward or backward.  GPipe's formula (p-1)/(m+p-1) assumes equal stages and
    free hand-offs; this also holds the sends' waits and uneven stages."""
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    stages = {e.get("pid", 0) for e in events}
    return 1 - sum(e["dur"] for e in events) / (len(stages) * (end - start))


def in_flight(events):
    """The most micro-batches one stage held activations for at once: forwarded and not
    yet back-propagated (GPipe: all m; 1F1B: at most p)."""
    most = 0
    for pid in {e.get("pid", 0) for e in events}:
        held = 0
        for e in sorted((e for e in events if e.get("pid", 0) == pid), key=lambda e: e["ts"]):
            held += 1 if e["cat"] == "forward" else -1
            most = max(most, held)
    return most


def pipeline_gantt(traces, out_dir, about=""):
    """(e) one timeline per schedule, the last step of each: {schedule: Chrome-trace
    events} (strategies.train --trace; experiments.report collects them by schedule and
    says in `about` which model ran).  Forward and backward spans, each with its
    micro-batch; the hatched rest of each row is the bubble, measured beside the formula."""
    names = {k: row_names(v) for k, v in traces.items()}
    traces = {k: [e for e in last_step(v) if e.get("ph") == "X"
                  and e.get("cat") in ("forward", "backward")] for k, v in traces.items()}
    traces = {k: v for k, v in traces.items() if v}
    if not traces:
        return None
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.2 + 1.6 * len(traces)),
                             squeeze=False)
    def panel_order(item):           # GPipe, 1F1B, interleaved: the order they came in
        name = item[0].split(",")[0]
        return (SCHEDULES.index(name) if name in SCHEDULES else len(SCHEDULES), item[0])

    for ax, (schedule, events) in zip(axes[:, 0], sorted(traces.items(), key=panel_order)):
        t0 = min(e["ts"] for e in events)
        span = (max(e["ts"] + e["dur"] for e in events) - t0) / 1e3
        stages = sorted({e.get("pid", 0) for e in events})
        ax.barh(stages, [span] * len(stages), color="white", hatch="///", edgecolor="0.75",
                lw=0, zorder=0, label="bubble")
        for e in events:
            left, width = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            if e.get("tid", 0):           # the comm thread's collectives: a thin lane below
                ax.barh(e.get("pid", 0) + 0.3, width, left=left, height=0.2,
                        color=PARTS.get(e["cat"], "0.5"), edgecolor="0.3", lw=0.3)
                continue
            ax.barh(e.get("pid", 0), width, left=left, color=PARTS[e["cat"]], edgecolor="0.3",
                    lw=0.5)
            mb, chunk = MICRO_BATCH.search(e.get("name", "")), CHUNK.search(e.get("name", ""))
            if mb and width > span / 80:          # interleaved: "3.1", micro-batch 3, chunk 1
                ax.text(left + width / 2, e.get("pid", 0),
                        mb.group(1) + (f".{chunk.group(1)}" if chunk else ""), ha="center",
                        va="center", fontsize=7 if not chunk else 6)
        rows = [names[schedule].get(s, f"rank {s}") for s in stages]
        p = len(set(rows))               # p, m and v as the schedules' papers name them
        m = len({mb.group(1) for e in events if (mb := MICRO_BATCH.search(e.get("name", "")))})
        v = len({c.group(1) for e in events if (c := CHUNK.search(e.get("name", "")))}) or 1
        formula = "(p-1)/(vm+p-1)" if v > 1 else "(p-1)/(m+p-1)"
        ax.set_yticks(stages, rows)
        ax.set_xlim(0, span * 1.01)
        ax.set_title(f"{schedule} (last step)", fontsize=10)
        ax.set_title(f"bubble {bubble(events):.0%} measured" + (
            f", {bubble_fraction(p, m, v):.0%} by {formula}" if m else ""), loc="left",
            fontsize=8)
        ax.set_title(f"at most {in_flight(events)} " + ("chunk-" if v > 1 else "") +
                     "micro-batches in flight", loc="right", fontsize=8)
        ax.invert_yaxis()
    timeline_legend(axes[0, 0], Patch(facecolor="white", hatch="///", edgecolor="0.75",
                                      label="bubble (idle)"))
    axes[-1, 0].set_xlabel("time (ms) since the step's first forward")
    if about:
        fig.suptitle(f"pipeline schedules: {about}", fontsize=10)
    return save(fig, out_dir, "pipeline_gantt", note=(
        "Numbers: each span's micro-batch.  Same bubble, less memory: GPipe runs all m "
        "forwards before any backward, so a stage holds m micro-batches' activations;\n"
        "1F1B starts micro-batch i's backward before forward i+p, so it holds at most p. "
        "Interleaved (i.c: micro-batch i on chunk c): v chunks a rank, slots 1/v as long, "
        "so the fill and drain shrink v-fold.\n"
        "The measured bubble parts from the formula's where stages are uneven and sends wait."))


def step_ends(steps):
    """{(rank, step): when that rank ended that step, on its own clock from the run's start}:
    the records' ended_s, every wait included; records without it, their step times added
    up, which leave out the waits between steps (a metrics flush)."""
    if all("ended_s" in s for s in steps):
        return {(s["rank"], s["step"]): s["ended_s"] for s in steps}
    ends, clock = {}, defaultdict(float)
    for s in sorted(steps, key=lambda s: s["step"]):
        clock[s["rank"]] += s["step_time_s"]
        ends[(s["rank"], s["step"])] = clock[s["rank"]]
    return ends


def server_updates(steps, mode):
    """{(rank, step): the updates the server had applied when that rank ended that step}.
    From the records' server_version where they carry it; otherwise counted from the
    workers' step ends, each on its own clock from the run's start: under BSP one update
    a step, once every worker's push is in; under SSP and ASP one update a push."""
    if all(s.get("server_version") is not None for s in steps):
        return {(s["rank"], s["step"]): s["server_version"] for s in steps}
    ends = step_ends(steps)
    if mode == "bsp":
        per_rank = {r: sorted(t for (q, _), t in ends.items() if q == r) for r, _ in ends}
        return {k: min(bisect_right(times, t) for times in per_rank.values())
                for k, t in ends.items()}
    times = sorted(ends.values())
    return {k: bisect_right(times, t) for k, t in ends.items()}


def loss_as_it_happened(steps, ends):
    """(seconds, loss): each worker's local loss when it ended a step, in wall-clock
    order, averaged over the last W of them (W workers: a global batch's worth).
    Under ASP a fast worker's steps count when they happen, not when the slowest
    worker reaches the same step number."""
    points = sorted((ends[(s["rank"], s["step"])], s["local_loss"]) for s in steps
                    if s.get("local_loss") is not None)
    W = len({s["rank"] for s in steps})
    times = [t for t, _ in points][W - 1:]
    losses = [sum(v for _, v in points[i - W + 1:i + 1]) / W for i in range(W - 1, len(points))]
    return times, losses


def ps_consistency(records, out_dir):
    """(f) the consistency models with a straggler: the global loss against each worker's
    clock (its step) and against wall-clock (the workers' losses as their steps end),
    each worker's clock against the server's update counter, and the staleness of
    each push: the updates the server applied between the worker's pull and its push."""
    runs = {k: v for k, v in train_steps(records).items() if k[0].startswith(("ps/", "hybrid/"))}
    if any("straggler" in name for name, _ in runs):          # compare like with like
        runs = {k: v for k, v in runs.items() if "straggler" in k[0]}
    runs = one_comparison(runs, lambda c: model_of(c, "straggler", "servers"),
                          lambda k, c: k[0])
    if not runs:
        return None
    fig, ((a1, a2), (a3, a4)) = plt.subplots(2, 2, figsize=(11, 7.6))
    counted = False
    for name, steps in labelled(runs):
        colour, cfg = colour_of(name), steps[0]["config"]
        by_step = defaultdict(list)
        for s in steps:
            by_step[s["step"]].append(s)
        order, ends = sorted(by_step), step_ends(steps)
        loss = [by_step[st][0]["loss"] for st in order]
        a1.plot(order, loss, label=name, color=colour)
        a2.plot(*loss_as_it_happened(steps, ends), label=name, color=colour)
        updates = server_updates(steps, cfg.get("consistency", "bsp"))
        counted |= not all(s.get("server_version") is not None for s in steps)
        straggler = str(cfg.get("straggler", "")).split(":")[0]
        for i, rank in enumerate(sorted({s["rank"] for s in steps})):
            mine = sorted((s for s in steps if s["rank"] == rank), key=lambda s: s["step"])
            who = f"{name}, rank {rank}" + (" (straggler)" if str(rank) == straggler else "")
            style = {"color": colour, "linestyle": ("-", "--", ":", "-.")[i % 4], "lw": 1.2}
            a3.plot([updates[(rank, s["step"])] for s in mine], [s["step"] + 1 for s in mine],
                    label=who, **style)
            stale = [(s["step"], s["staleness"]) for s in mine if s.get("staleness") is not None]
            if stale:
                a4.plot([t for t, _ in stale], [v for _, v in stale], label=who,
                        drawstyle="steps-post", **style)
    a1.set(xlabel="step (each worker's clock)", ylabel="global-batch loss",
           title=f"loss against step ({describe(cfg)}{cores_of(steps)})")
    a2.set(xlabel="wall-clock (s): when each worker ended each step", ylabel="loss (last W steps)",
           title="loss against time")
    a3.set(xlabel="server updates applied" + (" (counted from the step ends)" if counted else ""),
           ylabel="worker's clock (steps done)", title="each worker's clock against the server's")
    a4.set(xlabel="step (the worker's clock)", ylabel="staleness (server updates)",
           title="staleness of each push")
    for ax in (a1, a2, a3, a4):
        ax.legend(fontsize=6)
    return save(fig, out_dir, "ps_consistency", note=(
        "BSP keeps every worker's clock equal to the server's step (staleness 0); SSP lets "
        "a worker run at most s steps ahead of the slowest; ASP never waits.\nA worker's "
        "staleness: how many updates the server applied between its pull and its push "
        "(psrv/store.py)."))
