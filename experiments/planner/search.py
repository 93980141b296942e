"""Every layout of a model on a cluster: which are out and why, the rest ranked by step time.

    space = Space(zero=(0, 1), recompute=("full",))      # what the planner may choose
    ranked = plan(gpt, cluster, space)                   # [Entry], the feasible first
    ranked[0].prediction.layout                          # the fastest layout that fits

A layout uses every GPU: dp x cp x pp x tp = nodes x GPUs a node, cp carved out
of the replicas (step.py).  What is never a layout, and so never listed (rules():
the same list, each with its test):
    tp that does not divide a node's GPUs (tp stays inside a node), the heads or
        the key-value heads (each tp rank holds whole groups of query heads with
        their key-value head: Megatron-LM's rule; we never replicate a
        key-value head over tp ranks);
    pp above the layers (every stage holds at least one; stage_layers of
        strategies/parallel/stages.py says how many each, balanced or --pp-layers')
        or above its MAX_STAGES;
    dp that does not divide the global batch, a micro-batch size b that does not
        divide a replica's share B / dp (m = B / (dp b) micro-batches);
    cp that does not divide the sequence (each cp rank holds an equal slice of its
        positions); Ulysses with cp not dividing a tp rank's heads (it splits
        whole heads); cp with a mixture of experts (the trainer runs it, its
        expert groups cut out of the dp x cp replicas, but no published run or
        --verify has checked the step's pricing of it: not searched);
    the interleaved schedule without a pipeline, with more chunks v than a stage's
        layers (each chunk holds one at least, but for the first and the last
        stage's chunk of the embedding or the head alone: stages.max_chunks; where v
        does not divide a stage's layers its chunks are uneven: stages.chunk_share),
        or with m not a multiple of pp (Megatron-LM's rule);
    ep that does not divide both dp and the experts.
The sizes are found as divisors of gcd(B, world / tp) (dp), of gcd(s, world / (tp
dp)) (cp) and by pp <= layers, never by counting up to the world: a million nodes
are searched at once.  Both kinds of context parallelism are searched unless
Space.cp_kinds says one: the ring hides its transfers behind attention but moves
every other rank's keys; Ulysses moves a cp-th of q, k, v and the output, exposed.
What is a layout but does not fit: a rank needs more memory than the GPU's
usable share (cluster.USABLE_MEMORY); its Entry says how much and which part.
"""
from dataclasses import dataclass

import math

from strategies.parallel.stages import MAX_STAGES

from .cluster import GIB
from .stages import balanced_stages, max_chunks
from .step import BYTES, Layout, ends_worth, predict
from .transformer import CONTEXT_KINDS, RECOMPUTE

SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True)
class Space:
    """The choices the planner may make; each a tuple of allowed values."""
    zero: tuple = (0, 1, 2, 3)
    recompute: tuple = RECOMPUTE
    schedules: tuple = SCHEDULES
    micro_batch_sizes: tuple = (1, 2, 4, 8)
    max_virtual_stages: int = 8          # interleaved: every v from 2 to this, <= a stage
    precision: str = "bf16"
    sequence_parallel: bool = True
    whole_head: bool = False             # the worker's head (Layout.whole_head)
    tp_sizes: tuple = None               # the tensor- and pipeline-parallel sizes allowed
    pp_sizes: tuple = None               # (None: every one the rules allow)
    pp_layers: tuple = None              # each stage's layers by hand (its length is pp)
    cp_sizes: tuple = None               # the context-parallel sizes allowed (None: every one)
    cp_kinds: tuple = CONTEXT_KINDS      # ring, ulysses: both searched
    fp32_main_grads: bool = False        # Megatron-LM's fp32 gradient copy (Layout's)
    optimizer: str = "adam"              # the update's (Layout's): adam, momentum, sgd

    def __post_init__(self):
        checks = (("zero", self.zero, (0, 1, 2, 3)), ("recompute", self.recompute, RECOMPUTE),
                  ("schedules", self.schedules, SCHEDULES),
                  ("cp_kinds", self.cp_kinds, CONTEXT_KINDS))
        for name, values, allowed in checks:
            wrong = [v for v in values if v not in allowed] or ([] if values else ["nothing"])
            if wrong:
                raise ValueError(f"--{name.replace('_', '-')}: {wrong[0]!r} is not one of "
                                 f"{', '.join(map(str, allowed))}")
        for name in ("tp_sizes", "pp_sizes", "cp_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or min(sizes) < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {sizes}")
        if self.pp_layers is not None and (not self.pp_layers or min(self.pp_layers) < 1):
            raise ValueError(f"--pp-layers must list each stage's layers, each >= 1, "
                             f"got {self.pp_layers}")
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError(f"--micro-batch-sizes must be >= 1, got {self.micro_batch_sizes}")
        if self.precision == "fp8":     # step.BYTES prices its memory, not its matmuls
            raise ValueError("--precision 'fp8' is not built in the planner: it prices every "
                             "matmul at the GPU's 16-bit peak (--gpu-tflops), with no fp8 rate")
        if self.precision not in BYTES:
            raise ValueError(f"--precision must be one of fp32, bf16, fp16, "
                             f"got {self.precision!r}")


