"""The mixture-of-experts figure: what the capacity factor buys and costs under --ep.

    moe_capacity(read_jsonl("results/moe_capacity.jsonl"), "results/plots")
        -> results/plots/moe_capacity.png (+ .svg, .json)

The records are strategies.train's own --jsonl (config and step records), from
runs that differ in --top-k and --capacity-factor only (docs/moe.md):

    for k in 1 2; do for cf in 0.5 1.0 1.25 2.0; do
      mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model moe \\
          --experts 4 --ep 2 --top-k $k --capacity-factor $cf --steps 20 --global-batch 16 \\
          --no-progress --threads 1 --jsonl results/moe_capacity.jsonl
    done; done
    .venv/bin/python -m experiments.moe_plots results/moe_capacity.jsonl results/plots

Left: the share of token choices dropped (over capacity), mean over steps and ranks.
Right: the all-to-all bytes a rank sends per step, measured (markers) beside the
formula (dashed): 4 all-to-alls per block (dispatch and combine, forward and
backward), each of the (E, G, C, d) float32 buffer, (ep-1)/ep of it leaving the rank.
The formula reads the run's split from its config record: a replica's sequences
(global batch / dp_size; the world also counts servers, stages, tp and cp ranks),
the blocks a stage holds (--pp) and the positions a rank gates (--cp).
"""
import sys
from collections import defaultdict

from strategies.parallel.expert_parallel import alltoall_bytes_per_step

from .palette import MEASURED, PREDICTED, records_main, save, two_panels
from .records import train_runs

TOP_K_COLOURS = {1: "#1f77b4", 2: "#d62728"}


def capacity_runs(records):
    """{top_k: [(capacity factor, dropped share, bytes measured, bytes predicted)]} of the
    --ep runs in records, each run's means over its steps after the first."""
    runs = train_runs(records, lambda c: c.get("model") == "moe" and c.get("ep", 1) > 1,
                      lambda s: s["step"] > 0)
    out = defaultdict(list)
    for c, rs in runs.values():
        counted = [r["alltoall_bytes"] for r in rs if r.get("alltoall_bytes") is not None]
        out[c["top_k"]].append((c["capacity_factor"],
                                sum(r["dropped_fraction"] for r in rs) / len(rs),
                                sum(counted) / len(counted) if counted else None,
                                alltoall_bytes_per_step(c, c["dp_size"])))
    return {k: sorted(v) for k, v in out.items()}


def moe_capacity(records, out_dir):
    """The figure's PNG path, or None when records hold no --ep runs."""
    runs = capacity_runs(records)
    if not runs:
        return None
    fig, (dropped, traffic) = two_panels()
    for top_k, points in sorted(runs.items()):
        colour, factors = TOP_K_COLOURS.get(top_k), [p[0] for p in points]
        dropped.plot(factors, [p[1] for p in points], **MEASURED, color=colour,
                     label=f"top-{top_k}")
        measured = [(p[0], p[2]) for p in points if p[2] is not None]
        traffic.plot([f for f, _ in measured], [b / 1024 for _, b in measured], **MEASURED,
                     color=colour, label=f"top-{top_k} measured")
        traffic.plot(factors, [p[3] / 1024 for p in points], **PREDICTED, color=colour,
                     label=f"top-{top_k} formula")
    dropped.set(xlabel="capacity factor", ylabel="token choices dropped",
                title="dropped over capacity", ylim=(0, None))
    traffic.set(xlabel="capacity factor", ylabel="KiB sent per rank per step",
                title="all-to-all traffic", ylim=(0, None))
    for ax in (dropped, traffic):
        ax.legend(fontsize=8)
    return save(fig, out_dir, "moe_capacity", note=(
        "The buffers have a fixed shape (E, G, C, d): traffic grows with the capacity C "
        "whether or not tokens fill it; a smaller factor sends less and drops more."))


def main(argv=None):
    return records_main(argv, "experiments.moe_plots", __doc__, moe_capacity,
                        "no --ep runs of --model moe in the records")


if __name__ == "__main__":
    sys.exit(main())
