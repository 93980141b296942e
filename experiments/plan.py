"""Plan a layout for a GPU cluster you do not have: every dp x pp x tp x ZeRO layout of a
GPT predicted, checked against the memory and ranked by step time (docs/planner.md).

    python -m experiments.plan --layers 24 --d-model 2304 --heads 24 --seq-len 2048 \\
        --vocab 51200 --global-batch 512 --preset dgx-a100-80gb --nodes 4 --top 10
    python -m experiments.plan ... --nodes 2 --gpus-per-node 4 --gpu-mem-gib 24 \\
        --gpu-tflops 125 --intra-gbps 400 --inter-gbps 100 --jsonl plan.jsonl --out plots
    python -m experiments.plan --layers 4 --d-model 64 --heads 4 --seq-len 32 --vocab 32 \\
        --global-batch 16 --calibration results --gpus-per-node 4 --verify 3

MODEL is a GPT's shape (--experts E: a mixture of experts in every layer).
CLUSTER is --preset NAME (and --nodes), or the figures themselves, or
--calibration FILE|DIR: the machine at hand, its links from experiments.calibrate's
calibration.json and its compute rate timed here (experiments/planner/verify.py).

Prints the K fastest layouts that fit, the time split of each (compute, exposed
tensor-, pipeline-, data- and expert-parallel communication, pipeline bubble)
and why the rest are out; --jsonl appends one record a layout (kind "plan"),
--out DIR draws plan_frontier.png.  --verify N runs the N best and the worst
layouts that strategies.train can run on this machine (mpiexec, or the emulated
cluster with --cluster) and puts each measured step beside its prediction
(records of kind "plan_verify").  Everything else is a prediction of the model
in experiments/planner/step.py, not a measurement.
"""
import argparse
import os
import sys
from dataclasses import asdict, replace

from allreduce.cli import add_output_flags
from allreduce.records import append_jsonl, provenance

from .planner import cluster as clusters
from .planner.figure import plan_frontier
from .planner.search import Space, plan
from .planner.step import PARTS
from .planner.transformer import GPT, RECOMPUTE
from .planner.verify import (MEASURED_S, WARM_UP_STEPS, problems, runnable, this_machine,
                             verify)

EXPLICIT = ("gpus_per_node", "gpu_mem_gib", "gpu_tflops", "intra_gbps", "inter_gbps")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line and exit status 2, for scripts that read it."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def listing(kind):
    def parse(text):
        try:
            return tuple(kind(v) for v in text.split(",") if v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             f"{kind.__name__}") from None
    return parse