@dataclass(frozen=True)
class Entry:
    prediction: object           # step.Prediction
    fits: bool
    why_out: str                 # "" for a layout that fits

    def record(self, cluster):
        return self.prediction.record(cluster, self.fits, self.why_out)


def divisors(n):
    """The divisors of n, ascending, by trial up to sqrt(n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def rules(gpt, cluster, space):
    """[(the rule, the sizes it leaves)] in the order the search applies them, each
    narrowing the last: what "no layout" reports, naming the first that leaves none."""
    G, world, B = cluster.gpus_per_node, cluster.world, gpt.global_batch
    tps = divisors(G)
    steps = [(f"tp divides a node's {G} GPUs", tps)]
    tps = [t for t in tps if gpt.heads % t == 0 and gpt.kv_heads % t == 0]
    steps.append((f"tp divides the heads ({gpt.heads}) and the key-value heads "
                  f"({gpt.kv_heads})", tps))
    if space.tp_sizes:
        tps = [t for t in tps if t in space.tp_sizes]
        steps.append((f"--tp-sizes {','.join(map(str, space.tp_sizes))}", tps))
    # (tp, dp, cp): cp divides the sequence and what tp and dp leave; pp the rest
    pairs = [(t, dp, c) for t in tps for dp in divisors(math.gcd(B, world // t))
             for c in divisors(math.gcd(gpt.seq_len, world // (t * dp)))
             if c == 1 or not gpt.experts]
    steps.append((f"dp divides the global batch ({B}), cp the sequence ({gpt.seq_len})",
                  pairs))
    if space.cp_sizes:
        pairs = [(t, dp, c) for t, dp, c in pairs if c in space.cp_sizes]
        steps.append((f"--cp-sizes {','.join(map(str, space.cp_sizes))}", pairs))
    if "ring" not in space.cp_kinds:
        pairs = [(t, dp, c) for t, dp, c in pairs if (gpt.heads // t) % c == 0]
        steps.append((f"Ulysses' cp divides a tp rank's heads ({gpt.heads} / tp)", pairs))
    pairs = [(t, dp, c) for t, dp, c in pairs
             if world // (t * dp * c) <= min(gpt.layers, MAX_STAGES)]
    steps.append((f"pp = {world} GPUs / (tp dp cp) is at most the layers ({gpt.layers}) "
                  f"and {MAX_STAGES}", pairs))
    if space.pp_sizes:
        pairs = [(t, dp, c) for t, dp, c in pairs if world // (t * dp * c) in space.pp_sizes]
        steps.append((f"--pp-sizes {','.join(map(str, space.pp_sizes))}", pairs))
    if space.pp_layers:
        pp = len(space.pp_layers)
        pairs = [(t, dp, c) for t, dp, c in pairs if world // (t * dp * c) == pp]
        steps.append((f"--pp-layers gives {pp} stages", pairs))
    pairs = [(t, dp, c) for t, dp, c in pairs
             if any((B // dp) % b == 0 for b in space.micro_batch_sizes)]
    steps.append((f"a micro-batch size ({','.join(map(str, space.micro_batch_sizes))}) "
                  f"divides a replica's share of the batch", pairs))
    return steps


def no_layout(gpt, cluster, space):
    """Why the model has no layout: the first rule that leaves no size, what it was
    given, and where the user's own --tp-sizes were ruled out before it."""
    steps = rules(gpt, cluster, space)
    for i, (rule, left) in enumerate(steps):
        if not left:
            before = steps[i - 1][1] if i else []
            if before and isinstance(before[0], tuple):    # (tp, dp, cp): say the pp left
                pps = sorted({cluster.world // (t * dp * c) for t, dp, c in before})
                kept = f" (of pp {','.join(map(str, pps[:12]))}{',...' * (len(pps) > 12)})"
            else:
                kept = f" (of tp {','.join(map(str, before))})" if before else ""
            dropped = [(t, next(r for r, sizes in steps if t not in sizes))
                       for t in (space.tp_sizes or ()) if rule.startswith("--tp-sizes")]
            why = "".join(f"; tp {t} is out once {r}" for t, r in dropped)
            return (f"no layout of this model on {cluster.world} GPUs: none is left once "
                    f"{rule}{kept}{why}")
    return f"no layout of this model on {cluster.world} GPUs"


def layouts(gpt, cluster, space):
    """Every Layout of `gpt` on `cluster` within `space` (the module's rules)."""
    world, B = cluster.world, gpt.global_batch
    for tp, dp, cp in rules(gpt, cluster, space)[-1][1]:
        pp = world // (tp * dp * cp)
        eps = [e for e in divisors(dp) if gpt.experts % e == 0] if gpt.experts else [1]
        kinds = [k for k in space.cp_kinds if k == "ring" or (gpt.heads // tp) % cp == 0] \
            if cp > 1 else space.cp_kinds[:1]
        for b in space.micro_batch_sizes:
            if (B // dp) % b:
                continue
            m = B // (dp * b)
            for recompute in space.recompute:
                base = Layout(dp, pp, tp, 1, space.zero[0], m, b, "1f1b", 1, recompute,
                              space.precision, space.sequence_parallel and tp > 1,
                              space.whole_head and tp > 1, cp=cp, cp_kind=kinds[0])
                stages = balanced_stages(gpt, base, ends_worth(gpt, base, cluster),
                                         space.pp_layers)
                schedules = [("1f1b", 1)] + [
                    ("interleaved", v) for v in range(2, space.max_virtual_stages + 1)
                    if pp > 1 and v <= max_chunks(stages) and m % pp == 0]
                for schedule, v in schedules:
                    if schedule not in space.schedules:
                        continue
                    for ep, kind in ((ep, kind) for ep in eps for kind in kinds):
                        # ZeRO shards over dp x cp: with one replica every stage is stage 0's
                        for zero in (space.zero if dp * cp > 1 else space.zero[:1]):
                            yield Layout(dp, pp, tp, ep, zero, m, b, schedule, v, recompute,
                                         space.precision, space.sequence_parallel and tp > 1,
                                         space.whole_head and tp > 1, stages, cp, kind,
                                         space.fp32_main_grads, space.optimizer)


def why_out(prediction, cluster):
    """'' when the fullest rank fits, else how far over and which part is largest."""
    if prediction.mem_bytes <= cluster.memory_bytes:
        return ""
    part = max(prediction.memory, key=prediction.memory.get)
    return (f"needs {prediction.mem_bytes / GIB:.3g} GiB a rank (most of it {part}: "
            f"{prediction.memory[part] / GIB:.3g} GiB), {cluster.memory_bytes / GIB:.3g} "
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
        raise ValueError(no_layout(gpt, cluster, space))
    # ties in time go to the layout with less memory a rank
    entries.sort(key=lambda e: (not e.fits, e.prediction.step_s if e.fits else 0,
                                e.prediction.mem_bytes))
    return entries


def distinct(entries, within=1e-3):
    """The entries without near-duplicates: a layout that differs from one listed before
    it only in its ZeRO stage and is within `within` of its step time (ZeRO 1 and 2
    often tie: both reduce-scatter, and the gradients' memory is all they differ in;
    the one listed first, with less memory, stands for both)."""
    kept, seen = [], {}
    for e in entries:
        lo = e.prediction.layout
        key = (e.fits, lo.dp, lo.pp, lo.tp, lo.cp, lo.cp_kind, lo.ep, lo.micro_batch_size,
               lo.schedule, lo.virtual_stages, lo.recompute, lo.stages)
        if any(abs(e.prediction.step_s / s - 1) <= within for s in seen.get(key, ())):
            continue
        seen.setdefault(key, []).append(e.prediction.step_s)
        kept.append(e)
    return kept


def pareto(items, step=lambda e: e.prediction.step_s, memory=lambda e: e.prediction.mem_bytes):
    """The items no other beats in both step time and memory, fastest first (entries that
    fit, or the planner's records with step=itemgetter("step_s"), ...)."""
    front, least = [], float("inf")
    for item in sorted(items, key=lambda x: (step(x), memory(x))):
        if memory(item) < least:
            front.append(item)
            least = memory(item)
    return front
