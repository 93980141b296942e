"""One layout's step on a cluster, predicted: its time, split by cause, and its memory per rank.

    layout = Layout(dp=4, pp=2, tp=4, micro_batches=8, micro_batch_size=1)
    p = predict(gpt, cluster, layout)
    p.step_s, p.split          # {"compute", "tp", "cp", "pp", "dp", "ep", "bubble",
                               # "update"}: seconds, their sum step_s
    p.mem_bytes, p.memory      # the fullest rank, and its parts

Ranks are laid out as the trainer lays them (strategies/config/mesh.py): arange(world)
reshaped (dp cp, pp, tp), tp fastest, and a node holds G consecutive ranks.  A tp
group is inside a node (the planner never puts it across); a pp, cp or dp group
whose members lie stride apart spans nodes once stride x size > G, and then the
groups of its axis that cross a node's link at once share it (placement()).
Context parallelism is carved out of the replicas (torchtitan's dp_shard_cp): a
context group is cp consecutive replicas, pp tp apart, which hold the same
parameters and see the same sequences, s / cp positions each; the gradients are
reduced, and ZeRO shards, over all dp cp replicas.

A stage holds the layers stages.py gives it (Layout.stages; the trainer's rule), the
first stage the embedding too and the last the logit layer; the slowest stage
paces the pipeline.  A micro-batch of b sequences on one stage takes

    forward    its kernels on a tp rank's share               (kernels.py: GEMMs by
                 their shape, the rest by the memory's bandwidth; with --efficiency
                 or a rate measured here, its FLOPs / tp at that flat rate; the
                 logit layer's whole on every tp rank with Layout.whole_head)
               + 2 all-reduces of b s h values a layer on tp   (Megatron's f and g;
                 with sequence parallelism 2 all-gathers and 2 reduce-scatters, the
                 same bytes; the worker's own list: block_collectives; the same with
                 GQA, any MLP width or gating: they carry the layer's h-wide input
                 and output, never its keys, values or MLP activations)
               + 2 all-to-alls a MoE layer on ep               (dispatch, combine)
               + with cp > 1, the context group's traffic a layer (cp_layer: the ring's
                 k, v blocks overlapped with the attention of the block at hand, what
                 outlasts it exposed; Ulysses' 2 all-to-alls, exposed,
                 each exchange waiting for a shared core: beside tp, for a rank
                 of another tp group, not in step with its own)
    backward   twice the forward's FLOPs, recomputation's on top, the same communication
               (with sequence parallelism an all-gather more for each column-parallel
               layer, and 6 small all-reduces of replicated weights' gradients; full
               recomputation replays the forward's too)
               + with the worker's whole head and sequence parallelism, the head's
                 all-gather (forward), the embedding's (backward) and ln_f's two
                 gradients (edge_collectives)

none of which overlaps the compute (Megatron runs them in line); on ranks that share
CPU cores each tp all-reduce also waits for its peers' turns, and so does the
data-parallel exchange right after the backward, once a step (shared_cores.py).  The pipeline
runs (v m + p - 1) slots of a micro-batch's forward and backward on one chunk, the
heaviest of the pipeline (stages.chunk_share: a v-th of a stage cut evenly), each slot
sending an activation and its gradient (costmodel.pipeline_step_time); the p - 1
idle slots are the bubble, strategies/parallel/bubble.py's fraction of them, and so
is what uneven chunks leave idle of the paced slots.
Then the data-parallel axis, as the worker runs it (strategies/sync/buckets.py):
ZeRO 0-2 reduce the gradients in buckets of the trainer's --bucket-mb during the
last micro-batch's backward, each bucket once the backward has filled it, so only
what outlasts that backward is exposed, and never less than the last bucket's
share (`bucketed`); ZeRO 1 and 2 then all-gather the
updated parameters (exposed); ZeRO 3 gathers each layer's parameters when its
forward and its backward begin, in line (the worker gathers on demand, with no
prefetch: exposed; on shared cores each gather waits for a replica's turn, as an
exchange across tp groups does), and reduce-scatters each layer's gradients once
its backward is done (a bucket a layer), every micro-batch.  Where the cluster's
ranks cannot run the two at once (CPU cores: Cluster.overlaps), what the group
would cost inside one node (the copies and additions, on the cores) is exposed,
and only its time on the wire between nodes overlaps.  On shared cores each
exchange of a parameter gather (ZeRO 3's, and ZeRO 1 and 2's after the update) comes
right after compute and waits for a replica's turn, as an exchange across tp groups
does (Cluster.cross_wait).
Last, the optimizer's update, once a step on the parameters the rank updates (its
ZeRO shard under ZeRO 1-3): element-wise, so priced as the streams are, by the bytes it
moves at the memory's bandwidth (update_seconds, kernels.update_bytes; Megatron-LM's
fused Adam is memory-bound too).  The embedding's gradient all-reduce between the first and last
stage is left out.

Memory: model states are strategies/runtime/memory.py's zero_memory for the parameters
a rank holds, activations Korthikanti et al.'s per layer (transformer.py) times
the layers of its stage times the micro-batches it holds at once
(bubble.activations_in_flight); under full recomputation one layer's whole
activations on top, while its backward replays it; the last stage's logits.
Each kind of stage is priced (stages.kinds_of_stage: the first, the last, the
fullest between them, which holds the most micro-batches of the most layers) and
the fullest rank's memory is the layout's; interleaved, a rank holds the layers of
the chunks its warm-up has run (stages.held_layers).

FLOPs: the model's (MFU's numerator, no recomputation) and the hardware's
(HFU's: with recomputation, what Narayanan et al.'s TFLOP/s a GPU counts).
"""
import math
from dataclasses import asdict, dataclass