def parser():
    ap = Parser(prog="python -m experiments.plan", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("MODEL (a GPT)")
    for name, what in (("layers", "transformer layers"), ("d-model", "hidden size h"),
                       ("heads", "attention heads"), ("seq-len", "tokens a sequence"),
                       ("vocab", "vocabulary size"), ("global-batch", "sequences a step")):
        m.add_argument(f"--{name}", type=int, required=True, help=what)
    m.add_argument("--experts", type=int, default=0, help="experts a layer (0: dense)")
    m.add_argument("--top-k", type=int, default=2, help="experts a token passes through")
    c = ap.add_argument_group("CLUSTER")
    c.add_argument("--preset", choices=sorted(clusters.PRESETS), help="a machine's figures")
    c.add_argument("--nodes", type=int, help="nodes (default 1)")
    c.add_argument("--gpus-per-node", type=int,
                   help="GPUs a node (with --calibration: ranks a host, default its cores)")
    c.add_argument("--gpu-mem-gib", type=float, help="memory a GPU, GiB")
    c.add_argument("--gpu-tflops", type=float, help="dense 16-bit peak a GPU, TFLOP/s")
    c.add_argument("--intra-gbps", type=float, help="Gbit/s a GPU, each way, inside a node")
    c.add_argument("--inter-gbps", type=float, help="Gbit/s a node, each way, between nodes")
    c.add_argument("--efficiency", type=float, help="share of the peak a layer reaches "
                                                    "(default 0.48: docs/planner.md)")
    c.add_argument("--calibration", metavar="FILE|DIR",
                   help="the machine at hand: experiments.calibrate's calibration.json")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="with --calibration: the machine at hand's ranks compute on its CPU "
                        "cores, or on its GPUs, which they share (default cpu)")
    s = ap.add_argument_group("what the planner may choose")
    s.add_argument("--zero", type=listing(int), default=(0, 1, 2, 3), help="ZeRO stages")
    s.add_argument("--recompute", type=listing(str), default=RECOMPUTE,
                   help="none, selective, full")
    s.add_argument("--schedules", type=listing(str), default=("1f1b", "interleaved"),
                   help="pipeline schedules")
    s.add_argument("--micro-batch-sizes", type=listing(int), default=(1, 2, 4, 8),
                   help="sequences a micro-batch")
    s.add_argument("--tp-sizes", type=listing(int), help="tensor-parallel sizes (default all)")
    s.add_argument("--pp-sizes", type=listing(int), help="pipeline sizes (default all)")
    s.add_argument("--precision", help="bf16, fp16 or fp32 (default bf16; fp32 with "
                                       "--calibration)")
    s.add_argument("--no-sequence-parallel", action="store_true",
                   help="keep norms and dropouts whole on every tp rank")
    o = ap.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, metavar="K", help="layouts in the table")
    add_output_flags(o, out_what="plan_frontier.png (.svg, .json)")
    o.add_argument("--verify", type=int, default=0, metavar="N",
                   help="run the N best and the worst layouts here (needs --calibration)")
    o.add_argument("--steps", type=int, default=6, help="--verify: steps a run, at least")
    o.add_argument("--measure-s", type=float, default=MEASURED_S, metavar="S",
                   help="--verify: more steps where the first ones would take less than S "
                        "seconds after the warm-up, by the prediction (default %(default)s)")
    o.add_argument("--cluster", action="store_true", help="--verify on the emulated "
                   "cluster of --nodes x --gpus-per-node hosts' ranks at --inter-gbps (root)")
    return ap


def cluster_of(a, gpt):
    """The Cluster the flags describe; ValueError naming the flag that is wrong."""
    given = {k: getattr(a, k) for k in EXPLICIT + ("efficiency",) if getattr(a, k) is not None}
    if a.preset and a.calibration:
        raise ValueError("give --preset or --calibration, not both")
    if a.preset:
        return clusters.preset(a.preset, nodes=a.nodes or 1, **given)
    if a.calibration:
        ranks = a.gpus_per_node or os.cpu_count() or 1        # default: a rank a core
        machine = this_machine(gpt, ranks, a.calibration, a.nodes or 1,
                               a.inter_gbps or 1.0, a.micro_batch_sizes, a.device,
                               replays="full" in a.recompute)
        return replace(machine, **given)
    missing = [k for k in EXPLICIT if k not in given]
    if missing:
        raise ValueError(f"CLUSTER: give --preset, --calibration, or all of --"
                         f"{', --'.join(k.replace('_', '-') for k in EXPLICIT)} "
                         f"(missing --{missing[0].replace('_', '-')})")
    return clusters.Cluster("cluster", nodes=a.nodes or 1, **given)


def table(rows, top):
    """The top K that fit, one line each."""
    head = (f"{'#':>3} {'layout':<30} {'m':>4} {'GiB':>6} {'step s':>9} {'TFLOP/s':>8}  "
            + " ".join(f"{p:>7}" for p in PARTS))
    lines = [head]
    for i, r in enumerate(rows[:top], 1):
        split = " ".join(f"{100 * r[f'{p}_s'] / r['step_s']:6.1f}%" for p in PARTS)
        lines.append(f"{i:>3} {r['label']:<30} {r['micro_batches']:>4} "
                     f"{r['mem_bytes'] / clusters.GIB:6.1f} {r['step_s']:9.4g} "
                     f"{r['tflops_per_gpu']:8.3g}  {split}")
    return "\n".join(lines)


