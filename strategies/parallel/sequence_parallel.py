"""Sequence parallelism: what tensor parallelism leaves whole in a block, split by position.

Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, "Reducing
Activation Recomputation in Large Transformer Models", MLSys 2023, section 4.2.2.

    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \
        --tp 2 --sequence-parallel                      # --pp, --dp, --zero and --cp compose

Tensor parallelism (tensor_parallel.py) splits attention and the MLP over the
tp ranks, but every tp rank still runs the LayerNorms and the residual adds on
the whole (B, T, C) activation, and keeps a whole copy of what they save for
the backward.  Those regions work on each position alone, so they can as well
run on 1/tp of the sequence: rank r holds positions [r T/tp, (r+1) T/tp).  The
tensor-parallel region then needs the whole sequence on entry and gives back
partial sums on exit, so Megatron's conjugate pair changes:

    tensor parallel      f: identity        -> [column | row] -> g: all-reduce
    sequence parallel    g: all-gather (T)  -> [column | row] -> g-bar: reduce-scatter (T)

An all-reduce is a reduce-scatter followed by an all-gather (the ring's two
phases), so the pair moves the same bytes as tensor parallelism's all-reduce.
The backward of an all-gather is a reduce-scatter and vice versa, one per
direction again.  What is sent on top (`tp_bytes_sent`): one all-gather per
column-parallel layer in the backward (below: memory), one at the embedding and
one at the head, and the replicated weights' gradient sums.
One block, tp = 2 (x_r: rank r's T/2 positions of the residual stream):

    x_r --LN1--> all-gather --> [qkv_r, heads_r, proj_r] --> reduce-scatter --> + x_r
        --LN2--> all-gather --> [fc_r, GELU, out_r]      --> reduce-scatter --> + ... = x'_r
    backward:    reduce-scatter <------------------------     all-gather

    where          forward                      backward
    embedding      keep my T/tp positions       all-gather the gradient
    block entry    all-gather (g)               reduce-scatter
    block exit     reduce-scatter (g-bar)       all-gather
    before head    all-gather                   keep my T/tp positions
    pipeline       (B, T/tp, C) shards travel between stages: 1/tp of the bytes

The embedding and the head stay whole on every tp rank, as in tensor_parallel.py
(Megatron splits them over the vocabulary instead; our vocabulary is tiny): the
embedding's output is cut after it, and the final LayerNorm's output gathered
before the head, whose gradient is then the same on every tp rank.  Dropout,
the paper's other sequence-parallel region, does not exist in our GPT.

Gradients of replicated weights.  A LayerNorm's weight and bias, and the bias
that a row-parallel layer adds after its reduce-scatter, are whole on every tp
rank but each rank applies them to its own positions only, so each rank's
gradient is a partial sum over T/tp positions: they are summed over the tp
ranks (Megatron's allreduce of the layernorm grads).  Here a hook on each such
parameter all-reduces its gradient before autograd accumulates it, so ZeRO's
per-layer hooks, which fire after the accumulation, already see the sum.
Trade-off: one small all-reduce per parameter and micro-batch, where Megatron
sums once per step after the backward; the sum is linear, so both are exact.

Activation memory (fp32, 4 bytes; b samples, s = T, h = C, tp ranks t).  Per
block, what is saved for the backward and whole under tensor parallelism:
the two LayerNorm inputs (the residual stream) and the two LayerNorm outputs
that qkv and fc read, 4 b s h, plus each LayerNorm's mean and 1/std, 4 b s.
With sequence parallelism each of them is a 1/t shard; the column-parallel
layer saves only its shard input and all-gathers it again in the backward
(the paper's choice: one more all-gather, t times less memory).  The final
LayerNorm saves b s h + 2 b s.  So each micro-batch alive on a stage saves

    4 (1 - 1/t) [L (4 b s h + 4 b s) + head (b s h + 2 b s)]  bytes less

(`saved_bytes_saving`).  In the paper's 16-bit count (section 4.2.2) these are
8 of the 10 s b h bytes per layer that tensor parallelism leaves whole; the
other 2 are the dropout masks, which we do not have.  Attention, the MLP's
hidden activations and the head's logits are as under tensor parallelism.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model.models import Block
from ..model.moe import MoE
from ..runtime.precision import as_wire
from ..runtime.trace import span
from .tensor_parallel import ColumnParallelLinear, Conjugate, RowParallelLinear

SEQUENCE = 1                     # (B, T, C): the axis the shards split


# ----------------------------------------------------------------- collectives on T
def _time_major(x):
    """(B, T, C) -> a contiguous fp32 (T, B, C) copy: the collectives split a flat buffer
    into tp equal runs, which are then whole runs of positions.  Megatron keeps its
    activations (T, B, C) throughout for this reason; our GPT is batch-first, so
    each collective pays a transposing copy."""
    return as_wire(x.transpose(0, 1))


def _batch_major(flat, positions, like):
    """A flat (positions, B, C) buffer as (B, positions, C)."""
    B, _, C = like.shape
    return flat.view(positions, B, C).transpose(0, 1)


def all_gather_sequence(x, tp, what):
    """(B, T/tp, C) on each rank -> (B, T, C), rank r's positions at [r T/tp, (r+1) T/tp)."""
    shard = _time_major(x)
    with span(tp.tracer, f"sp all-gather ({what})", "comm"):
        full = tp.coll.allgather(shard.view(-1), n=shard.numel() * tp.size)
    return _batch_major(full, x.shape[SEQUENCE] * tp.size, x).to(x.dtype)


