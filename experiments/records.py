"""Result records: where they live, how to read them, and the provenance each one carries.

A results directory (written by experiments.sweep) holds
    records.jsonl   every measurement, one JSON object a line, each with
                    "command", "point", "config" (the point's full config) and
                    "provenance" (commit, MPI, torch, host, load average)
    points.jsonl    one line per launched point: "status" ok | failed | timeout,
                    the return code, the wall time and the path of its log
    logs/POINT.log  the point's stdout and stderr
Plots and the report read records.jsonl only.
"""
import os
from collections import Counter, defaultdict

# JSON Lines and provenance have one home below every package (allreduce/records.py);
# imported here for the readers of results and the launchers of experiments.
from allreduce.records import (ROOT, append_jsonl, mpiexec_path, provenance,  # noqa: F401
                               read_jsonl)


def load(results_dir):
    """Every measurement record of a results directory."""
    return read_jsonl(os.path.join(results_dir, "records.jsonl"))


def train_runs(records, config=lambda c: True, step=lambda s: True):
    """{run_id: (config record, [step records])} of strategies.train's own --jsonl: the
    runs whose config record passes `config`, with their steps that pass `step`, in the
    order their steps were written."""
    configs = {r["run_id"]: r for r in records if r.get("kind") == "config" and config(r)}
    runs = {}
    for r in records:
        if r.get("kind") == "step" and r.get("run_id") in configs and step(r):
            runs.setdefault(r["run_id"], (configs[r["run_id"]], []))[1].append(r)
    return runs


def slowest_rank(steps):
    """{step: its slowest rank's step_time_s}: a step lasts as long as its slowest rank."""
    slowest = defaultdict(float)
    for s in steps:
        slowest[s["step"]] = max(slowest[s["step"]], s["step_time_s"])
    return slowest


# Which records compare: a figure draws one group of runs that differ only in what
# it compares (experiments/plots.py).
def most_common(values):
    counts = Counter(values)
    return max(counts, key=lambda v: (counts[v], v == "float32")) if counts else None


# Two training runs compare when these agree: the same model, of the same size, on
# the same data and global batch, on as many ranks.
MODEL_KEYS = ("model", "width", "depth", "in_dim", "classes", "layers", "d_model", "heads",
              "vocab", "seq_len", "data", "dataset_size", "global_batch", "world_size")


def model_of(config, *more):
    return tuple(config.get(k) for k in MODEL_KEYS + more)


def describe(c):
    """The model, batch and world of a config in a few words, for a title."""
    size = f"mlp {c.get('depth')} x {c.get('width')}"
    if c.get("model") in ("gpt", "moe"):
        size = f"{c['model']} {c.get('layers')} blocks x d {c.get('d_model')}"
    if c.get("model") == "moe":
        size += f" x {c.get('experts')} experts, top-{c.get('top_k')}"
    return f"{size}, batch {c.get('global_batch')}, {c.get('world_size', 1)} ranks"


def one_comparison(runs, same, variant):
    """The runs ({key: [records]}) of one group of equal `same(config)`: the group with the
    most distinct `variant(key, config)` (then the most runs).  Runs of another model or
    world are not drawn beside it as if they compared."""
    groups = defaultdict(dict)
    for k, v in runs.items():
        groups[same(v[0].get("config", {}))][k] = v
    return max(groups.values(), default={}, key=lambda g: (
        len({variant(k, v[0].get("config", {})) for k, v in g.items()}), len(g)))


def labelled(runs):
    """[(label, records)] of runs ({key: records}) in the order of their labels: the
    strategy's name (key[0]); where runs share one, the config values that differ."""
    by_name = defaultdict(list)
    for key in runs:
        by_name[key[0]].append(key)
    labels = {}
    for name, keys in by_name.items():
        configs = {k: runs[k][0].get("config", {}) for k in keys}
        varying = sorted({f for c in configs.values() for f in c
                          if len({repr(c2.get(f)) for c2 in configs.values()}) > 1})
        for k in keys:
            extra = " ".join(f"{f}={configs[k].get(f)}" for f in varying)
            labels[k] = f"{name} {extra}" if len(keys) > 1 else name
    return sorted(((labels[k], v) for k, v in runs.items()), key=lambda lv: lv[0])


def allreduce_rows(records):
    """The all-reduce rows of one dtype and device (the most measured), each labelled by
    its variant: an algorithm over another transport, or a hierarchical composition,
    is a line of its own."""
    rows = [r for r in records if r.get("command") == "allreduce.bench"
            and r.get("op") == "allreduce" and r.get("world_size", 1) > 1]
    dtype = most_common(r.get("dtype") for r in rows)
    device = most_common(r.get("device", "cpu") for r in rows)
    return [{**r, "variant": variant_of(r)} for r in rows
            if r.get("dtype") == dtype and r.get("device", "cpu") == device]


def variant_of(r):
    c, label = r.get("config", {}), r["algo"]
    if r["algo"] == "hierarchical":
        return label + (f" ({c.get('inner', 'ring')}/{c.get('outer', 'ring')}, "
                        f"{c.get('ranks_per_node') or 'host'} a node)")
    return label + (" over torch" if r.get("transport") == "torch" and label != "torch" else "")
