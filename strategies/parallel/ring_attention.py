"""Ring attention: each rank holds 1/cp of every sequence; the keys and values go round.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
Context", 2023 (the ring); Milakov & Gimelshein, "Online normalizer calculation for
softmax", 2018, and Dao, "FlashAttention-2", 2023, section 3.1 (the blockwise softmax
and its backward).

Layout: each rank holds t = T / cp positions of every sequence, and its q, k, v for
them; which positions is --cp-order's (context_order.py).  Its queries need every key
and value before them (causal) or all of them: they come round the cp ring, one rank's
block a step.  cp = 4:

         kv0            kv1            kv2            kv3
      rank 0 -----> rank 1 -----> rank 2 -----> rank 3 --.
         ^                                               |
         '-----------------------------------------------'

    step | rank 0 holds | rank 1 | rank 2 | rank 3     (block j = (r - step) % cp)
      0  |    kv0       |  kv1   |  kv2   |  kv3       own block: the diagonal
      1  |    kv3       |  kv0   |  kv1   |  kv2
      2  |    kv2       |  kv3   |  kv0   |  kv1
      3  |    kv1       |  kv2   |  kv3   |  kv0       cp - 1 sends of k and v each

Causal masking, chunk by chunk.  A rank's block is one chunk (contiguous: rank r holds
chunk r of cp) or two (zigzag: chunks r and 2 cp - 1 - r of 2 cp).  A key chunk kc is
wholly before a query chunk qc where kc < qc (full, no mask), wholly after where
kc > qc (skipped: no work), and the diagonal where kc = qc (masked inside); a rank
computes each pair of its query chunks and the block's key chunks that is not skipped
(`chunk_pairs`), and passes every block on.

    contiguous, cp = 2            step 0 (own block)       step 1
      rank 0 (chunk 0)            0x0 diagonal             kv1: 0x1 skipped
      rank 1 (chunk 1)            1x1 diagonal             kv0: 1x0 full
    zigzag, cp = 2 (qc x kc)
      rank 0 (chunks 0, 3)        0x0, 3x3 diag, 3x0 full  kv1 (1, 2): 3x1, 3x2 full
      rank 1 (chunks 1, 2)        1x1, 2x2 diag, 2x1 full  kv0 (0, 3): 1x0, 2x0 full

Contiguous: rank r computes r + 1 of its cp blocks, so the last rank works cp blocks
while the mean rank works (cp + 1) / 2, and the others wait at the ring's exchanges:
at most (cp + 1) / (2 cp) of the compute is useful (75 % at cp 2, 56 % at cp 8).
Zigzag: every rank computes 2 cp + 1 pairs of (T / 2 cp)^2 scores (its own block's
two diagonals and one full pair; from an earlier rank both its chunks against that
rank's early chunk; from a later rank its late chunk against both), the same work.
The traffic is the same in both orders: every block goes round whole.

Online softmax, per query row, over the blocks in any order (m: running max,
l: running sum of exp, o: running unnormalised output):

    s   = q k_j^T / sqrt(d)                 (masked entries -inf)
    m'  = max(m, rowmax(s));  p = exp(s - m');  c = exp(m - m')
    l   = c l + rowsum(p);    o = c o + p v_j;   m = m'
    end: o = o / l,  lse = m + log l        (lse kept for the backward)

Backward (FlashAttention-2's, per block, with D = rowsum(dO * O)):

    p = exp(s - lse);  dv_j += p^T dO;  dp = dO v_j^T;  ds = p (dp - D)
    dq += ds k_j / sqrt(d);  dk_j += ds^T q / sqrt(d)

dq stays home; dk_j and dv_j belong to rank j.  The k, v blocks go round again,
and so does an accumulator of (dk_j, dv_j): block j's starts at rank j, each rank
adds its part and passes it on, and after cp sends it is home again.

Overlap: the next block's transfer is posted before the block at hand is worked
on, and waited for after (two buffers, one in flight).  In the backward the
accumulator arriving from the left is in flight while this rank computes its own
part, which is then added to it.  What a rank sends per layer (`ring_bytes`),
with a block b t C of one of k, v, dk, dv:

    forward    2 (cp - 1) blocks       k and v, cp - 1 steps
    backward   2 (cp - 1) + 2 cp       k and v again; dk and dv all the way home

`seconds` is the time spent waiting for the ring: the communication the overlap
did not hide.
"""
import math
import time

