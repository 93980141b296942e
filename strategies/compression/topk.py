"""Top-k sparsification: each rank sends only its largest gradient entries.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP
2017 (drop the smallest 99 % by magnitude, keep the rest as a residual); Lin et
al., "Deep Gradient Compression", ICLR 2018 (the same at 0.1 %, with momentum
correction).  Strom, Interspeech 2015, did it with a threshold instead of k.

Momentum (--momentum-correction, DGC section 3.2): with SGD momentum applied
after the exchange, an entry held back in the residual for many steps arrives
as one stale burst that momentum then keeps repeating.  DGC accumulates the
velocity locally instead, u = m u + g, feeds u (not g) to step 1, and clears u
where entries were sent ("momentum factor masking"); the optimizer runs with
no momentum of its own.

Per bucket of n float32 entries, with k = ceil(RATIO * n) (at least 1):

    step  what                                          on the wire (per rank)
    1     acc = g + e              (error_feedback.py)  -
    2     idx = the k largest |acc|                     -
    3     pack [idx as int32 | acc[idx] as float32]     -
    4     all-gather the packs of every rank            2k * 4 bytes handed over
    5     e = acc with acc[idx] set to 0  (= acc - sent)
    6     out = 0; out[idx_r] += val_r for each rank r; out /= P

Why an all-gather and not an all-reduce: ranks pick different indices, so the
sparse vectors cannot be added entry by entry on the way (a ring's reduce-scatter
needs the same layout everywhere).  Each rank gets everyone's (index, value)
pairs and adds them into a dense buffer; an index picked by several ranks adds
up, as a sum should.  The cost (compressor.wire_bytes_sent, ring): a rank sends (P-1) * 8k
bytes in the all-gather, against 2 (P-1)/P * 4n in a float32 ring all-reduce,
a ratio of k P / n: top-k pays off only while RATIO < 1/P, and its share of
the bytes grows with P (at RATIO 0.01: 2 % at P = 2, 64 % at P = 64).

Warm-up (--sparsity-warmup STEPS, DGC section 3.4): over the first STEPS steps
k comes from compressor.kept_ratio_at(RATIO, STEPS, step) instead of RATIO: 25 %
at step 0, a quarter of that per stage, RATIO from step STEPS on.  The step is
the sync's (set_step, before the step's backward), so every rank picks the same
k and the all-gathered packs stay of one size.

Through the parameter servers (--sync ps, hybrid) there is nothing to all-gather: a
push carries each slice's pairs (`encode`: steps 1, 2, 5, with the slice's own k),
and the server adds them into a dense slice (psrv/protocol.py's TOPK encoding),
8k bytes a slice whatever the number of workers.

Indices are int32 (a bucket holds < 2^31 entries) and the values travel as
their int32 bit pattern, so one message of one dtype carries both.
"""
import torch

from ..config.compress_spec import kept_ratio_at, topk_count
from .casts import Compressor
from .error_feedback import ErrorFeedback, copies


def select_topk(acc, k):
    """The indices (int64) and values of the k entries of acc largest in magnitude."""
    indices = torch.topk(acc.abs(), k, sorted=False).indices
    return indices, acc[indices]


def pack(indices, values):
    """[indices as int32 | values' float32 bits as int32]: one flat int32 message."""
    return torch.cat([indices.to(torch.int32), values.to(torch.float32).view(torch.int32)])


def unpack_sum(gathered, k, size, out):
    """out = the mean over `size` ranks of their sparse vectors, from the all-gathered
    packs (rank r's pack is gathered[2kr : 2k(r+1)])."""
    out.zero_()
    for r in range(size):
        pack_r = gathered[2 * k * r: 2 * k * (r + 1)]
        out.index_add_(0, pack_r[:k].to(torch.int64), pack_r[k:].view(torch.float32))
    out.div_(size)
    return out


class TopKCompressor(Compressor):
    """topk:RATIO over a collective that can all-gather (every allreduce/ algorithm)."""
    lossy = True

    def __init__(self, ratio, coll, error_feedback=True, momentum=0.0, warmup=0):
        self.name = f"topk:{ratio:g}"
        self.ratio, self.coll, self.momentum, self.warmup = ratio, coll, momentum, warmup
        self.feedback = ErrorFeedback(error_feedback)
        self.velocity = {}                    # momentum correction: u per bucket
        self.next_ratio = self.kept_ratio = kept_ratio_at(ratio, warmup, 0)

    def set_step(self, step):
        super().set_step(step)
        self.next_ratio = kept_ratio_at(self.ratio, self.warmup, step)   # DGC's warm-up

    def state_dict(self):
        """The residuals, DGC's velocities and the step whose k comes next (the warm-up's)."""
        return {"step": self.step, "feedback": self.feedback.state_dict(),
                "velocity": copies(self.velocity)}

    def load_state_dict(self, state):
        self.set_step(state["step"])
        self.feedback.load_state_dict(state["feedback"])
        self.velocity = copies(state["velocity"])

    def rescale(self, factor):
        self.feedback.rescale(factor)
        for velocity in self.velocity.values():
            velocity.mul_(factor)

    def encode(self, key, flat):
        """Steps 1, 2 and 5 of `flat` (a bucket, or a slice a push carries:
        server_buckets.py): the (indices, values) of its k largest entries; the rest
        stays in the residual."""
        # kept_ratio: what this step sends, for its record; next_ratio moves on in
        # set_step before the record of this step is written
        self.kept_ratio = self.next_ratio
        grad = self.corrected(key, flat)                          # u = m u + g, or g
        acc = self.feedback.accumulate(key, grad)                 # 1. g + e
        k = topk_count(acc.numel(), self.kept_ratio)
        indices, values = select_topk(acc, k)                     # 2. the k largest (a copy)
        if self.feedback.enabled:                                 # 5. e = acc - sent, without
            acc.index_fill_(0, indices, 0.0)                      #    a dense `sent`
        if self.momentum:                                         # DGC's momentum factor
            grad.index_fill_(0, indices, 0.0)                     # masking
        return indices, values

    def reduce_bucket(self, key, flat, wire, shapes, allreduce_avg, coll=None):
        coll = coll or self.coll                                  # the bucket's replicas
        indices, values = self.encode(key, flat)                  # 1., 2., 5.
        message = pack(indices, values)                           # 3.
        gathered = coll.allgather(message, n=message.numel() * coll.size)  # 4.
        unpack_sum(torch.as_tensor(gathered), len(indices), coll.size, flat)   # 6.
        return message.numel() * message.element_size()

    def corrected(self, key, flat):
        """DGC's momentum correction: the velocity u = m u + g is what accumulates in the
        residual, so an entry sent late carries the momentum it would have had; the
        optimizer then runs without momentum (sync.make_optimizer)."""
        if not self.momentum:
            return flat
        velocity = self.velocity.get(key)
        if velocity is None:
            velocity = self.velocity[key] = torch.zeros_like(flat)
        return velocity.mul_(self.momentum).add_(flat)
