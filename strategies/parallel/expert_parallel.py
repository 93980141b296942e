"""Expert parallelism: the E experts of every MoE block spread over EP ranks, tokens
sent to their experts by an all-to-all and brought back by a second one.

    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model moe \\
        --experts 4 --ep 2 --top-k 2 --capacity-factor 1.25 --jsonl ep.jsonl

Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and
Automatic Sharding", ICLR 2021, section 3.2 (the dispatch/combine all-to-alls); Fedus,
Zoph & Shazeer, "Switch Transformers", JMLR 2022, section 5 (expert and data
parallelism together).  The layer itself (gate, capacity, groups) is moe.py's.

Layout.  world = (world / EP) expert groups of EP consecutive ranks.  Inside an expert
group rank i holds experts [i E/EP, (i+1) E/EP); every rank holds all the dense
parameters (embeddings, attention, LayerNorms, gates, head) and reads its own B/world
samples, as in plain data parallelism.  World 4, EP 2, E 4:

                 expert group 0        expert group 1
                 rank 0    rank 1      rank 2    rank 3
    experts      e0 e1     e2 e3       e0 e1     e2 e3
    dense        all       all         all       all
    batch        B/4       B/4         B/4       B/4

    all-to-all (tokens)         inside an expert group: {0, 1}, {2, 3}
    expert gradients summed     over the replicas of an expert: {0, 2}, {1, 3}
    dense gradients averaged    over the world: {0, 1, 2, 3}

One MoE forward on rank i of an expert group (G groups of C tokens per expert; moe.py):

    expert_in (E, G, C, d)   block j = the experts of rank j
        | all-to-all #1 (dispatch): block j to rank j
    (EP, E/EP, G, C, d)      our experts' tokens from every rank of the group
        | our E/EP experts, each on its EP * G * C tokens
        | all-to-all #2 (combine): block j back to rank j
    expert_out (E, G, C, d)  as if every expert had run here

The all-to-all is its own transpose (rank i's block j is rank j's block i), so the
backward of each is again an all-to-all of the gradients (exchange_tokens below).

Gradient averaging.  The loss is the mean over the global batch: L = (1/world) sum_r L_r.
  dense parameter:  rank r's backward gives dL_r/dw, averaged over the world (the
                    plain data-parallel all-reduce);
  expert e:         its backward runs on its holder, on the tokens of every rank of
                    the expert group, so autograd already sums dL_r/dw_e over those EP
                    ranks; averaging over the world/EP replicas of e and dividing by
                    EP gives (1/world) sum over all r: the same mean.
With EP = world there is one replica and the sum is complete on its own rank.
Under --cp the replicas are dp x cp (config/mesh.py): a rank's tokens are its slice
of its context group's sequences, the loss is the mean over the replicas' equal
slices, and the same argument holds with world = dp x cp.

Both are ZeRO's layers (zero.py; `--zero 0` is plain data parallelism): the ep
axis is carved out of the data-parallel one, as in torchtitan and Megatron-LM,
so each expert's replicas are its data-parallel group, over which `--zero 1-2`
shard its optimizer state, as the world shards the dense layers'.  Their
collectives leave on the comm thread as backward finishes each layer.

On the grid (--pp, --tp) the same holds per stage and tp place: the mesh's expert
groups and replicas are cut out of the replicas of one (pp, tp) place, so a stage's
experts are split over its own replicas and averaged over theirs.  Under tp every rank
of a tp group holds the same experts and exchanges the same tokens with its peers at
its tp place (tensor_parallel.py: the experts are replicated over tp).

Equivalence: capacity is decided per group of tokens (moe.py), by default the
sequences of one forward call of a rank: its local batch, or one of its k
micro-batches (local / k; config/validate.py's gating_group, written into the
run's config as --moe-group).  The one-process reference with --moe-group set to
that many sequences gates, drops and combines the same tokens, so the runs agree
up to the order of float additions (tests/test_moe.py).
"""
import time

import torch.nn as nn

from allreduce.alltoall import bytes_sent, uses_bruck

from ..config.validate import gating_group
from ..model.moe import MoE, expert_capacity, run_experts
from ..runtime.precision import as_wire
from .tensor_parallel import Conjugate


