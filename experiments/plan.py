"""Plan a layout for a GPU cluster you do not have: every dp x cp x pp x tp x ZeRO layout of
a GPT predicted, checked against the memory and ranked by step time (docs/planner.md).

    python -m experiments.plan --layers 24 --d-model 2304 --heads 24 --seq-len 2048 \\
        --vocab 51200 --global-batch 512 --preset dgx-a100-80gb --nodes 4 --top 10
    python -m experiments.plan ... --nodes 2 --gpus-per-node 4 --gpu-mem-gib 24 \\
        --gpu-tflops 125 --intra-gbps 400 --inter-gbps 100 --jsonl plan.jsonl --out plots
    python -m experiments.plan --layers 4 --d-model 64 --heads 4 --seq-len 32 --vocab 32 \\
        --global-batch 16 --calibration results --gpus-per-node 4 --verify 3

MODEL is a GPT's shape (--experts E: a mixture of experts in every layer;
--kv-heads, --ffn-hidden, --gated-mlp, --flash-attention, --no-dropout: today's
shapes, e.g. Llama 3 405B: --layers 126 --d-model 16384 --heads 128 --kv-heads 8
--ffn-hidden 53248 --gated-mlp --flash-attention --no-dropout --seq-len 8192 --vocab
128256).  Any pipeline
size up to the layers is searched: each stage holds the layers of the balanced
split (strategies/parallel/stages.py, the trainer's rule too: the embedding and
the head counted as the work they are on the first and last stage), or
--pp-layers 5,6,...,6,5 sets them by hand (their count is then the pipeline size).
Context parallelism (cp, carved out of the replicas; --cp-sizes, --cp-kinds
ring,ulysses) splits each sequence's positions: at a long --seq-len it is what fits.
CLUSTER is --preset NAME (and --nodes), or the figures themselves, or
--calibration FILE|DIR: the machine at hand, its links from experiments.calibrate's
calibration.json and its compute rate timed here (experiments/planner/verify.py);
its model is then strategies.train's GPT, whose head is whole on every tp rank and
which has no dropout (--no-dropout implied).

Prints the K fastest layouts that fit (near-duplicates, ZeRO stages with the
same time, once), their MFU (the model's FLOPs a second over the peak) and HFU
(recomputation's FLOPs counted too), the time split of each (compute, exposed
tensor-, context-, pipeline-, data- and expert-parallel communication, pipeline bubble)
and why the rest are out; --jsonl appends one record a layout (kind "plan"),
--out DIR draws plan_frontier.png.  --verify N runs the N best and the worst
layouts that strategies.train can run on this machine (mpiexec, or the emulated
cluster with --cluster) and puts each measured step beside its prediction
(records of kind "plan_verify").  Everything else is a prediction of the model
in experiments/planner/step.py, not a measurement.
"""
import argparse
import math
import os
import sys
from dataclasses import asdict, replace

from allreduce.cli import add_output_flags
from allreduce.records import append_jsonl, provenance

from .planner import cluster as clusters
from .planner.figure import plan_frontier
from .planner.search import Space, distinct, plan
from .planner.step import PARTS
from .planner.transformer import CONTEXT_KINDS, GPT, MAX_COUNT, RECOMPUTE
from .planner.verify import (MEASURED_S, WARM_UP_STEPS, calibration_of, problems, runnable,
                             this_machine, verify)

EXPLICIT = ("gpus_per_node", "gpu_mem_gib", "gpu_tflops", "intra_gbps", "inter_gbps")
OPTIONAL = ("hbm_gbps", "gemm_best", "efficiency")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line and exit status 2, for scripts that read it."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def whole(text):
    """A whole number within the planner's counts (transformer.MAX_COUNT)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if abs(value) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text} is beyond {MAX_COUNT}")
    return value


def finite(text):
    """A finite number: inf and nan describe no machine."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def listing(kind):
    what = "whole numbers" if kind is whole else kind.__name__

    def parse(text):
        try:
            return tuple(kind(v) for v in text.split(",") if v)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             f"{what}") from None
    return parse