def out_summary(entries, shown=3):
    """How many layouts are out and why, the nearest misses first."""
    out = [e for e in entries if not e.fits]
    if not out:
        return "every layout fits"
    lines = [f"{len(out)} of {len(entries)} layouts do not fit; the nearest misses:"]
    lines += [f"    {e.prediction.layout.label()}: {e.why_out}" for e in out[:shown]]
    return "\n".join(lines)


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    try:
        gpt = GPT(a.layers, a.d_model, a.heads, a.seq_len, a.vocab, a.global_batch,
                  a.experts, a.top_k)
        precision = a.precision or ("fp32" if a.calibration else "bf16")
        space = Space(a.zero, a.recompute, a.schedules, a.micro_batch_sizes,
                      precision=precision, sequence_parallel=not a.no_sequence_parallel,
                      # the machine at hand runs strategies.train, whose head is whole
                      whole_head=bool(a.calibration),
                      tp_sizes=a.tp_sizes, pp_sizes=a.pp_sizes)
        if a.top < 1 or a.verify < 0 or a.steps <= WARM_UP_STEPS or a.measure_s < 0:
            raise ValueError(f"--top must be >= 1, --verify >= 0, --measure-s >= 0 and "
                             f"--steps > {WARM_UP_STEPS} (the warm-up steps, not timed)")
        if a.verify and not a.calibration:
            raise ValueError("--verify runs layouts on this machine: describe it with "
                             "--calibration FILE|DIR (and --gpus-per-node RANKS)")
        if a.device != "cpu" and not a.calibration:
            raise ValueError(f"--device {a.device} is where the machine at hand's ranks "
                             f"compute: give --calibration FILE|DIR too")
        if a.cluster and not a.verify:
            raise ValueError("--cluster is where --verify runs: give --verify N too")
        cluster = cluster_of(a, gpt)
        missing = problems(cluster, a.cluster) if a.verify else []
        if missing:
            raise ValueError("--verify: " + "; ".join(missing))
        entries = plan(gpt, cluster, space)
    except (ValueError, OSError, KeyError) as e:
        ap.error(str(e).strip("'\""))
    stamp = {"model": asdict(gpt), "cluster_figures": asdict(cluster, dict_factory=figures),
             "provenance": provenance()}
    records = [{**e.record(cluster), "rank": i, "label": e.prediction.layout.label(), **stamp}
               for i, e in enumerate(entries, 1)]
    fits = [r for r in records if r["fits"]]
    print(cluster.describe())
    print(f"{len(fits)} of {len(records)} layouts fit ({cluster.world} GPUs, "
          f"{cluster.memory_bytes / clusters.GIB:.1f} GiB usable a GPU); predicted:")
    print(table(fits, a.top) if fits else "none")
    print(out_summary(entries))
    if a.jsonl:
        append_jsonl(a.jsonl, records)
    if a.out:
        path = plan_frontier(records, a.out, cluster.memory_bytes)
        print(f"wrote {path}" if path else "no figure: no layout fits")
    if a.verify:
        return check(a, gpt, cluster, entries, stamp)
    return 0


def figures(pairs):
    """asdict's factory: the cluster's numbers, not its calibrated curves."""
    return {k: v for k, v in pairs if not k.startswith("calibrated")}


def check(a, gpt, cluster, entries, stamp):
    """--verify: the N best and the worst runnable layouts, measured beside predicted."""
    can = [e for e in entries if e.fits and not runnable(gpt, e.prediction.layout)]
    chosen = can[:a.verify] + ([can[-1]] if len(can) > a.verify else [])
    if not chosen:
        print("--verify: no layout that fits is one strategies.train can run", file=sys.stderr)
        return 1
    print(f"\nverify: {len(chosen)} layouts with strategies.train, {a.steps} steps each "
          f"or enough to time {a.measure_s:g} s")
    rows = verify(gpt, chosen, cluster, a.steps, a.cluster, a.device, a.measure_s)
    out = []
    for e, steps, measured, why in rows:
        p = e.prediction
        error = f"measured / predicted {measured / p.step_s:.2f}" if measured else why
        print(f"  {p.layout.label():<30} predicted {p.step_s:8.4f} s  measured "
              f"{measured or float('nan'):8.4f} s  {error}  ({steps} steps)")
        out.append({"kind": "plan_verify", **asdict(p.layout), "label": p.layout.label(),
                    "predicted_s": p.step_s, "measured_s": measured, "steps": steps,
                    "why": why, "rank": entries.index(e) + 1, **stamp})
    if a.jsonl:
        append_jsonl(a.jsonl, out)
    return 0 if all(m for _, _, m, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
