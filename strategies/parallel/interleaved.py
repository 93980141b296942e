"""Interleaved 1F1B: each pipeline rank holds v chunks of layers (virtual stages).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC 2021), section 2.2.2.  With p ranks and v chunks the model
is cut evenly into p v global stages (pipeline.stage_layers with p v stages, the
chunks of equal length so that every slot below lasts as long); chunk c
of rank s is global stage c p + s, so a micro-batch goes round the ranks v times:

    global stage:   0     1     2     3          (p = 2, v = 2)
    rank:           0     1     0     1
    chunk:          0     0     1     1
                  embed                 head, loss
       rank 0 --act--> rank 1 --act--> rank 0 --act--> rank 1

A chunk's forward or backward takes 1/v of a whole stage's, and the fill and the
drain still last p - 1 of these shorter slots: the bubble shrinks from
(p - 1) / (m + p - 1) to (p - 1) / (v m + p - 1) (bubble.py), for v times as many
point-to-point messages.

The schedule (Megatron-LM's forward_backward_pipelining_with_interleaving): the v m
(chunk, micro-batch) pairs are taken in groups of p micro-batches, the chunks in
order within a group for forwards, in reverse for backwards.  Forward k runs
micro-batch (k // (p v)) p + k % p on chunk (k % (p v)) // p; backward k the same
micro-batch on chunk v - 1 - that.  Rank s runs

    1. warm-up:   2 (p - s - 1) + (v - 1) p forwards (all v m if fewer)
    2. steady:    forward k + warm-up, then backward k (one forward, one backward)
    3. cool-down: the backwards left

Hence m must be a multiple of p.  Step table for p = 2, v = 2, m = 4 (F2.1 =
forward of micro-batch 2 on chunk 1; every op one slot of a chunk's time, sends free):

  slot:   1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17   18
  rank 0: F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 .    B2.1 .    B3.1 B2.0 B3.0
  rank 1: .    F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0 .

Each rank idles 2 slots of 18: (p - 1) / (v m + p - 1) = 1/9 (bubble.py).  1F1B with
whole stages (2 slots an op) needs (m + p - 1) x 2 x 2 = 20 slots, idle 4: 1/5.

The messages and the stage modules are pipeline.py's (Pipeline with a list of v
chunks): only the order of operations is this file's.
"""
from .pipeline import Pipeline, layers_of, stage_layers, stage_sizes


def forward_chunk(k, stages, chunks):
    """The chunk of the k-th forward (Megatron-LM's get_model_chunk_id)."""
    return (k % (stages * chunks)) // stages


def micro_batch(k, stages, chunks):
    """The micro-batch of the k-th forward, or of the k-th backward."""
    return (k // (stages * chunks)) * stages + k % stages


def interleaved_order(stage, stages, chunks, m):
    """Rank `stage`'s sequence of (op, chunk, micro-batch), op "F" or "B"."""
    p, v = stages, chunks
    total = v * m

    def fwd(k):
        return ("F", forward_chunk(k, p, v), micro_batch(k, p, v))

    def bwd(k):
        return ("B", v - 1 - forward_chunk(k, p, v), micro_batch(k, p, v))

    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)           # 1. warm-up
    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):                                  # 2. steady 1F1B
        ops += [fwd(k + warmup), bwd(k)]
    return ops + [bwd(k) for k in range(total - warmup, total)]      # 3. cool-down


def chunk_layers(model, stage, stages, chunks, given=None):
    """[the (name, module) layers of each chunk of rank `stage`]: global stages
    stage, stage + p, ..., of the model cut evenly into p v stages (the caller checked
    p v divides the blocks).  One chunk (1F1B, GPipe): the stage of stage_sizes's
    split, balanced or `given` (--pp-layers)."""
    if chunks == 1:
        return [stage_layers(model, stage, stages, stage_sizes(model, stages, given))]
    even = [len(layers_of(model)[1]) // (stages * chunks)] * (stages * chunks)
    return [stage_layers(model, c * stages + stage, stages * chunks, even)
            for c in range(chunks)]


class InterleavedPipeline(Pipeline):
    """Pipeline over this rank's v chunks (a list of Stages), in the order above."""

    def ops(self):
        return interleaved_order(self.stage, self.stages, len(self.chunks), self.m)
