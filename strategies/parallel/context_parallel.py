"""Context parallelism in the trainer: a replica's sequences cut by position over cp ranks.

    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \\
        --seq-len 64 --cp 2 --cp-kind ring                 # or --cp-kind ulysses
    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \\
        --seq-len 64 --cp 2 --tp 2                         # --dp 2 --zero 1 composes too
    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.train --sync ring --model gpt \
        --seq-len 64 --cp 2 --pp 2 --micro-batches 2       # or --tp 2 --sequence-parallel

Llama 3's long-context training and torchtitan's context parallelism: the ranks of a
context group (config/mesh.py's "cp" axis, carved out of the replicas) hold the same
parameters and see the same samples, and cp rank r keeps t = T / cp of every
sequence's positions: its inputs, its targets, and the position embedding's global
positions (models.PositionEmbedding.positions), so that a token is embedded where it
stands in the sequence.  Which positions is --cp-order's (context_order.py):

    sample b, T = 8, cp = 2        positions 0 1 2 3 | 4 5 6 7
    contiguous (the default)       cp rank     0 0 0 0 | 1 1 1 1     [r t, (r+1) t)
    zigzag                         cp rank     0 0 1 1 | 1 1 0 0     chunks r, 2 cp - 1 - r

Contiguous is the default because it is the plain split the rest of this page and the
ring's table read as (nothing is permuted, a rank's slice is one range) and any T that
divides by cp takes it; zigzag is the choice for ring attention under causal masking,
where it gives every rank the same work instead of the last rank cp times the first's
(context_order.py), at the price of T divisible by 2 cp.  Under Ulysses both orders do
the same work (each rank attends over whole sequences of its heads).

Everything but attention works on each position alone (embeddings, LayerNorms, the
MLP, the head, the loss), so it runs on the slice unchanged.  Attention is the one
place where positions meet: each block's attention core (CausalSelfAttention.core)
becomes one that sees the group's other positions:

    ring      parallel/ring_attention.py: the keys and values go round the cp ring,
              2 (cp - 1) blocks a layer forward, and back with their gradients
    ulysses   parallel/ulysses.py: an all-to-all from positions to heads, attention
              on whole sequences of heads / cp heads, an all-to-all back

The loss and the gradients.  Each rank's loss is the mean over its own B_local x t
tokens; the group's ranks hold equal shares, so the mean of their losses is the
mean over the replica's tokens, and averaging the gradients over the dp x cp
replicas (the mesh's "dp_cp" axis: sync/data_parallel.py's communicator) gives the
gradient of the mean over the global batch, as on one process.  The reported loss
is the mean of every rank's (runtime/metrics.py), the cp ranks' included.

With a pipeline (--pp) each stage's rank holds its cp slice too: what it sends the
next stage is the activation of its own positions, (b, T / cp, C), and its peer is
the next stage's rank with the same (dp, cp, tp) coordinates (the pp axis), so the
schedules (GPipe, 1F1B, interleaved) run unchanged and every stage's attention meets
the other slices over its own cp group.  The last stage's cp ranks each hold the
loss of their slice, averaged as above.  With sequence parallelism
(sequence_parallel.py) tp's shards cut the cp slice again: a rank keeps T / (cp tp)
positions between the blocks' tensor-parallel regions, which gather the slice's
T / cp over tp before attention and scatter it back after, so the attention core
sees the same slice as under tp alone (T must divide by cp x tp).

A mixture of experts gates each rank's own positions: its capacity and balance loss
are the slice's, as under expert parallelism they are the dp rank's batch's.
"""
import torch

from .context_order import chunks_of, positions_of
from .ring_attention import ring_bytes
from .ulysses import ulysses_bytes

SEQUENCE = 1                     # (B, T) tokens and targets: the axis the slices cut


def my_positions(x, cp_rank, cp_size, order):
    """This cp rank's positions of a (B, T, ...) batch, its chunks side by side in the
    --cp-order's order (context_order.py)."""
    chunks, n = chunks_of(cp_rank, cp_size, order)
    c = x.shape[SEQUENCE] // n
    return torch.cat([x.narrow(SEQUENCE, i * c, c) for i in chunks], SEQUENCE)


def set_attention_core(model, blocks, core, cp_rank, cp_size, order):
    """Every block's attention core replaced by `core`, and the model's position
    embedding told which positions this rank holds."""
    model.pos.positions = positions_of(cp_rank, cp_size, model.seq_len, order,
                                       model.pos.weight.device)
    for block in blocks:
        block.attn.core = core


def context_bytes(kind, batch, seq_len, d_model, cp, layers, itemsize=4):
    """Bytes one rank's attention cores send a step: `layers` blocks of a local batch
    of `batch` sequences, `d_model` the features a rank's attention holds (d / tp)."""
    per_layer = (ring_bytes if kind == "ring" else ulysses_bytes)(
        batch, seq_len, d_model, cp, itemsize)
    return layers * per_layer
