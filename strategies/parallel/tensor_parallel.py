"""Tensor parallelism: Megatron-LM's split of the GPT's matrices across the tp ranks.

Shoeybi et al., "Megatron-LM" (2019), section 3.  Two conjugate operators:

    f: identity in the forward, all-reduce of the gradient in the backward
    g: all-reduce in the forward, identity in the backward

and two kinds of linear layer:

    column-parallel  Y = X A,  A = [A_1 ... A_tp] split by output columns;
                     rank r computes Y_r = f(X) A_r, a slice of Y's features
    row-parallel     Z = Y B,  B split by input rows to match Y_r;
                     rank r computes Y_r B_r, and g sums the partial products

An MLP is column- then row-parallel (GELU acts on each slice alone), attention
is the same with the heads split (each head's q, k, v columns live on one
rank), so each block costs one f and one g per sub-layer: two all-reduces in
the forward and two in the backward.

    x --f--> [qkv_r -> heads_r -> proj_r] --g--> + x --f--> [fc_r -> gelu -> out_r] --g--> +

Today's shapes (model/models.py) split the same way, as Megatron-LM splits them:
with grouped-query attention rank r keeps heads / tp query heads and kv_heads / tp
key-value heads, the ones its query heads read (query head i reads key-value head
i // (heads / kv_heads), so a rank's run of query heads reads its own run of
key-value heads), hence tp must divide kv_heads (Megatron's num_query_groups);
the MLP's width f (--ffn-hidden) is cut into f / tp columns; a gated MLP's W1 and
W3, stacked in fc, are both column-split at the same columns, so that
silu(x W1_r) * (x W3_r) is this rank's slice of the activation, and W2 is
row-parallel as GPT's second matrix is.

    qkv rows:   [ q_0 | q_1 ][ k_0 | k_1 ][ v_0 | v_1 ]     rank r keeps q_r, k_r, v_r
    gated fc:   [ W1_0 | W1_1 ][ W3_0 | W3_1 ]              rank r keeps W1_r, W3_r

Embeddings, LayerNorms and the head stay whole on every tp rank: they see the
same inputs and (after f's backward all-reduce) the same output gradients, so
their gradients are already equal and need no sync.

A mixture of experts (--model moe) stays whole on every tp rank too: its gate and
experts are replicated over the tp group, Megatron-LM's expert tensor-parallel
size 1.  Each tp rank routes the same tokens to the same experts and gets the same
gradients, so neither the layer nor its gradients need a tp collective.  Why not
cut each expert's MLP over tp as the GPT's: the experts already have an axis of
their own (--ep) that divides their weights and flops without a collective per
expert, where a tp cut would add an f and a g to each of the E experts of a block
on buffers of C tokens; tp's cut goes to attention, which every token passes
through.  The price, stated: each tp rank holds the experts it has whole and
repeats their flops; --ep divides them.  The TensorParallel object
remembers where every local parameter came from (`pieces[id(p)]`: full-matrix
slices <- local slices, and the full shape), so the full model can be
reassembled for checkpoints and tests.

Under --precision fp8 the split layers multiply as the nn.Linear they were cut from
did (runtime/fp8_linear.py): each rank scales its own piece of the weight by its own
amax, so the 8-bit pieces are not slices of the whole matrix's 8-bit copy.
"""
import torch
import torch.nn as nn

from ..model.models import Block, SwiGLU
from ..model.moe import MoE
from ..runtime.fp8_linear import linear_function
from ..runtime.precision import as_wire
from ..runtime.trace import span


class TensorParallel:
    """The tp axis as the layers see it: rank, size and the collective over tp ranks."""

    def __init__(self, coll, rank, size, tracer=None):
        self.coll, self.rank, self.size, self.tracer = coll, rank, size, tracer
        self.pieces = {}         # id(local parameter) -> ([(full index, local index)], shape)

    def allreduce(self, x, what):
        # a copy of its own (the all-reduce works in place), in fp32 also under bf16
        out = as_wire(x, copy=True)
        with span(self.tracer, f"tp all-reduce ({what})", "comm"):
            out = self.coll.allreduce(out)
        return out.to(x.dtype)

    def slice_of(self, n):
        """[start, stop) of this rank's equal part of n features."""
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part