import torch

from allreduce.buffers import nbytes

from ..model.models import repeat_kv
from ..runtime.trace import span
from .context_order import CONTIGUOUS, chunks_of

# The k, v blocks and the dk, dv accumulators: two streams that may be in flight at once,
# told apart by tag.  Every message is waited for before the core returns, so the ring may
# share its transport with collectives called in turn, not with another thread's.
KV_TAG, GRAD_TAG = 0, 1


def ring_bytes(batch, seq_len, d_model, cp, itemsize=4, backward=True):
    """Bytes one rank sends per layer (the docstring's table): a block is one of k, v,
    dk, dv for this rank's seq_len / cp positions."""
    if cp == 1:
        return 0
    block = batch * (seq_len // cp) * d_model * itemsize
    blocks = 2 * (cp - 1) + (2 * (cp - 1) + 2 * cp if backward else 0)
    return blocks * block


def block_state(key_chunk, query_chunk, causal):
    """How a query chunk's rows see a key chunk (their places in the sequence): 'full',
    'diagonal' (masked inside) or 'skip'."""
    if not causal or key_chunk < query_chunk:
        return "full"
    return "diagonal" if key_chunk == query_chunk else "skip"


def chunk_pairs(rank, j, cp, order, causal):
    """What `rank`'s queries compute with block j (rank j's keys and values): (a, b,
    state) for each of its query chunks a and block j's key chunks b that is not
    skipped, a and b their places in the two ranks' blocks (the docstring's table)."""
    mine, theirs = chunks_of(rank, cp, order)[0], chunks_of(j, cp, order)[0]
    pairs = [(a, b, block_state(kc, qc, causal)) for a, qc in enumerate(mine)
             for b, kc in enumerate(theirs)]
    return [(a, b, state) for a, b, state in pairs if state != "skip"]


class Ring:
    """The cp ring over a point-to-point transport: left, right, and a count of what it sent."""

    def __init__(self, transport, tracer=None):
        self.transport, self.tracer = transport, tracer
        self.rank, self.size = transport.rank, transport.size
        self.left, self.right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self.bytes_sent = 0
        self.seconds = 0.0

    def pass_on(self, send, recv, tag):
        """Send `send` right and receive `recv` from the left; handles to wait on."""
        self.bytes_sent += nbytes(send)
        return [self.transport.irecv(recv, self.left, tag),
                self.transport.isend(send, self.right, tag)]

    def wait(self, handles, what):
        start = time.perf_counter()
        with span(self.tracer, f"ring attention {what}", "comm"):
            self.transport.wait_all(handles)
        self.seconds += time.perf_counter() - start


def scores(q, k, state):
    """q k^T / sqrt(d), the diagonal block masked above its diagonal."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if state == "diagonal":
        t = s.shape[-1]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


def rows(i, c):
    """The positions of a rank's chunk i in its block: [i c, (i+1) c) of its t."""
    return slice(i * c, (i + 1) * c)


class RingAttentionFunction(torch.autograd.Function):
    """Attention of this rank's q (B, H, t, D) over the k, v of every rank of the ring,
    its positions and theirs in --cp-order's `order`."""

    @staticmethod
    def forward(ctx, q, k, v, ring, causal, order):
        kv = torch.stack([k, v])                 # one message a step: (2, B, H, t, D)
        spare = torch.empty_like(kv)
        m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros_like(q)
        c = q.shape[-2] // len(chunks_of(ring.rank, ring.size, order)[0])   # a chunk's length
        for step in range(ring.size):
            j = (ring.rank - step) % ring.size
            # 1. post the next block's transfer before working on this one
            moving = ring.pass_on(kv, spare, KV_TAG) if step < ring.size - 1 else []
            # 2. fold block j's key chunks into the running max, sum and output of the
            #    query chunks that see them
            for a, b, state in chunk_pairs(ring.rank, j, ring.size, order, causal):
                qa, kb, vb = q[..., rows(a, c), :], kv[0][..., rows(b, c), :], \
                    kv[1][..., rows(b, c), :]
                s = scores(qa, kb, state)
                m_a = m[..., rows(a, c)]
                m_new = torch.maximum(m_a, s.amax(-1))
                p = torch.exp(s - m_new[..., None])
                correction = torch.exp(m_a - m_new)
                l[..., rows(a, c)] = correction * l[..., rows(a, c)] + p.sum(-1)
                o[..., rows(a, c), :] = correction[..., None] * o[..., rows(a, c), :] + p @ vb
                m[..., rows(a, c)] = m_new
            # 3. the next block has arrived; this one's buffer takes the one after
            if moving:
                ring.wait(moving, "forward")
                kv, spare = spare, kv
        o = o / l[..., None]
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ring, ctx.causal, ctx.order, ctx.chunk = ring, causal, order, c
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        ring, causal, order, c = ctx.ring, ctx.causal, ctx.order, ctx.chunk
        grad_o = grad_o.contiguous()
        scale = 1 / math.sqrt(q.shape[-1])
        D = (grad_o * o).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        spare = torch.empty_like(kv)
        acc, arriving, acc_moving = None, torch.empty_like(kv), []
        for step in range(ring.size):
            j = (ring.rank - step) % ring.size
            last = step == ring.size - 1
            # 1. post the next k, v block's transfer
            moving = ring.pass_on(kv, spare, KV_TAG) if not last else []
            # 2. our part of block j's gradients, while its accumulator is on its way here
            part = torch.zeros_like(kv)
            for a, b, state in chunk_pairs(ring.rank, j, ring.size, order, causal):
                A, Bc = rows(a, c), rows(b, c)
                qa, do_a, kb, vb = q[..., A, :], grad_o[..., A, :], kv[0][..., Bc, :], \
                    kv[1][..., Bc, :]
                p = torch.exp(scores(qa, kb, state) - lse[..., A, None])
                part[1][..., Bc, :] += p.transpose(-2, -1) @ do_a                # dv_j
                ds = p * (do_a @ vb.transpose(-2, -1) - D[..., A, :])
                dq[..., A, :] += ds @ kb * scale
                part[0][..., Bc, :] += ds.transpose(-2, -1) @ qa * scale         # dk_j
            # 3. add it to block j's accumulator (it starts here at step 0) and pass it on:
            #    after cp sends every accumulator is back with its block's rank
            if acc_moving:
                ring.wait(acc_moving, "backward dk dv")
                acc, arriving = arriving, acc
                acc += part
            else:
                acc = part
            if ring.size > 1:
                acc_moving = ring.pass_on(acc, arriving, GRAD_TAG)
            if moving:
                ring.wait(moving, "backward kv")
                kv, spare = spare, kv
        if acc_moving:                             # our own dk, dv, home from the left
            ring.wait(acc_moving, "backward dk dv")
            acc = arriving
        return dq, acc[0], acc[1], None, None, None


class RingAttention:
    """The GPT's attention core (models.CausalSelfAttention.core) over a cp ring:
    q, k, v (B, t, C) of this rank's positions, in --cp-order's `order` -> (B, t, C)."""

    def __init__(self, transport, causal=True, tracer=None, order=CONTIGUOUS):
        self.ring = Ring(transport, tracer)
        self.causal, self.order = causal, order

    @property
    def bytes_sent(self):
        return self.ring.bytes_sent

    @property
    def seconds(self):
        return self.ring.seconds

    def __call__(self, q, k, v, heads, kv_heads=None):
        # grouped-query attention travels as full heads: each key-value head repeated
        k, v = (repeat_kv(x, heads, kv_heads or heads) for x in (k, v))
        B, t, C = q.shape
        q, k, v = (x.view(B, t, heads, C // heads).transpose(1, 2).contiguous()
                   for x in (q, k, v))
        y = RingAttentionFunction.apply(q, k, v, self.ring, self.causal, self.order)
        return y.transpose(1, 2).reshape(B, t, C)