def alltoall_bytes_per_step(cfg, dp):
    """Bytes one rank sends in all-to-alls per step: 4 per MoE block it holds and forward
    call (dispatch and combine, forward and backward; a forward call a micro-batch), each
    of the (E, G, C, d) float32 buffer (float32 under --precision bf16/fp16 too:
    AllToAllExperts.alltoall), by alltoall.py's schedule for that size.

    What a rank gates: its replica's global_batch / dp sequences (dp the data-parallel
    size, the mesh's dp: not the world, which also counts servers, stages, tp and cp
    ranks), cut into its k micro-batches, each into gating groups; under --cp a group's
    sequences are the rank's own seq_len / cp positions (context_parallel.py).  Under
    --pp a rank holds its stage's blocks: layers / pp of them, the mean over the ranks
    of any split (--pp-layers).  cfg: a TrainConfig or its record (dict)."""
    c = cfg if isinstance(cfg, dict) else cfg.as_dict()
    ep, experts, k = c["ep"], c["experts"], c["micro_batches"]
    local = c["global_batch"] // dp
    per_group = gating_group(c["moe_group"], local, k)
    positions = c["seq_len"] // c["cp"]
    capacity = expert_capacity(per_group * positions, experts, c["top_k"],
                               c["capacity_factor"])
    buffer = experts * (local // k // per_group) * capacity * c["d_model"] * 4
    blocks = c["layers"] / c["pp"]
    return 4 * blocks * k * bytes_sent(buffer, ep, uses_bruck(buffer // ep, ep))


class ExpertPlacement:
    """Who holds which experts (the docstring's table): pure arithmetic over the mesh."""

    def __init__(self, mesh, experts, rank):
        self.ep, self.experts = mesh.ep, experts
        # which expert group, and the place inside it (mesh.py cuts them out of dp x cp)
        self.group, self.ep_rank = mesh.expert_coords_of(rank)
        self.replicas = mesh.dp * mesh.cp // mesh.ep       # copies of each expert
        self.per_rank = experts // mesh.ep

    @property
    def local_experts(self):
        return range(self.ep_rank * self.per_rank, (self.ep_rank + 1) * self.per_rank)


class AllToAllExperts:
    """Step 6 of moe.py over an expert group: dispatch, our experts, combine.  Times
    the all-to-alls for the step records (their bytes: coll.bytes_sent)."""

    def __init__(self, coll, placement, tracer=None):
        self.coll, self.placement, self.tracer = coll, placement, tracer
        self.seconds = 0.0

    def alltoall(self, x, what):
        """x's blocks to the ranks of the group; under --precision bf16/fp16 the tokens
        (and their gradients) cross in fp32, as a pipeline's activations do
        (precision.as_wire), and come back in x's dtype, the one autocast computes in."""
        start = time.perf_counter()
        out = self.coll.alltoall(as_wire(x)).to(x.dtype)
        end = time.perf_counter()
        self.seconds += end - start
        if self.tracer:
            self.tracer.add(f"all-to-all {what}", "comm", start, end)
        return out

    def exchange_tokens(self, x, what):
        """y = all-to-all(x) over the expert group; backward: all-to-all of the gradient."""
        return Conjugate.apply(x, lambda x: self.alltoall(x, what).view(x.shape),
                               lambda g: self.alltoall(g, what + " backward").view(g.shape))

    def __call__(self, experts, expert_in):
        E, G, C, d = expert_in.shape
        ep, mine = self.placement.ep, self.placement.per_rank
        # 1. dispatch: rank j gets the tokens of its experts from every rank of the group
        received = self.exchange_tokens(expert_in, "dispatch").view(ep, mine, G, C, d)
        # 2. each of our experts on its tokens from every rank: (mine, ep * G * C, d)
        tokens = received.transpose(0, 1).reshape(mine, ep * G * C, d)
        out = run_experts(experts, tokens)
        # 3. combine: every rank's outputs back to it, in the order it sent them
        out = out.reshape(mine, ep, G, C, d).transpose(0, 1)
        return self.exchange_tokens(out, "combine").view(E, G, C, d)


def shard_experts(model, placement, exchange):
    """Keep this rank's experts in every MoE block and route them through `exchange`;
    returns the parameters of the kept experts."""
    kept = {str(e) for e in placement.local_experts}
    params = []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.experts = nn.ModuleDict({k: v for k, v in moe.experts.items() if k in kept})
        moe.exchange = exchange
        params += list(moe.experts.parameters())
    return params


def moe_of(block):
    """The MoE of a block (its mlp, or inside sequence parallelism's wrapper), or None."""
    return next((m for m in block.modules() if isinstance(m, MoE)), None)


def block_units(name, block, experts):
    """A block as ZeRO's layers: its dense parameters, then each of its experts held here,
    with `experts` (a zero.Replicas) as the ranks they are averaged over."""
    moe = moe_of(block)
    held = {id(p) for p in moe.experts.parameters()}
    units = [(name, block, [p for p in block.parameters() if id(p) not in held])]
    for key, expert in moe.experts.items():
        units.append((f"{name}.mlp.experts.{key}", expert, list(expert.parameters()), experts))
    return units


def units_of(model, experts):
    """The whole model as ZeRO's layers (zero.py), in forward order: the embeddings; each
    block's units (block_units); the head.  A grid's stages are cut into the same
    units by engine/parallelize.py."""
    units = [("embed", model, [model.tok.weight, model.pos.weight])]
    for i, block in enumerate(model.blocks):
        units += block_units(f"blocks.{i}", block, experts)
    units.append(("head", model, [*model.ln_f.parameters(), *model.head.parameters()]))
    assert sum(len(u[2]) for u in units) == len(list(model.parameters()))
    return units


if __name__ == "__main__":
    raise SystemExit("run expert parallelism through `python -m strategies.train --ep N ...`")
