"""Every layout of a model on a cluster: which are out and why, the rest ranked by step time.

    space = Space(zero=(0, 1), recompute=("full",))      # what the planner may choose
    ranked = plan(gpt, cluster, space)                   # [Entry], the feasible first
    ranked[0].prediction.layout                          # the fastest layout that fits

A layout uses every GPU: dp x pp x tp = nodes x GPUs a node.  What is never a
layout, and so never listed:
    tp that does not divide a node's GPUs (tp stays inside a node) or the heads;
    pp that does not divide the layers (every stage holds as many);
    a micro-batch size b that does not divide the global batch's share of a
        replica, B / dp (m = B / (dp b) micro-batches);
    the interleaved schedule without a pipeline, with v chunks that do not divide
        a stage's layers, or with m not a multiple of pp (Megatron-LM's rule);
    ep that does not divide both dp and the experts.
What is a layout but does not fit: a rank needs more memory than the GPU's
usable share (cluster.USABLE_MEMORY); its Entry says how much and which part.
"""
from dataclasses import dataclass

from .cluster import GIB
from .step import BYTES, Layout, predict
from .transformer import RECOMPUTE

SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True)
class Space:
    """The choices the planner may make; each a tuple of allowed values."""
    zero: tuple = (0, 1, 2, 3)
    recompute: tuple = RECOMPUTE
    schedules: tuple = SCHEDULES
    micro_batch_sizes: tuple = (1, 2, 4, 8)
    max_virtual_stages: int = 8          # interleaved: every v from 2 to this dividing a stage
    precision: str = "bf16"
    sequence_parallel: bool = True
    whole_head: bool = False             # the worker's head (Layout.whole_head)
    tp_sizes: tuple = None               # the tensor- and pipeline-parallel sizes allowed
    pp_sizes: tuple = None               # (None: every one the rules allow)

    def __post_init__(self):
        checks = (("zero", self.zero, (0, 1, 2, 3)), ("recompute", self.recompute, RECOMPUTE),
                  ("schedules", self.schedules, SCHEDULES))
        for name, values, allowed in checks:
            wrong = [v for v in values if v not in allowed] or ([] if values else ["nothing"])
            if wrong:
                raise ValueError(f"--{name.replace('_', '-')}: {wrong[0]!r} is not one of "
                                 f"{', '.join(map(str, allowed))}")
        for name in ("tp_sizes", "pp_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or min(sizes) < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {sizes}")
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError(f"--micro-batch-sizes must be >= 1, got {self.micro_batch_sizes}")
        if self.precision not in BYTES:
            raise ValueError(f"--precision must be one of {', '.join(BYTES)}, "
                             f"got {self.precision!r}")


@dataclass(frozen=True)
class Entry:
    prediction: object           # step.Prediction
    fits: bool
    why_out: str                 # "" for a layout that fits

    def record(self, cluster):
        return self.prediction.record(cluster, self.fits, self.why_out)


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(gpt, cluster, space):
    """Every Layout of `gpt` on `cluster` within `space` (the module's rules)."""
    G, world = cluster.gpus_per_node, cluster.world
    for tp in divisors(G):
        if gpt.heads % tp or world % tp or (space.tp_sizes and tp not in space.tp_sizes):
            continue
        for pp in divisors(world // tp):
            if gpt.layers % pp or (space.pp_sizes and pp not in space.pp_sizes):
                continue
            dp = world // (tp * pp)
            if gpt.global_batch % dp:
                continue
            eps = [e for e in divisors(dp) if gpt.experts % e == 0] if gpt.experts else [1]
            for b in space.micro_batch_sizes:
                if (gpt.global_batch // dp) % b:
                    continue
                m = gpt.global_batch // (dp * b)
                schedules = [("1f1b", 1)] + [
                    ("interleaved", v) for v in range(2, space.max_virtual_stages + 1)
                    if pp > 1 and (gpt.layers // pp) % v == 0 and m % pp == 0]
                for schedule, v in schedules:
                    if schedule not in space.schedules:
                        continue
                    for ep in eps:
                        # ZeRO shards over dp: with one replica every stage is stage 0's
                        for zero in (space.zero if dp > 1 else space.zero[:1]):
                            for recompute in space.recompute:
                                yield Layout(dp, pp, tp, ep, zero, m, b, schedule, v, recompute,
                                             space.precision, space.sequence_parallel and tp > 1,
                                             space.whole_head and tp > 1)


def why_out(prediction, cluster):
    """'' when the fullest rank fits, else how far over and which part is largest."""
    if prediction.mem_bytes <= cluster.memory_bytes:
        return ""
    part = max(prediction.memory, key=prediction.memory.get)
    return (f"needs {prediction.mem_bytes / GIB:.1f} GiB a rank (most of it {part}: "
            f"{prediction.memory[part] / GIB:.1f} GiB), {cluster.memory_bytes / GIB:.1f} "
            f"GiB usable")


def plan(gpt, cluster, space=Space()):
    """[Entry] of every layout: those that fit by predicted step time, then the rest by
    memory.  ValueError when the model has no layout on the cluster at all."""
    entries = []
    for layout in layouts(gpt, cluster, space):
        p = predict(gpt, cluster, layout)
        why = why_out(p, cluster)
        entries.append(Entry(p, not why, why))
    if not entries:
        raise ValueError(f"no layout of this model on {cluster.world} GPUs: dp x pp x tp must "
                         f"use them all with tp dividing {cluster.gpus_per_node} and the heads "
                         f"({gpt.heads}), pp the layers ({gpt.layers}) and dp the global batch "
                         f"({gpt.global_batch})")
    # ties in time go to the layout with less memory a rank
    entries.sort(key=lambda e: (not e.fits, e.prediction.step_s if e.fits else 0,
                                e.prediction.mem_bytes))
    return entries


def pareto(items, step=lambda e: e.prediction.step_s, memory=lambda e: e.prediction.mem_bytes):
    """The items no other beats in both step time and memory, fastest first (entries that
    fit, or the planner's records with step=itemgetter("step_s"), ...)."""
    front, least = [], float("inf")
    for item in sorted(items, key=lambda x: (step(x), memory(x))):
        if memory(item) < least:
            front.append(item)
            least = memory(item)
    return front
