"""The context-parallel figure: what ring attention and Ulysses send and wait, against T.

    context(read_jsonl("results/labs/lab10.jsonl"), "results/labs")
        -> results/labs/context.png (+ .svg, .json)

The records are strategies.train's own --jsonl from GPT runs with --cp that
differ in --seq-len and --cp-kind only, as in lab 10
(experiments/labs/10_ring_vs_ulysses.md):

    for seq in 64 128 256 512; do
      for kind in ring ulysses; do
        .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring \\
            --model gpt --seq-len $seq --cp 2 --cp-kind $kind ... --jsonl results/labs/lab10.jsonl
      done
    done
    .venv/bin/python -m experiments.context_plots results/labs/lab10.jsonl results/labs

Left: `cp_bytes`, what one rank's attention cores sent a step (rank 0's; every
rank of a group sends the same), measured as markers, and the formula
(strategies/parallel/context_parallel.py's context_bytes) dashed.  Right:
`cp_time_s` of each rank, the median over the steps after the first (warm-up),
in ms: the waits the ring's overlap did not hide, or Ulysses' all-to-alls.
"""
import statistics
import sys

from strategies.parallel.context_parallel import context_bytes

from .palette import MEASURED, PREDICTED, colour_of, records_main, save, two_panels
from .records import train_runs

DASHED_RANK = ("-", ":", "-.", "--")              # rank r's line on the right panel


def context_runs(records):
    """{kind: {seq_len: (cp_bytes of rank 0, formula, {rank: median cp_time_s})}} of the
    runs in records with --cp above 1 and counted bytes; the last run of a (kind, seq_len)
    wins."""
    out = {}
    runs = train_runs(records, config=lambda c: c.get("cp_size", 1) > 1,
                      step=lambda s: s.get("cp_bytes") is not None)
    for config, steps in runs.values():
        kind, seq = config["cp_kind"], config["seq_len"]
        batch = config["global_batch"] // config["dp_size"]      # a context group's samples
        formula = context_bytes(kind, batch, seq, config["d_model"] // config["tp_size"],
                                config["cp_size"], config["layers"])
        later = [s for s in steps if s["step"] > 0] or steps      # step 0 warms up
        waits = {rank: statistics.median(s["cp_time_s"] for s in later if s["rank"] == rank)
                 for rank in sorted({s["rank"] for s in later})}
        sent = next(s["cp_bytes"] for s in steps if s["rank"] == min(waits))
        out.setdefault(kind, {})[seq] = (sent, formula, waits)
    return out


def context(records, out_dir):
    """The figure's PNG path, or None when records hold no context-parallel run."""
    runs = context_runs(records)
    if not runs:
        return None
    fig, (traffic, waits) = two_panels()
    for kind, by_seq in sorted(runs.items()):
        seqs = sorted(by_seq)
        colour = colour_of(kind)
        traffic.plot(seqs, [by_seq[s][0] / 2 ** 20 for s in seqs], **dict(MEASURED, linestyle=""),
                     color=colour, label=f"{kind} measured")
        traffic.plot(seqs, [by_seq[s][1] / 2 ** 20 for s in seqs], **PREDICTED, color=colour,
                     label=f"{kind} formula")
        for rank in sorted(by_seq[seqs[0]][2]):
            waits.plot(seqs, [1e3 * by_seq[s][2].get(rank, float("nan")) for s in seqs],
                       **dict(MEASURED, linestyle=DASHED_RANK[rank % len(DASHED_RANK)]),
                       color=colour, label=f"{kind} rank {rank}")
    for ax in (traffic, waits):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({s for by_seq in runs.values() for s in by_seq}))
        ax.get_xaxis().set_major_formatter("{x:g}")
        ax.legend(fontsize=8)
    traffic.set_yscale("log", base=2)       # linear in T: a slope of one on both axes
    traffic.get_yaxis().set_major_formatter("{x:g}")
    traffic.set(xlabel="--seq-len (tokens)", ylabel="MiB a step, one rank",
                title="cp_bytes: what the attention cores send")
    waits.set(xlabel="--seq-len (tokens)", ylabel="ms a step (median)",
              title="cp_time_s: waiting for them")
    return save(fig, out_dir, "context", note=(
        "Both grow linearly with the sequence; the ring sends 2 (cp - 1) key-value blocks a "
        "layer forward, Ulysses four all-to-alls a layer. With causal masking the ring's "
        "first rank has the least to compute, and waits."))


def main(argv=None):
    return records_main(argv, "experiments.context_plots", __doc__, context,
                        "no context-parallel runs (--cp 2 or more) with counted bytes")


if __name__ == "__main__":
    sys.exit(main())