def parser():
    ap = Parser(prog="python -m experiments.plan", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("MODEL (a GPT)")
    for name, what in (("layers", "transformer layers"), ("d-model", "hidden size h"),
                       ("heads", "attention heads"), ("seq-len", "tokens a sequence"),
                       ("vocab", "vocabulary size"), ("global-batch", "sequences a step")):
        m.add_argument(f"--{name}", type=whole, required=True, help=what)
    m.add_argument("--experts", type=whole, default=0, help="experts a layer (0: dense)")
    m.add_argument("--top-k", type=whole, default=2, help="experts a token passes through")
    m.add_argument("--kv-heads", type=whole, help="key-value heads (GQA; 1: MQA; default "
                                                 "the heads); tp must divide them")
    m.add_argument("--ffn-hidden", type=whole, help="the MLP's width (default 4 d-model)")
    m.add_argument("--gated-mlp", action="store_true",
                   help="a gated MLP (SwiGLU): three matrices, not two")
    m.add_argument("--flash-attention", action="store_true",
                   help="a fused attention core: the scores neither stored nor streamed")
    m.add_argument("--no-dropout", action="store_true",
                   help="a model trained without dropout (Llama): no masks stored or written; "
                        "implied by --calibration (strategies.train's GPT has none)")
    c = ap.add_argument_group("CLUSTER")
    c.add_argument("--preset", choices=sorted(clusters.PRESETS), help="a machine's figures")
    c.add_argument("--nodes", type=whole, help="nodes (default 1)")
    c.add_argument("--gpus-per-node", type=whole,
                   help="GPUs a node (with --calibration: ranks a host, default its cores)")
    c.add_argument("--gpu-mem-gib", type=finite, help="memory a GPU, GiB")
    c.add_argument("--gpu-tflops", type=finite, help="dense 16-bit peak a GPU, TFLOP/s")
    c.add_argument("--intra-gbps", type=finite, help="Gbit/s a GPU, each way, inside a node")
    c.add_argument("--inter-gbps", type=finite, help="Gbit/s a node, each way, between nodes")
    c.add_argument("--hbm-gbps", type=finite, help="a GPU's memory bandwidth, GB/s (the "
                                                   "presets': their datasheets')")
    c.add_argument("--gemm-best", type=finite, help="share of the peak the best GEMMs reach "
                                                    "(the presets': measured; else 0.8)")
    c.add_argument("--efficiency", type=finite,
                   help="one flat share of the peak for every FLOP, in place of the "
                        "kernel-by-kernel model (experiments/planner/kernels.py)")
    c.add_argument("--calibration", metavar="FILE|DIR",
                   help="the machine at hand: experiments.calibrate's calibration.json")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="with --calibration: the machine at hand's ranks compute on its CPU "
                        "cores, or on its GPUs, which they share (default cpu)")
    s = ap.add_argument_group("what the planner may choose")
    s.add_argument("--zero", type=listing(whole), default=(0, 1, 2, 3), help="ZeRO stages")
    s.add_argument("--recompute", type=listing(str), default=RECOMPUTE,
                   help="none, selective, full")
    s.add_argument("--schedules", type=listing(str), default=("1f1b", "interleaved"),
                   help="pipeline schedules")
    s.add_argument("--micro-batch-sizes", type=listing(whole), default=(1, 2, 4, 8),
                   help="sequences a micro-batch")
    s.add_argument("--tp-sizes", type=listing(whole), help="tensor-parallel sizes (default all)")
    s.add_argument("--pp-sizes", type=listing(whole), help="pipeline sizes (default all)")
    s.add_argument("--cp-sizes", type=listing(whole),
                   help="context-parallel sizes (default all dividing the sequence; 1: none)")
    s.add_argument("--cp-kinds", type=listing(str), default=CONTEXT_KINDS,
                   help="ring (k, v passed along the cp ring, hidden behind attention), ulysses "
                        "(all-to-alls to heads and back, exposed); default both")
    s.add_argument("--pp-layers", type=listing(whole), metavar="N,N,...",
                   help="each pipeline stage's layers by hand, first to last (e.g. BLOOM's "
                        "5,6,6,6,6,6,6,6,6,6,6,5); default: the balanced split of every pp")
    s.add_argument("--precision", help="bf16, fp16 or fp32 (default bf16; fp32 with "
                                       "--calibration)")
    s.add_argument("--no-sequence-parallel", action="store_true",
                   help="keep norms and dropouts whole on every tp rank")
    s.add_argument("--fp32-main-grads", action="store_true",
                   help="the optimizer keeps fp32 copies of the gradients, as Megatron-LM's "
                        "mixed-precision optimizer does: 4 bytes a parameter more")
    o = ap.add_argument_group("output")
    o.add_argument("--top", type=whole, default=10, metavar="K", help="layouts in the table")
    add_output_flags(o, out_what="plan_frontier.png (.svg, .json)")
    o.add_argument("--verify", type=whole, default=0, metavar="N",
                   help="run the N best and the worst layouts here (needs --calibration)")
    o.add_argument("--steps", type=whole, default=6, help="--verify: steps a run, at least")
    o.add_argument("--measure-s", type=finite, default=MEASURED_S, metavar="S",
                   help="--verify: more steps where the first ones would take less than S "
                        "seconds after the warm-up, by the prediction (default %(default)s)")
    o.add_argument("--cluster", action="store_true", help="--verify on the emulated "
                   "cluster of --nodes x --gpus-per-node hosts' ranks at --inter-gbps (root)")
    return ap


