"""The compression figure: what top-k and PowerSGD cost in loss and save in bytes.

    compression(read_jsonl("results/compression.jsonl"), "docs/gallery")
        -> docs/gallery/compression.png (+ .svg, .json)

The records are strategies.train's own --jsonl (config, step and summary
records) from runs that differ in --compress (and --momentum,
--no-error-feedback) only, as in docs/compression.md:

    for c in none topk:0.01 powersgd:4; do
      .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring \\
          --model mlp --width 256 --depth 3 --steps 60 --compress $c --no-progress \\
          --jsonl results/compression.jsonl
    done
    .venv/bin/python -m experiments.compression_plots results/compression.jsonl docs/gallery

Left: the global loss per step of each run.  Right: the gradient bytes all
ranks handed to the collectives per step (`wire_bytes`, summed over ranks,
mean over steps), with each run's share of the uncompressed bytes written on
its bar.
"""
import sys
from collections import defaultdict

from .palette import MEASURED, SPARE, records_main, save, two_panels
from .records import train_runs


def run_label(config):
    """'topk:0.01', 'topk:0.01 no EF', 'none m=0.9', 'topk:0.01 m=0.9 DGC',
    'topk:0.01 warm-up 20': what sets a run apart."""
    label = config["compress"]
    if not config.get("error_feedback", True):
        label += " no EF"
    if config.get("momentum"):
        label += f" m={config['momentum']:g}"
    if config.get("momentum_correction"):
        label += " DGC"               # DGC's momentum correction: the momentum before top-k
    if config.get("sparsity_warmup"):
        label += f" warm-up {config['sparsity_warmup']}"
    return label


def compression_runs(records):
    """[(label, [(step, loss)], wire bytes per step, ratio to float32)] of the all-reduce
    runs in records that counted their wire bytes, in the order they were written."""
    out = []
    for config, steps in train_runs(records, step=lambda s: "wire_bytes" in s).values():
        losses, wire = {}, defaultdict(lambda: [0, 0])            # wire: summed over ranks
        for r in steps:
            losses[r["step"]] = r["loss"]
            wire[r["step"]][0] += r["wire_bytes"]
            wire[r["step"]][1] += r["dense_bytes"]
        sent, dense = sum(w for w, _ in wire.values()), sum(d for _, d in wire.values())
        out.append((run_label(config), sorted(losses.items()), sent / len(wire),
                    sent / dense if dense else None))
    return out


def compression(records, out_dir):
    """The figure's PNG path, or None when records hold no run with wire bytes."""
    runs = compression_runs(records)
    if not runs:
        return None
    fig, (loss, traffic) = two_panels()
    for i, (label, points, sent, ratio) in enumerate(runs):
        colour = SPARE[i % len(SPARE)] if i else "0.35"      # float32 first, in grey
        loss.plot([s for s, _ in points], [v for _, v in points], **dict(MEASURED, marker=None),
                  color=colour, label=label)
        bar = traffic.bar(label, sent / 1024, color=colour)
        traffic.bar_label(bar, [f"{100 * ratio:.1f} %"], fontsize=8)
    loss.set(xlabel="step", ylabel="loss (global batch)", title="training loss")
    traffic.set(ylabel="KiB handed to collectives per step", title="gradient bytes, all ranks")
    traffic.tick_params(axis="x", labelrotation=20, labelsize=8)
    loss.legend(fontsize=8)
    return save(fig, out_dir, "compression", note=(
        "Error feedback keeps what top-k and PowerSGD did not send and adds it to the next "
        "step; the bar labels are each run's share of the float32 bytes."))


def main(argv=None):
    return records_main(argv, "experiments.compression_plots", __doc__, compression,
                        "no runs with wire bytes in the records")


if __name__ == "__main__":
    sys.exit(main())