from experiments.costmodel import cluster_collective_time, pipeline_step_time
from strategies.config.sections import SyncOptions
from strategies.parallel.bubble import activations_in_flight, bubble_fraction
from strategies.parallel.sequence_parallel import block_collectives, edge_collectives
from strategies.runtime.memory import zero_memory

from . import kernels
from .stages import chunk_share, held_layers, kinds_of_stage, stage_chunks, stages_of
from .transformer import (attention_core_flops, embedding_parameters, expert_parameters,
                          layer_activation_bytes, layer_forward_flops, logit_flops,
                          logits_bytes, parameters, recompute_flops, step_flops)

# Bytes of an activation and of a value on the wire.  fp8 is bf16's: the trainer runs
# everything but the linear layers' matmuls under bf16's autocast and keeps bf16's
# 16-bit buffers (strategies/runtime/precision.py's HALF_DTYPES), and its model states
# are bf16's (zero_memory).  Not modelled: a linear layer keeps its input as an 8-bit
# copy for the backward where bf16 keeps 16 bits, and an 8-bit copy of its weight a
# micro-batch (strategies/runtime/fp8_linear.py's Fp8Matmul); nor fp8's GEMM rate.
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
# The trainer's gradient buckets (ZeRO 0-2: strategies/sync/zero.py), at its default.
BUCKET_BYTES = SyncOptions.bucket_mb * 2**20
# Megatron-LM's mixed-precision optimizer copies the 16-bit gradients into fp32 main
# gradients for the update: 20 bytes a parameter with fp16 parameters and gradients,
# not ZeRO's 16 (Megatron-LM's guide to its distributed optimizer, its table of bytes a
# parameter: 20 without the distributed optimizer, 4 + 16 / d with it, the copy
# sharded with the optimizer's state).
MAIN_GRAD_BYTES = 4
PARTS = ("compute", "tp", "cp", "pp", "dp", "ep", "bubble", "update")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1                  # borrowed from dp: the experts split over ep of the dp ranks
    zero: int = 0
    micro_batches: int = 1       # per step and dp replica
    micro_batch_size: int = 1    # sequences
    schedule: str = "1f1b"       # or "interleaved"
    virtual_stages: int = 1      # interleaved: chunks a rank
    recompute: str = "none"      # none, selective, full
    precision: str = "bf16"
    sequence_parallel: bool = True
    # the logit layer whole on every tp rank, as strategies.train keeps it, where
    # Megatron splits it over the vocabulary (Narayanan et al.'s layouts, the presets)
    whole_head: bool = False
    stages: tuple = None         # layers of each stage (None: stage_layers's even split)
    cp: int = 1                  # carved out of the replicas: s / cp positions a rank
    cp_kind: str = "ring"        # or "ulysses" (transformer.CONTEXT_KINDS)
    # the optimizer keeps the gradients in fp32 besides the 16-bit ones, as Megatron-LM's
    # mixed-precision optimizer does (its main_grad): MAIN_GRAD_BYTES a parameter more
    fp32_main_grads: bool = False
    # the update's optimizer, as strategies.runtime.memory names it: adam, momentum (SGD
    # with a momentum buffer) or sgd (none); its states' bytes and the update's traffic
    optimizer: str = "adam"

    @property
    def world(self):
        return self.dp * self.cp * self.pp * self.tp

    @property
    def replicas(self):
        """The ranks holding the same parameters: the gradients' and ZeRO's group."""
        return self.dp * self.cp

    def label(self):
        """'dp8 pp2 tp4 z1 b2 full' (and the schedule where interleaved, the stages'
        layers where uneven: 'pp12:5-6-5' for 5, 6 x 10, 5; 'cp16-ring' where cp > 1)."""
        text = f"dp{self.dp} pp{self.pp}"
        if self.stages and len(set(self.stages)) > 1:
            inner = self.stages[1:-1]
            middle = f"{min(inner)}" if inner and min(inner) == max(inner) else \
                f"{min(inner)}..{max(inner)}" if inner else ""
            text += ":" + "-".join(str(n) for n in (self.stages[0], middle, self.stages[-1])
                                   if n != "")
        text += f" tp{self.tp}"
        text += f" cp{self.cp}-{self.cp_kind}" if self.cp > 1 else ""
        text += f" ep{self.ep}" if self.ep > 1 else ""
        text += f" z{self.zero} b{self.micro_batch_size}"
        text += f" v{self.virtual_stages}" if self.schedule == "interleaved" else ""
        return text + ("" if self.recompute == "none" else f" {self.recompute}")


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    step_s: float
    split: dict                  # PARTS -> seconds
    mem_bytes: float             # the fullest rank
    memory: dict                 # params, grads, optimizer, activations of that rank
    flops: float                 # of the whole step, recomputation included (HFU's)
    model_flops: float = None    # of the whole step without recomputation (MFU's)

    def utilisation(self, cluster):
        """(MFU, HFU): the model's and the hardware's FLOPs a second a GPU over its peak."""
        peak = self.step_s * self.layout.world * cluster.gpu_tflops * 1e12
        return self.model_flops / peak, self.flops / peak

    def record(self, cluster, fits, why=""):
        """The JSONL record of this layout (the planner writes one per layout):
        tflops_per_gpu counts the model's FLOPs, hardware_tflops_per_gpu recomputation's too."""
        seconds = self.step_s * self.layout.world * 1e12
        mfu, hfu = self.utilisation(cluster)
        return {"kind": "plan", **asdict(self.layout), "fits": fits, "why_out": why,
                "mem_bytes": round(self.mem_bytes), "memory": {k: round(v) for k, v in
                                                               self.memory.items()},
                "step_s": self.step_s, "tflops_per_gpu": self.model_flops / seconds,
                "hardware_tflops_per_gpu": self.flops / seconds, "mfu": mfu, "hfu": hfu,
                **{f"{part}_s": t for part, t in self.split.items()},
                "cluster": cluster.name, "world": cluster.world}