def cluster_of(a, gpt):
    """The Cluster the flags describe; ValueError naming the flag that is wrong."""
    given = {k: getattr(a, k) for k in EXPLICIT + OPTIONAL if getattr(a, k) is not None}
    nodes = 1 if a.nodes is None else a.nodes
    if a.preset and a.calibration:
        raise ValueError("give --preset or --calibration, not both")
    if a.preset:
        return clusters.preset(a.preset, nodes=nodes, **given)
    if a.calibration:
        # the figures first: a wrong flag fails before the machine is timed
        clusters.Cluster("check", nodes, **{"gpus_per_node": 1, "gpu_mem_gib": 1,
                                            "gpu_tflops": 1, "intra_gbps": 1,
                                            "inter_gbps": 1, **given})
        calibration_of(a.calibration)
        ranks = a.gpus_per_node or os.cpu_count() or 1        # default: a rank a core
        machine = this_machine(gpt, ranks, a.calibration, nodes,
                               a.inter_gbps or 1.0, a.micro_batch_sizes, a.device,
                               replays="full" in a.recompute)
        return replace(machine, **given)
    missing = [k for k in EXPLICIT if k not in given]
    if missing:
        raise ValueError(f"CLUSTER: give --preset, --calibration, or all of --"
                         f"{', --'.join(k.replace('_', '-') for k in EXPLICIT)} "
                         f"(missing --{missing[0].replace('_', '-')})")
    return clusters.Cluster("cluster", nodes=nodes, **given)


def table(rows, top):
    """The top K that fit, one line each."""
    head = (f"{'#':>3} {'layout':<42} {'m':>4} {'GiB':>6} {'step s':>9} {'MFU':>6} "
            f"{'HFU':>6}  " + " ".join(f"{p:>7}" for p in PARTS))
    lines = [head]
    for i, r in enumerate(rows[:top], 1):
        split = " ".join(f"{100 * r[f'{p}_s'] / r['step_s']:6.1f}%" for p in PARTS)
        lines.append(f"{i:>3} {r['label']:<42} {r['micro_batches']:>4} "
                     f"{r['mem_bytes'] / clusters.GIB:6.1f} {r['step_s']:9.4g} "
                     f"{100 * r['mfu']:5.1f}% {100 * r['hfu']:5.1f}%  {split}")
    return "\n".join(lines)