def reduce_scatter_sequence(x, tp, what):
    """(B, T, C) partial sums on each rank -> this rank's (B, T/tp, C) of their sum."""
    whole = _time_major(x)
    with span(tp.tracer, f"sp reduce-scatter ({what})", "comm"):
        mine = tp.coll.reduce_scatter(whole.view(-1))
    return _batch_major(mine, x.shape[SEQUENCE] // tp.size, x).to(x.dtype)


def my_positions(x, tp):
    """This rank's T/tp positions of a (B, T, C) tensor, in storage of their own (a view
    would keep, and the meter count, the whole tensor)."""
    part = x.shape[SEQUENCE] // tp.size
    return x.narrow(SEQUENCE, tp.rank * part, part).clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------ the autograd operators
def scatter_to_sequence(x, tp):
    """Into the sequence-parallel region (after the embedding): keep my positions;
    backward: all-gather the gradient, so the embedding's gradient is whole on every rank."""
    return Conjugate.apply(x, lambda x: my_positions(x, tp),
                           lambda grad: all_gather_sequence(grad, tp, "scatter backward"))


def gather_to_replicated(x, tp):
    """Out of the sequence-parallel region into a layer every rank runs whole (the head):
    all-gather; backward: every rank has the whole, equal gradient, so keep my positions."""
    return Conjugate.apply(x, lambda x: all_gather_sequence(x, tp, "before head"),
                           lambda grad: my_positions(grad, tp))


def reduce_scatter_to_sequence(x, tp):
    """g-bar, the exit of the tensor-parallel region: reduce-scatter the row-parallel partial
    sums along the sequence; backward: all-gather."""
    return Conjugate.apply(x, lambda x: reduce_scatter_sequence(x, tp, "g-bar forward"),
                           lambda grad: all_gather_sequence(grad, tp, "g-bar backward"))


class GatheredLinear(torch.autograd.Function):
    """g and the column-parallel matmul in one: Y_r = all-gather(X_shard) A_r^T + b_r.

    Saves the shard, not the gathered X, and all-gathers it again in the backward
    (Korthikanti et al., 4.2.2): the gathered X is t times the shard.  Backward:
    dX = dY A_r summed over the ranks and cut by position (the all-gather's
    transpose, a reduce-scatter); dA_r = dY^T X; db_r = sum of dY."""

    @staticmethod
    def forward(ctx, shard, weight, bias, tp):
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(shard, weight)
        return F.linear(all_gather_sequence(shard, tp, "g forward"), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        tp = ctx.tp
        x = all_gather_sequence(shard, tp, "g backward, again")
        grad_x = reduce_scatter_sequence(grad @ weight, tp, "g backward")
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_bias = grad.sum(dim=(0, 1)) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


# ------------------------------------------------------------------------- layers
class SequenceParallelColumnLinear(nn.Module):
    """A ColumnParallelLinear whose input is this rank's positions: g, then A_r.

    Under --precision fp8 (column.linear is fp8's) the gather and the matmul stay
    apart: the fp8 matmul saves the gathered X as its 8-bit copy, a quarter of
    fp32's bytes, instead of gathering it again in the backward."""

    def __init__(self, column: ColumnParallelLinear):
        super().__init__()
        self.tp, self.weight, self.bias = column.tp, column.weight, column.bias   # same tensors
        self.linear = column.linear

    def forward(self, x):
        if self.linear is F.linear:
            return GatheredLinear.apply(x, self.weight, self.bias, self.tp)
        gathered = Conjugate.apply(
            x, lambda x: all_gather_sequence(x, self.tp, "g forward"),
            lambda grad: reduce_scatter_sequence(grad, self.tp, "g backward"))
        return self.linear(gathered, self.weight, self.bias)


class SequenceParallelRowLinear(nn.Module):
    """A RowParallelLinear ending in g-bar: my positions of sum_r Y_r B_r, plus the bias."""

    def __init__(self, row: RowParallelLinear):
        super().__init__()
        self.tp, self.weight, self.bias = row.tp, row.weight, row.bias
        self.linear = row.linear                  # F.linear, or fp8's

    def forward(self, x):
        z = reduce_scatter_to_sequence(self.linear(x, self.weight), self.tp)
        return z if self.bias is None else z + self.bias


class SequenceParallelEmbed(nn.Module):
    """The whole embedding on every tp rank, then my positions of its output."""

    def __init__(self, embed, tp):
        super().__init__()
        self.embed, self.tp = embed, tp

    def forward(self, idx):
        return scatter_to_sequence(self.embed(idx), self.tp)


class SequenceParallelHead(nn.Module):
    """The final LayerNorm on my positions, then all-gather, then the whole head."""

    def __init__(self, head, tp):
        super().__init__()
        self.ln_f, self.head, self.tp = head.ln_f, head.head, tp

    def forward(self, x):
        return self.head(gather_to_replicated(self.ln_f(x), self.tp))


# ---------------------------------------------------------------- the stage's layers
def sum_over_tp(tp, parameters):
    """Replicated weights that see 1/tp of the positions: all-reduce each gradient over
    the tp ranks before it is accumulated (a tensor hook runs before AccumulateGrad,
    ZeRO's post-accumulate hooks after it)."""
    for p in parameters:
        p.register_hook(lambda grad: tp.allreduce(grad, "sp weight gradient"))


class SequenceParallelMoE(nn.Module):
    """A mixture of experts, whole on every tp rank (tensor_parallel.py), between two
    sequence-parallel regions: all-gather the positions, route and run the experts on
    the whole sequence (the gating groups and capacities of the unsplit layer), keep
    my positions of the output.  Every tp rank computes the same whole output and so
    gets the same whole gradient of it: the exit's backward is an all-gather, the
    entry's a cut, and the gate's and experts' gradients need no sum."""

    def __init__(self, moe, tp):
        super().__init__()
        self.moe, self.tp = moe, tp

    def forward(self, x):
        return scatter_to_sequence(self.moe(gather_to_replicated(x, self.tp)), self.tp)

    @property
    def balance_loss(self):
        """The layer's load-balancing loss, read by the model's criterion (models.py)
        where the block's MLP is this wrapper."""
        return self.moe.balance_loss


def replicated_in_block(block):
    """The parameters of a tensor-parallel block that are whole on every tp rank and see
    only this rank's positions (a mixture of experts sees them all)."""
    outs = [block.attn.proj] + ([] if isinstance(block.mlp, SequenceParallelMoE)
                                else [block.mlp[2]])
    return [*block.ln1.parameters(), *block.ln2.parameters()] + \
        [out.bias for out in outs if out.bias is not None]


def split_sequence(layers, tp):
    """This stage's (name, module) layers, blocks already tensor-parallel, made sequence
    parallel: the blocks' linears change their entry and exit, the embedding is cut after,
    the head gathered before.  Parameters stay the same tensors (names, tp pieces)."""
    out = []
    for name, module in layers:
        if isinstance(module, Block):
            attn, mlp = module.attn, module.mlp
            attn.qkv = SequenceParallelColumnLinear(attn.qkv)
            attn.proj = SequenceParallelRowLinear(attn.proj)
            if isinstance(mlp, MoE):
                module.mlp = SequenceParallelMoE(mlp, tp)
            else:
                mlp[0] = SequenceParallelColumnLinear(mlp[0])
                mlp[2] = SequenceParallelRowLinear(mlp[2])
            sum_over_tp(tp, replicated_in_block(module))
        elif name == "embed":
            module = SequenceParallelEmbed(module, tp)
        elif name == "head":
            module = SequenceParallelHead(module, tp)
            sum_over_tp(tp, module.ln_f.parameters())
        else:
            raise TypeError(f"sequence parallelism does not know the layer {name}")
        out.append((name, module))
    return out


def positions_per_rank(cfg, tp_size):
    """The sequence length of the activations between stages: T, or T / tp when split."""
    return cfg.seq_len // tp_size if cfg.sequence_parallel else cfg.seq_len


def saved_bytes_saving(micro_batch, seq_len, d_model, tp, blocks, has_head):
    """The saved-activation bytes one micro-batch alive on a stage needs less with
    sequence parallelism than with tensor parallelism alone (module docstring)."""
    bs = micro_batch * seq_len
    per_block = 4 * bs * d_model + 4 * bs            # LN inputs and outputs; means, 1/stds
    head = bs * d_model + 2 * bs if has_head else 0  # ln_f's input; its mean, 1/std
    return 4 * (blocks * per_block + head) * (tp - 1) // tp


def block_collectives(sequence_parallel):
    """The tp collectives of one block and micro-batch, as this file and
    tensor_parallel.py make them: (forward, backward), lists of (collective, values)
    with values "activation" (the b s h of the residual stream, whole) or "replicated"
    (a replicated weight's gradient, C values: two LayerNorms' weight and bias, the
    two row-parallel biases).  The cost model counts them (experiments/planner)."""
    if not sequence_parallel:              # f: identity / all-reduce; g: all-reduce / identity
        return [("allreduce", "activation")] * 2, [("allreduce", "activation")] * 2
    pair = [("allgather", "activation"), ("reduce_scatter", "activation")]
    backward = [("allgather", "activation"),           # GatheredLinear: its input again,
                ("reduce_scatter", "activation"),      # then dX; for attention and the MLP
                ("allgather", "activation")] * 2       # g-bar's backward
    return pair * 2, backward + [("allreduce", "replicated")] * 6


def edge_collectives(sequence_parallel, has_embed, has_head):
    """The tp collectives of a stage's embedding and head, one micro-batch, as
    (forward, backward) like block_collectives.  Both stay whole on every tp rank:
    without sequence parallelism they make none; with it the embedding's positions
    are cut after it (its backward gathers them), the head's gathered before it, and
    ln_f's weight and bias are replicated gradients ("replicated")."""
    if not sequence_parallel:
        return [], []
    forward = [("allgather", "activation")] if has_head else []
    backward = ([("allgather", "activation")] if has_embed else []) + \
        ([("allreduce", "replicated")] * 2 if has_head else [])
    return forward, backward


def tp_bytes_sent(micro_batch, seq_len, d_model, tp, blocks, has_embed, has_head,
                  sequence_parallel):
    """Bytes a rank sends on the tp axis for one micro-batch, ring collectives: an
    all-gather or a reduce-scatter of a bytes sends (t-1)/t a, an all-reduce 2 (t-1)/t a.

        tensor parallel      per block 4 all-reduces (g, g forward; f, f backward)    8 halves
        sequence parallel    per block 2 all-gathers + 2 reduce-scatters forward,
                             2 + 2 backward, and the 2 all-gathers again              10 halves
                             + 1 all-gather after the embedding (backward), 1 before
                             the head (forward), + the replicated weights' gradients

    So sequence parallelism moves the same bytes as tensor parallelism in its g / g-bar
    pairs, and pays one all-gather per column-parallel layer for the memory it saves."""
    size = {"activation": 4 * micro_batch * seq_len * d_model, "replicated": 4 * d_model}

    def sent(collectives):       # (t-1)/t of the values a half, an all-reduce two halves
        return sum((2 if c == "allreduce" else 1) * size[values] * (tp - 1) // tp
                   for c, values in collectives)
    forward, backward = block_collectives(sequence_parallel)
    edge_f, edge_b = edge_collectives(sequence_parallel, has_embed, has_head)
    return blocks * sent(forward + backward) + sent(edge_f + edge_b)