def placement(size, stride, per_node):
    """(nodes, ranks a node, groups sharing a node's link) of a group of `size` ranks
    `stride` apart, nodes holding `per_node` consecutive ranks."""
    if size * stride <= per_node:
        return 1, size, 1
    together = max(1, per_node // stride)
    return -(-size // together), together, per_node // together


def group_time(collective, n, size, stride, cluster, on_one_node=False):
    """Seconds of one collective of n bytes on a group of `size` ranks `stride` apart;
    on_one_node: as if the group sat in one node (what its ranks' own work costs)."""
    if on_one_node:
        return cluster_collective_time(collective, n, 1, size, cluster.intra())
    nodes, R, sharing = placement(size, stride, cluster.gpus_per_node)
    return cluster_collective_time(collective, n, nodes, R, cluster.intra(),
                                   cluster.link(sharing) if nodes > 1 else None)


def exchanges(collective, t):
    """Steps of a ring collective over t ranks: 2 (t - 1) an all-reduce, t - 1 an
    all-gather or a reduce-scatter."""
    return (2 if collective == "allreduce" else 1) * (t - 1)


def tp_seconds(gpt, lo, b, e, cluster, collectives, replay=False):
    """(forward, backward) seconds of (forward, backward) lists of tp collectives
    (sequence_parallel's) on a micro-batch of b.  Where ranks share cores, each of
    their exchanges waits too (Cluster.tp_wait; replay: a recomputed forward's)."""
    if lo.tp == 1:
        return 0.0, 0.0
    size = {"activation": b * gpt.seq_len * gpt.d_model * e / lo.cp,
            "replicated": gpt.d_model * e}
    wait = cluster.tp_wait(lo.tp, b, replay)

    def seconds(listed):
        return sum(group_time(c, size[values], lo.tp, 1, cluster)
                   + exchanges(c, lo.tp) * wait
                   for c, values in listed)
    forward, backward = collectives
    return seconds(forward), seconds(backward)


def tp_layer(gpt, lo, b, e, cluster, replay=False):
    """(forward, backward) seconds of one layer's tp collectives on a micro-batch of b,
    those the worker makes (sequence_parallel.block_collectives); replay: as a
    recomputed forward makes them again."""
    return tp_seconds(gpt, lo, b, e, cluster, block_collectives(lo.sequence_parallel),
                      replay)


def tp_edges(gpt, lo, b, e, cluster):
    """(forward, backward) seconds of the slowest stage's embedding and head tp
    collectives on a micro-batch of b, where the head is the worker's, whole
    (sequence_parallel.edge_collectives): the last stage's head, and with one stage
    the embedding too.  Megatron's vocabulary-parallel head and its loss's small
    all-reduces are left out."""
    if not lo.whole_head:
        return 0.0, 0.0
    return tp_seconds(gpt, lo, b, e, cluster,
                      edge_collectives(lo.sequence_parallel, lo.pp == 1, True))


def cp_layer(gpt, lo, b, e, cluster, core):
    """(forward, backward) exposed seconds of one layer's context-parallel traffic on a
    micro-batch of b; core: (forward, backward) seconds of the layer's attention core
    on this rank (compute_seconds), the work the ring's transfers hide behind.

    A block is one of k, v (or their gradients) of a rank's s / cp positions, its tp
    share of the key-value heads (grouped-query attention sends h_kv-wide keys, as
    Llama 3's context parallelism does; the trainer repeats them to h: equal at
    kv_heads = heads).
      ring     strategies/parallel/ring_attention.py's schedule: forward, cp - 1 steps,
               each sending 2 blocks to the right neighbour while the block at hand
               (a cp-th of the core) is attended: only what outlasts it is exposed.
               Backward, cp - 1 steps of k, v and the dk, dv accumulator (4 blocks)
               beside a cp-th of the core's backward, and the accumulator's last
               send home (2 blocks) after it, exposed.  A ring is as fast as its
               slowest hop: a group that crosses nodes is paced by the link.
      ulysses  strategies/parallel/ulysses.py: q, k, v to heads and the output back,
               2 all-to-alls forward and 2 backward, none hidden (attention cannot
               start before them).  The keys and values travel h_kv wide where cp
               divides a tp rank's key-value heads, else repeated to h (as the
               trainer does).  Each comes right after compute, so where ranks share
               cores each of its cp - 1 exchanges waits: as a tp exchange of a group
               of cp does (Cluster.tp_wait) where the context group is consecutive
               ranks (tp = 1), and beside tp, where it pairs ranks of tp groups that
               are not in step with each other, what an exchange across tp groups
               waits (Cluster.cross_wait)."""
    cp = lo.cp
    if cp == 1:
        return 0.0, 0.0
    tokens = b * gpt.seq_len / cp
    if lo.cp_kind == "ulysses":
        kv = gpt.kv_width if (gpt.kv_heads // lo.tp) % cp == 0 else gpt.d_model
        qkv, out = (tokens * width / lo.tp * e for width in (gpt.d_model + 2 * kv, gpt.d_model))
        wait = cluster.cross_wait(lo.tp, b) if lo.tp > 1 else cluster.tp_wait(cp, b)
        one = sum(group_time("alltoall", n, cp, lo.pp * lo.tp, cluster)
                  + exchanges("alltoall", cp) * wait for n in (qkv, out))
        return one, one
    block = tokens * gpt.kv_width / lo.tp * e
    nodes, _, sharing = placement(cp, lo.pp * lo.tp, cluster.gpus_per_node)
    link = cluster.link(sharing) if nodes > 1 else cluster.intra()

    def send(blocks, messages):
        return messages * link.alpha + blocks * block * link.beta
    core_f, core_b = core
    forward = (cp - 1) * max(0.0, send(2, 1) - core_f / cp)
    backward = (cp - 1) * max(0.0, send(4, 2) - core_b / cp) + send(2, 1)
    return forward, backward


def bucketed(total, beside, buckets):
    """What outlasts `beside` seconds of backward of a collective of `total` seconds cut
    into `buckets` equal buckets, bucket i ready at i / buckets of the backward (as
    gradients fill them, last layer first).  Bucket i starts once it is ready and its
    predecessor is done, so the last one, ready only when the backward ends, never
    hides: total / buckets when the collectives keep up, else all they lag by."""
    return max(total / buckets, total - beside * (buckets - 1) / buckets)


def rank_parameters(gpt, lo, stage=0):
    """(dense, expert) parameters on a rank of `stage`: its layers' share over tp, the
    embeddings (word and position) on the first, the output layer's copy of the word
    embedding on the last; experts also over ep."""
    n = stages_of(gpt, lo)[stage]
    experts = expert_parameters(gpt) / gpt.layers * n / (lo.tp * lo.ep)
    layers = (parameters(gpt) - expert_parameters(gpt) - embedding_parameters(gpt)) \
        / gpt.layers * n / lo.tp
    if stage == 0:
        layers += embedding_parameters(gpt) / lo.tp
    if stage == lo.pp - 1 and lo.pp > 1:
        layers += gpt.vocab * gpt.d_model / lo.tp
    return layers, experts


def memory_of(gpt, lo, stage, ends=(0.0, 0.0)):
    """{params, grads, optimizer, activations} in bytes on a rank of `stage`; ends: the
    embedding's and the head's layers' worth, which shape uneven interleaved chunks
    (stages.stage_chunks)."""
    dense, experts = rank_parameters(gpt, lo, stage)
    states = zero_memory(dense, lo.replicas, lo.zero, lo.precision, lo.optimizer)
    for part, b in zero_memory(experts, lo.replicas // lo.ep, lo.zero, lo.precision,
                               lo.optimizer).items():
        states[part] += b
    if lo.fp32_main_grads:                      # sharded with the optimizer's state
        states["optimizer"] += MAIN_GRAD_BYTES * (
            dense / (lo.replicas if lo.zero else 1) +
            experts / (lo.replicas // lo.ep if lo.zero else 1))
    e, b = BYTES[lo.precision], lo.micro_batch_size
    layer = layer_activation_bytes(gpt, b, lo.tp, lo.sequence_parallel, lo.recompute, e,
                                   lo.cp)
    v = lo.virtual_stages
    held = activations_in_flight(lo.pp, lo.micro_batches, lo.schedule, stage, v)
    stages = stages_of(gpt, lo)
    acts = (held_layers(stage_chunks(stages, stage, v, ends), round(held * v), lo.pp)
            if v > 1 else held * stages[stage]) * layer
    if lo.recompute == "full":                  # the layer whose backward replays it
        acts += layer_activation_bytes(gpt, b, lo.tp, lo.sequence_parallel, "none", e,
                                       lo.cp)
    if stage == lo.pp - 1:
        acts += logits_bytes(gpt, b, 1 if lo.whole_head else lo.tp, lo.cp)
    return {**states, "activations": acts}


def update_seconds(gpt, lo, cluster, stage=0):
    """Seconds of the optimizer's update on a rank of `stage`: the parameters it updates,
    all of them under ZeRO 0, its shard of the replicas' (experts': of the replicas / ep
    holding them) under ZeRO 1-3 (Rajbhandari et al.: each rank updates its partition),
    at kernels.update_bytes a parameter."""
    dense, experts = rank_parameters(gpt, lo, stage)
    if lo.zero:
        dense, experts = dense / lo.replicas, experts / (lo.replicas // lo.ep)
    grad = MAIN_GRAD_BYTES if lo.fp32_main_grads else None
    return kernels.stream_seconds((dense + experts) * kernels.update_bytes(
        lo.precision, lo.optimizer, grad), cluster)


def compute_seconds(gpt, lo, cluster):
    """Seconds of a micro-batch's compute on one tp rank (of its s / cp positions):
    {"layer": (forward, backward), "head": (...), "embedding": (...), "core": (...)},
    the backward with recomputation's share; "core" is a layer's attention core alone
    (what the ring's transfers hide behind).  By kernels (kernels.py), or where the
    cluster has a flat rate (--efficiency, or a rate measured here), the FLOPs at that
    rate, and the model's ends (embeddings, head, loss) as measured where they were
    (Cluster.measured_ends), a third of them forward, on the last stage."""
    e, b, cp = BYTES[lo.precision], lo.micro_batch_size, lo.cp
    head_tp = 1 if lo.whole_head else lo.tp
    replayed_core = 1 if lo.recompute == "selective" else 0
    if not cluster.flat:
        layer = kernels.layer_seconds(gpt, b, lo.tp, lo.sequence_parallel, cluster, e, cp,
                                      lo.cp_kind)
        extra = {"none": 0.0, "selective": layer["selective"], "full": layer["forward"]}
        core = layer["selective"]
        return {"layer": (layer["forward"], layer["backward"] + extra[lo.recompute]),
                "head": kernels.head_seconds(gpt, b, head_tp, cluster, e, cp),
                "embedding": kernels.embedding_seconds(gpt, b, cluster, e, cp),
                "core": (core, (2 + replayed_core) * core)}
    rate = cluster.flops_per_s(b)
    block_rate = cluster.flops_per_s(b, lo.tp)        # a layer split over tp ranks
    replay_rate = cluster.flops_per_s(b, lo.tp, replay=lo.recompute == "full")
    head = logit_flops(gpt, b) / 3 / rate / head_tp / cp
    if cluster.ends_s(b) is not None:   # measured: the embeddings, the head and the loss
        head = cluster.ends_s(b) / 3 / head_tp / cp       # (on the last stage, all of it)
    forward = layer_forward_flops(gpt, b) / block_rate / lo.tp / cp
    backward = (2 * layer_forward_flops(gpt, b) / block_rate +
                recompute_flops(gpt, b, lo.recompute) / replay_rate) / lo.tp / cp
    core = attention_core_flops(gpt, b) / block_rate / lo.tp / cp
    return {"layer": (forward, backward), "head": (head, 2 * head), "embedding": (0.0, 0.0),
            "core": (core, (2 + replayed_core) * core)}


def ends_worth(gpt, lo, cluster, times=None):
    """(first, last): the embedding's and the head's time in layers' worth (a layer's
    compute and its tp and cp collectives), what stages.balanced_stages and
    stages.stage_chunks weigh the ends with; (0, 0) where a layer costs nothing to
    weigh them against.  times: compute_seconds's, where the caller has them."""
    e, b = BYTES[lo.precision], lo.micro_batch_size
    times = times or compute_seconds(gpt, lo, cluster)
    layer = sum(times["layer"]) + sum(tp_layer(gpt, lo, b, e, cluster)) + \
        sum(cp_layer(gpt, lo, b, e, cluster, times["core"]))
    if layer <= 0:
        return 0.0, 0.0
    return sum(times["embedding"]) / layer, sum(times["head"]) / layer


def predict(gpt, cluster, lo):
    """The Prediction of layout `lo` (a Layout) for model `gpt` on `cluster`."""
    e, b, G = BYTES[lo.precision], lo.micro_batch_size, cluster.gpus_per_node
    stages = stages_of(gpt, lo)
    # 1. one micro-batch on each kind of stage: compute, then tp's and ep's collectives
    times = compute_seconds(gpt, lo, cluster)
    replays = 1 if lo.recompute == "full" else 0      # the forward's collectives again
    tp_layer_f, tp_layer_b = tp_layer(gpt, lo, b, e, cluster)
    tp_replay_f = tp_layer(gpt, lo, b, e, cluster, replay=True)[0] if replays else 0.0
    tp_edge_f, tp_edge_b = tp_edges(gpt, lo, b, e, cluster)
    cp_layer_f, cp_layer_b = cp_layer(gpt, lo, b, e, cluster, times["core"])
    ep_one = 0.0
    if gpt.experts and lo.ep > 1:
        tokens = b * gpt.seq_len / lo.cp * gpt.d_model * gpt.top_k * e
        tokens /= lo.tp if lo.sequence_parallel else 1
        ep_one = group_time("alltoall", tokens, lo.ep, lo.pp * lo.tp, cluster)

    def stage_times(stage):
        """{part: (forward, backward)} of one micro-batch on `stage`."""
        L, last = stages[stage], stage == lo.pp - 1
        compute_f, compute_b = (L * t for t in times["layer"])
        if stage == 0:
            compute_f, compute_b = (c + t for c, t in zip((compute_f, compute_b),
                                                          times["embedding"]))
        if last:
            compute_f, compute_b = (c + t for c, t in zip((compute_f, compute_b),
                                                          times["head"]))
        tp_f = L * tp_layer_f + (tp_edge_f if last else 0.0)
        tp_b = L * (tp_layer_b + tp_replay_f) + (tp_edge_b if last else 0.0)
        return {"compute": (compute_f, compute_b), "tp": (tp_f, tp_b),
                "cp": (L * cp_layer_f, L * (cp_layer_b + replays * cp_layer_f)),
                "ep": (2 * L * ep_one, 2 * L * ep_one * (1 + replays))}
    priced = {stage: stage_times(stage) for stage in kinds_of_stage(stages)}
    # the stage whose heaviest chunk is slowest paces the pipeline (chunk_share: the
    # whole stage under 1F1B; its heaviest of v chunks interleaved)
    v, m = lo.virtual_stages, lo.micro_batches
    ends = ends_worth(gpt, lo, cluster, times) if v > 1 else (0.0, 0.0)
    shares = {stage: chunk_share(stages, stage, v, ends) for stage in priced}
    slowest = max(priced, key=lambda s: shares[s] *
                  sum(sum(pair) for pair in priced[s].values()))
    (compute_f, compute_b), (tp_f, tp_b), (cp_f, cp_b), (ep_f, ep_b) = (
        priced[slowest][part] for part in ("compute", "tp", "cp", "ep"))
    # 2. the data-parallel axis (dp x cp replicas): gradients (and parameters) of the
    #    fullest rank
    fullest = max(kinds_of_stage(stages), key=lambda s: sum(rank_parameters(gpt, lo, s)))
    dense, experts = rank_parameters(gpt, lo, fullest)

    def dp_time(collective, on_one_node=False):
        t = group_time(collective, dense * e, lo.replicas, lo.pp * lo.tp, cluster,
                       on_one_node)
        if experts and lo.replicas // lo.ep > 1:
            t += group_time(collective, experts * e, lo.replicas // lo.ep,
                            lo.pp * lo.tp * lo.ep, cluster, on_one_node)
        return t

    def exposed(collectives, beside, buckets=None):   # what outlasts the compute beside it
        """buckets: the gradients' bucket count (bucketed); None: all of it may hide."""
        hide = (lambda t: max(0.0, t - beside)) if buckets is None else \
            (lambda t: bucketed(t, beside, buckets) if t > 0 else 0.0)
        total = sum(dp_time(c) for c in collectives)
        if cluster.overlaps:
            return hide(total)
        cores = min(total, sum(dp_time(c, on_one_node=True) for c in collectives))
        return cores + hide(total - cores)
    # a parameter gather comes right after compute (a unit's, or the update's): on shared
    # cores each of its exchanges waits for a replica in another tp group (cross_wait)
    gather_wait = exchanges("allgather", lo.replicas) * cluster.cross_wait(lo.tp, b)
    dp_f = dp_b = dp_after = 0.0
    if lo.zero == 3:                            # every micro-batch; the gathers in line
        # a gather a unit (its layers, the embedding on the first stage, the head on
        # the last)
        units = stages[fullest] + (fullest == 0) + (fullest == lo.pp - 1)
        waits = units * gather_wait
        dp_f = exposed(["allgather"], 0.0) + waits
        dp_b = exposed(["allgather"], 0.0) + waits + exposed(["reduce_scatter"], compute_b,
                                                             max(1, stages[fullest]))
    elif lo.replicas > 1:
        buckets = max(1, math.ceil((dense + experts) * e / BUCKET_BYTES))
        reduce = exposed(["allreduce" if lo.zero == 0 else "reduce_scatter"], compute_b,
                         buckets)
        # ZeRO 1 and 2: the updated shards gathered after the update, once a step
        dp_after = reduce + (dp_time("allgather") + gather_wait if lo.zero else 0.0)
    if lo.replicas > 1:  # shared cores: the step's last exchange, right after the backward,
        dp_after += (lo.replicas - 1) * cluster.core_wait(b)    # waits for its peers' turns
    # 3. the pipeline: (v m + p - 1) slots, each sending an activation and its gradient
    t_f, t_b = compute_f + tp_f + cp_f + ep_f + dp_f, compute_b + tp_b + cp_b + ep_b + dp_b
    nodes, _, _ = placement(lo.pp, lo.tp, G)
    p2p = cluster.link(min(G, lo.tp)) if nodes > 1 else cluster.intra()
    sent = b * gpt.seq_len * gpt.d_model * e / (lo.tp * lo.cp)   # each rank its share
    pipeline = pipeline_step_time(lo.pp, m, t_f, t_b, sent, p2p, v, shares[slowest])
    # the idle slots: bubble_fraction's (p - 1) / (v m + p - 1) of them for an even cut,
    # and, with uneven chunks, what the paced slots leave of the stage's own work
    slot = (t_f + t_b) * shares[slowest]
    bubble = bubble_fraction(lo.pp, m, v) * (v * m + lo.pp - 1) * slot + \
        v * m * slot - m * (t_f + t_b)
    split = {"compute": m * (compute_f + compute_b), "tp": m * (tp_f + tp_b),
             "cp": m * (cp_f + cp_b),
             "pp": pipeline - m * (t_f + t_b) - bubble, "dp": m * (dp_f + dp_b) + dp_after,
             "ep": m * (ep_f + ep_b), "bubble": bubble,
             # 4. the update, on the fullest rank's parameters, after the step's exchanges
             "update": update_seconds(gpt, lo, cluster, fullest)}
    memories = [memory_of(gpt, lo, stage, ends) for stage in kinds_of_stage(stages)]
    memory = max(memories, key=lambda parts: sum(parts.values()))
    return Prediction(lo, pipeline + dp_after + split["update"], split,
                      sum(memory.values()), memory,
                      step_flops(gpt, lo.recompute), step_flops(gpt, "none"))