def writable(path, flag, directory=False):
    """ValueError naming `flag` unless `path` can be written: a file, or with `directory`
    a directory (made later if missing), whose nearest existing ancestor we may write into."""
    kind, other = ("directory", "file") if directory else ("file", "directory")
    if os.path.exists(path) and os.path.isdir(path) != directory:
        raise ValueError(f"{flag} {path}: is a {other}, not a {kind}")
    if os.path.exists(path):
        if not os.access(path, os.W_OK | (os.X_OK if directory else 0)):
            raise ValueError(f"{flag} {path}: not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while directory and not os.path.exists(parent):      # --out's missing parents are made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: its directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write into {parent}")


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
        # the machine at hand runs strategies.train, whose GPT has no dropout
        # (strategies/model/models.py): its plan stores and writes no masks
        gpt = GPT(a.layers, a.d_model, a.heads, a.seq_len, a.vocab, a.global_batch,
                  a.experts, a.top_k, a.kv_heads, a.ffn_hidden, a.gated_mlp,
                  a.flash_attention, not (a.no_dropout or a.calibration))
        precision = a.precision or ("fp32" if a.calibration else "bf16")
        space = Space(a.zero, a.recompute, a.schedules, a.micro_batch_sizes,
                      precision=precision, sequence_parallel=not a.no_sequence_parallel,
                      # the machine at hand runs strategies.train, whose head is whole
                      whole_head=bool(a.calibration),
                      tp_sizes=a.tp_sizes, pp_sizes=a.pp_sizes, pp_layers=a.pp_layers,
                      cp_sizes=a.cp_sizes, cp_kinds=a.cp_kinds,
                      fp32_main_grads=a.fp32_main_grads,
                      # the machine at hand runs strategies.train, whose optimizer is
                      # plain SGD (OptimizerOptions' default: no momentum buffer)
                      optimizer="sgd" if a.calibration else "adam")
        if a.pp_layers and sum(a.pp_layers) != gpt.layers:
            raise ValueError(f"--pp-layers {','.join(map(str, a.pp_layers))}: adds up to "
                             f"{sum(a.pp_layers)} layers, the model has {gpt.layers}")
        if a.nodes is not None and a.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {a.nodes}")
        if a.jsonl:
            writable(a.jsonl, "--jsonl")
        if a.out:
            writable(a.out, "--out", directory=True)
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
        if not any(e.fits for e in entries):
            nearest = entries[0]       # those that do not fit come by memory, least first
            raise ValueError(f"no layout fits: the nearest, {nearest.prediction.layout.label()}"
                             f", {nearest.why_out}")
    except (ValueError, OSError) as e:
        ap.error(" ".join(str(e).split()))
    except KeyError as e:               # a missing key's message is the key, quoted
        ap.error(f"missing {e.args[0]!r}")
    stamp = {"model": asdict(gpt), "cluster_figures": asdict(cluster, dict_factory=figures),
             "provenance": provenance()}
    records = [{**e.record(cluster), "rank": i, "label": e.prediction.layout.label(), **stamp}
               for i, e in enumerate(entries, 1)]
    fits = [r for r in records if r["fits"]]
    shown = {id(e) for e in distinct(entries)}
    listed = [r for r, e in zip(records, entries) if r["fits"] and id(e) in shown]
    print(cluster.describe())
    print(f"{len(fits)} of {len(records)} layouts fit ({cluster.world} GPUs, "
          f"{cluster.memory_bytes / clusters.GIB:.1f} GiB usable a GPU); predicted "
          f"({len(fits) - len(listed)} near-duplicates not listed):")
    print(table(listed, a.top))
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
