"""DeepSpeed-Ulysses: trade the sequence split for a head split, attend, trade back.

Jacobs, Tanaka, Zhang, Zhang, Song, Rajbhandari & He, "DeepSpeed Ulysses: System
Optimizations for Enabling Training of Extreme Long Sequence Transformer Models",
2023, section 3.

Each of the cp ranks holds t = T / cp positions of every sequence, all heads.  Attention
needs every position of a head but no other head, so an all-to-all swaps the split:
afterwards rank r holds all T positions of heads [r H/cp, (r+1) H/cp), attends
with any attention it likes (the GPT's own, models.causal_attention), and a second
all-to-all swaps back.  cp = 2, H = 4 (Pr: positions of rank r, hi: head i):

                    rank 0              rank 1
    q, k, v         P0: h0 h1 h2 h3     P1: h0 h1 h2 h3       sequence-sharded
        | all-to-all: block j (heads of rank j) to rank j
    q, k, v         P0 P1: h0 h1        P0 P1: h2 h3          head-sharded
        | attention on whole sequences, H/cp heads
        | all-to-all: block j (positions of rank j) to rank j
    y               P0: h0 h1 h2 h3     P1: h0 h1 h2 h3       sequence-sharded

An all-to-all is a permutation of blocks, so its transpose is its inverse: the
backward of "to heads" is "to sequence" on the gradient and the other way round
(tensor_parallel.Conjugate).  Heads must divide by cp, since a head is never split
(check_heads says so).

The order of the positions (--cp-order, context_order.py).  The all-to-all lays the
ranks' positions end to end, rank 0's first: under the contiguous order that is the
sequence itself; under zig-zag (cp = 2: chunks 0 3 | 1 2) it is not, and a causal
mask over the gathered indices would let a position see later ones.  So the gathered
sequence is put in order of its true positions before the attention and back after
(an index_select each way, whose backward is the scatter back): the attention is the
GPT's own, on the true sequence.  Every rank attends over whole sequences of its heads
in both orders, so here the order balances nothing; it is taken so that --cp-order
means one layout for every --cp-kind (the data, the position embeddings, a pipeline's
activations).

Traffic: the paper's four all-to-alls a layer in the forward (q, k, v in, the
output out), each of the rank's b t C elements; here q, k and v travel packed in
one all-to-all of three times the size (one set of latencies instead of three,
the same bytes), and the backward runs both again.  Per rank and layer
(`ulysses_bytes`): 2 (A(3n) + A(n)), A(n) the all-to-all's bytes from
allreduce/theory.py ((cp-1)/cp n for the pairwise exchange).  Unlike the ring
(ring_attention.py) that does not grow with cp: the all-to-all's bytes per rank
fall as 1/cp of the whole, while the ring moves every other rank's keys.
"""
import time

import torch

from allreduce.theory import bytes_sent

from ..config.choices import ConfigError
from ..model.models import causal_attention, repeat_kv
from ..runtime.trace import span
from .context_order import CONTIGUOUS, gathered_positions
from .tensor_parallel import Conjugate


def check_heads(heads, cp):
    """Ulysses splits whole heads: heads % cp must be 0."""
    if heads % cp:
        raise ConfigError(f"Ulysses context parallelism splits the heads over the cp ranks: "
                          f"heads {heads} is not a multiple of cp {cp} ({heads} % {cp} = "
                          f"{heads % cp}); choose --heads a multiple of --cp, or the ring",
                          field="heads")


def ulysses_bytes(batch, seq_len, d_model, cp, itemsize=4, backward=True):
    """Bytes one rank sends per layer: the packed q, k, v all-to-all and the output's,
    in the forward and (backward) again for their gradients."""
    n = batch * (seq_len // cp) * d_model * itemsize
    forward = bytes_sent("ring", "alltoall", 3 * n, cp) + bytes_sent("ring", "alltoall", n, cp)
    return forward * (2 if backward else 1)


def to_heads(x, cp, alltoall):
    """(..., t, C) of this rank's positions -> (..., cp t, C / cp) of its heads."""
    *lead, t, C = x.shape
    # block j: our positions of rank j's heads
    blocks = x.reshape(*lead, t, cp, C // cp).movedim(-2, 0).contiguous()
    got = alltoall(blocks).view(blocks.shape)      # block j: rank j's positions, our heads
    return got.movedim(0, -3).reshape(*lead, cp * t, C // cp)


def to_sequence(y, cp, alltoall):
    """(..., T, c) of this rank's heads -> (..., T / cp, c cp) of its positions."""
    *lead, T, c = y.shape
    # block j: rank j's positions of our heads
    blocks = y.reshape(*lead, cp, T // cp, c).movedim(-3, 0).contiguous()
    got = alltoall(blocks).view(blocks.shape)      # block j: rank j's heads, our positions
    return got.movedim(0, -2).reshape(*lead, T // cp, cp * c)


class Ulysses:
    """The GPT's attention core (models.CausalSelfAttention.core) over the cp ranks of
    `coll` (an allreduce/ collective): q, k, v (B, t, C) of this rank's positions, in
    --cp-order's `order` -> (B, t, C).  `inner` is the attention run on the head-sharded
    whole sequences."""

    def __init__(self, coll, inner=causal_attention, tracer=None, order=CONTIGUOUS):
        self.coll, self.inner, self.tracer, self.order = coll, inner, tracer, order
        self.bytes_sent = 0
        self.seconds = 0.0

    def alltoall(self, x, what):
        start, sent = time.perf_counter(), self.coll.bytes_sent
        with span(self.tracer, f"ulysses all-to-all {what}", "comm"):
            out = self.coll.alltoall(x)
        # a library's collective (--sync mpi) does not count its bytes: neither do we
        self.bytes_sent = None if sent is None or self.bytes_sent is None else \
            self.bytes_sent + self.coll.bytes_sent - sent
        self.seconds += time.perf_counter() - start
        return out

    def exchange(self, what):
        """The all-to-all that `to_heads` and `to_sequence` call, named for the trace."""
        return lambda blocks: self.alltoall(blocks, what)

    def in_order(self, q, k, v, heads):
        """The inner attention of (B, T, c) whole sequences laid out as the all-to-all
        gathers them, on their true positions (the docstring)."""
        if self.order == CONTIGUOUS:                    # gathered in order already
            return self.inner(q, k, v, heads)
        at = gathered_positions(self.coll.size, q.shape[-2], self.order, q.device)
        # index i of the gathered sequence holds position at[i]: true order is argsort
        true = torch.argsort(at)
        q, k, v = (x.index_select(-2, true) for x in (q, k, v))
        return self.inner(q, k, v, heads).index_select(-2, at)

    def __call__(self, q, k, v, heads, kv_heads=None):
        cp = self.coll.size
        check_heads(heads, cp)
        # grouped-query attention travels as full heads: each key-value head repeated
        k, v = (repeat_kv(x, heads, kv_heads or heads) for x in (k, v))
        # 1. sequence-sharded to head-sharded, q, k, v in one all-to-all
        q, k, v = Conjugate.apply(
            torch.stack([q, k, v]), lambda x: to_heads(x, cp, self.exchange("q k v")),
            lambda g: to_sequence(g, cp, self.exchange("q k v backward")))
        # 2. attention over the whole sequence, heads / cp heads, in its true order
        y = self.in_order(q, k, v, heads // cp)
        # 3. back to this rank's positions, every head
        return Conjugate.apply(y, lambda y: to_sequence(y, cp, self.exchange("out")),
                               lambda g: to_heads(g, cp, self.exchange("out backward")))