class Conjugate(torch.autograd.Function):
    """y = forward(x), whose backward is its conjugate: the gradient of x is
    transpose(the gradient of y).  Megatron's f and g are such pairs, and so are
    sequence parallelism's operators (sequence_parallel.py) and expert parallelism's
    all-to-all, its own transpose (expert_parallel.py)."""

    @staticmethod
    def forward(ctx, x, forward, transpose):
        ctx.transpose = transpose
        return forward(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.transpose(grad), None, None


def copy_to_tp(x, tp):
    """The f operator of Megatron: identity forward, all-reduce backward."""
    return Conjugate.apply(x, lambda x: x.view_as(x),
                           lambda grad: tp.allreduce(grad, "f backward"))


def reduce_from_tp(x, tp):
    """The g operator of Megatron: all-reduce forward, identity backward."""
    return Conjugate.apply(x, lambda x: tp.allreduce(x, "g forward"), lambda grad: grad)


def _keep(full, pieces, tp):
    """A Parameter of the full tensor's pieces (full-index slices), concatenated on dim 0."""
    local = nn.Parameter(torch.cat([full.detach()[index] for index, _ in pieces]))
    tp.pieces[id(local)] = pieces, tuple(full.shape)
    return local


def _row_pieces(ranges, *cols):
    """(full index, local index) pairs for row ranges stacked in order; `cols` indexes
    the other dims alike (a weight's columns; nothing for a bias)."""
    pieces, at = [], 0
    for start, stop in ranges:
        pieces.append(((slice(start, stop), *cols), (slice(at, at + stop - start), *cols)))
        at += stop - start
    return pieces


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) A_r: this rank's output features `rows` (ranges of the full weight's rows)."""

    def __init__(self, full: nn.Linear, tp, rows):
        super().__init__()
        self.tp, self.linear = tp, linear_function(full)    # F.linear, or fp8's
        self.weight = _keep(full.weight, _row_pieces(rows, slice(None)), tp)
        self.bias = None if full.bias is None else _keep(full.bias, _row_pieces(rows), tp)

    def forward(self, x):
        return self.linear(copy_to_tp(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = g(Y_r B_r) + b: this rank's input features `cols`; the bias is added once, after g."""

    def __init__(self, full: nn.Linear, tp, cols):
        super().__init__()
        self.tp, self.linear = tp, linear_function(full)    # F.linear, or fp8's
        whole, mine = slice(None), slice(*cols)
        self.weight = _keep(full.weight, [((whole, mine), (whole, whole))], tp)
        self.bias = full.bias          # whole on every tp rank

    def forward(self, x):
        z = reduce_from_tp(self.linear(x, self.weight), self.tp)
        return z if self.bias is None else z + self.bias


class TensorParallelAttention(nn.Module):
    """Causal self-attention with heads / tp query heads and kv_heads / tp key-value heads
    on each rank (Megatron section 3, Fig. 3b)."""

    def __init__(self, attn, tp):
        super().__init__()
        C, width = attn.proj.in_features, attn.width
        C_kv = attn.kv_heads * width                    # keys' (and values') features
        self.heads, self.kv_heads, self.width = attn.heads // tp.size, \
            attn.kv_heads // tp.size, width
        q_start, q_stop = tp.slice_of(C)
        kv_start, kv_stop = tp.slice_of(C_kv)
        # q, k and v are row blocks of qkv (C, C_kv, C_kv rows): keep this rank's heads
        # of each
        self.qkv = ColumnParallelLinear(attn.qkv, tp, [
            (q_start, q_stop), (C + kv_start, C + kv_stop),
            (C + C_kv + kv_start, C + C_kv + kv_stop)])
        self.proj = RowParallelLinear(attn.proj, tp, (q_start, q_stop))
        self.core = attn.core           # the attention between them (models.py)

    def forward(self, x):
        # the whole sequence even under sequence parallelism, where x holds T / tp
        # positions: qkv's entry gathers them (sequence_parallel.py)
        q, k, v = self.qkv(x).split([self.heads * self.width] +
                                    [self.kv_heads * self.width] * 2, dim=2)
        return self.proj(self.core(q, k, v, self.heads, self.kv_heads))


def tensor_parallel_mlp(mlp, tp):
    """fc (column-parallel) -> the activation on each slice -> out (row-parallel); a
    Sequential with the unsplit MLP's indices, so parameter names stay `mlp.0.weight`,
    `mlp.2.weight`.  A gated MLP's fc is W1 over W3 (2f rows): the same columns of each."""
    fc, act, out = mlp
    f = out.in_features
    cols = tp.slice_of(f)
    rows = [cols, (f + cols[0], f + cols[1])] if isinstance(act, SwiGLU) else [cols]
    return nn.Sequential(ColumnParallelLinear(fc, tp, rows), act,
                         RowParallelLinear(out, tp, cols))


def parallelize_blocks(blocks, tp):
    """Replace each GPT block's attention and MLP by their tensor-parallel forms, in place;
    parameter names inside a block do not change.  A mixture of experts stays whole,
    replicated over the tp ranks (the module docstring)."""
    for block in blocks:
        if not isinstance(block, Block):
            raise TypeError(f"tensor parallelism splits GPT blocks, not {type(block).__name__}")
        block.attn = TensorParallelAttention(block.attn, tp)
        if not isinstance(block.mlp, MoE):
            block.mlp = tensor_parallel_mlp(block.mlp, tp)
