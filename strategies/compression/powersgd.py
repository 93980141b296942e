"""PowerSGD: each gradient matrix travels as two thin factors, P and Q.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019.  One step of power iteration per
training step finds a rank-r approximation M ~ P Qᵀ of each gradient matrix M
(n x m); P (n x r) and Q (m x r) are all-reduced instead of M, so the bytes fall
from n*m to (n + m) r.  Unlike top-k, the factors *can* be all-reduced: every
rank uses the same Q, so P = M Q is linear in M and the mean of the P's is the
P of the mean gradient.

Per bucket, for each matrix-shaped gradient (a weight of shape (n, ...) is seen
as n x m); biases and other vectors, and matrices too small to gain, go dense:

    step  what                                   why
    1     acc = M + e         (error_feedback.py) what earlier steps held back
    2     P = acc Q                              Q: last step's (warm start), the
                                                 same on every rank
    3     all-reduce (mean) P                    wire: n r floats
    4     P = orthonormalise(P)   (QR)           a basis of the column space
    5     Q_local = accᵀ P                       wire below: m r floats
    6     all-reduce (mean) Q = mean of Q_local
    7     e = acc - P Q_localᵀ                   this rank's part not sent
    8     out = P Qᵀ                             = the mean over ranks of P Q_localᵀ

Step 7 takes the rank's *own* reconstruction, so sent + e = acc holds exactly
on every rank, and step 8 is the mean of what the ranks sent (P is shared).
The warm start is the paper's: one power-iteration step per training step
converges over steps because the gradients change slowly.  The first Q is
Gaussian from a seed every rank shares.  All matrices of a bucket share one
all-reduce of P's and one of Q's; the dense parts share a third.

Through the parameter servers (--sync ps, hybrid) each slice a worker pushes is one
matrix (psrv/protocol.py's POWERSGD encoding says how a flat slice becomes one) and
travels as its own factors (`encode`), which the server multiplies out and adds.
"""
import math

import torch

from .casts import Compressor
from .error_feedback import ErrorFeedback, copies


def as_matrix_shape(shape):
    """(n, m) of a gradient seen as a matrix, or None for a vector or scalar."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def worth_compressing(n, m, rank):
    """Whether rank-r factors are smaller than the matrix itself."""
    return (n + m) * rank < n * m


def orthonormalise(p):
    """An orthonormal basis of p's columns (reduced QR); Gram-Schmidt in the paper."""
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGDCompressor(Compressor):
    """powersgd:RANK over any all-reduce."""
    lossy = True

    def __init__(self, rank, error_feedback=True, seed=0):
        self.name = f"powersgd:{rank}"
        self.rank, self.seed = rank, seed
        self.feedback = ErrorFeedback(error_feedback)
        self.qs = {}                                 # (bucket, position) -> warm-start Q

    def state_dict(self):
        """The residuals and each matrix's warm-start Q: a resumed run that drew its first
        Q again would start its power iteration over (a different P, a different step)."""
        return {"feedback": self.feedback.state_dict(), "qs": copies(self.qs)}

    def load_state_dict(self, state):
        self.feedback.load_state_dict(state["feedback"])
        self.qs = copies(state["qs"])

    def rescale(self, factor):
        """The residuals follow the loss scale; Q need not: P is orthonormalised, so
        its scale drops out."""
        self.feedback.rescale(factor)

    def plan(self, shapes):
        """[(offset, numel, (n, m) or None)] of a bucket's tensors in their flat order."""
        out, offset = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            nm = as_matrix_shape(shape)
            if nm is not None and not worth_compressing(*nm, self.rank):
                nm = None
            out.append((offset, numel, nm))
            offset += numel
        return out

    def first_q(self, bucket, position, m):
        """The first Q of a matrix: Gaussian, from a seed that names the matrix, so that
        every rank draws the same one without a message."""
        generator = torch.Generator().manual_seed(self.seed + 100_003 * bucket + position)
        return torch.randn(m, self.rank, generator=generator)

    def encode(self, key, flat, shape):
        """The factors a push carries for `flat`, a slice seen as a matrix of `shape`
        (n, m) (psrv/protocol.py's matrix_shape: row by row, zero-padded), or None where
        they would not be smaller than the slice, which then travels dense.

        Steps 1, 2, 4, 5 and 7 with no all-reduce between them: the parameter server adds
        the workers' products P Q_localᵀ in float32, so each worker's factors are its own,
        P orthonormalised from its own acc Q, and the warm start is its own last Q_local.
        The sum of W rank-r pushes has rank up to W r; what a worker's misses, its
        residual sends later, as on the ring."""
        n, m = shape
        if not worth_compressing(n, m, self.rank):
            return None
        acc = self.feedback.accumulate(key, flat)                   # 1.
        mat = torch.zeros(n * m, dtype=acc.dtype, device=acc.device)
        mat[:acc.numel()] = acc
        mat = mat.view(n, m)
        q = self.qs.get((key, 0))
        p = orthonormalise(mat @ (q if q is not None else
                                  self.first_q(key, 0, m).to(acc.device)))   # 2., 4.
        q_local = mat.t() @ p                                       # 5.
        self.feedback.keep(key, acc, (p @ q_local.t()).view(-1)[:acc.numel()])   # 7.
        self.qs[(key, 0)] = q_local                                 # warm start
        return p, q_local

    def reduce_bucket(self, key, flat, wire, shapes, allreduce_avg, coll=None):
        acc = self.feedback.accumulate(key, flat)                   # 1.
        plan = self.plan(shapes)
        matrices = [(i, o, nm) for i, (o, numel, nm) in enumerate(plan) if nm is not None]
        dense = [(o, numel) for o, numel, nm in plan if nm is None]
        sent = torch.empty_like(acc)
        handed = 0
        if matrices:
            ms = [acc[o:o + n * m].view(n, m) for _, o, (n, m) in matrices]
            qs = []
            for (i, _, (n, m)) in matrices:
                q = self.qs.get((key, i))
                qs.append(q if q is not None else self.first_q(key, i, m).to(acc.device))
            ps = torch.cat([(mat @ q).view(-1) for mat, q in zip(ms, qs)])   # 2.
            allreduce_avg(ps)                                               # 3.
            handed += ps.numel() * 4
            p_hats, offset = [], 0
            for (_, _, (n, m)) in matrices:
                p_hats.append(orthonormalise(ps[offset:offset + n * self.rank]
                                             .view(n, self.rank)))          # 4.
                offset += n * self.rank
            q_locals = [mat.t() @ p for mat, p in zip(ms, p_hats)]          # 5.
            q_flat = torch.cat([q.reshape(-1) for q in q_locals])
            q_mean = q_flat.clone()
            allreduce_avg(q_mean)                                           # 6.
            handed += q_mean.numel() * 4
            offset = 0
            for (i, o, (n, m)), p, q_local in zip(matrices, p_hats, q_locals):
                q = q_mean[offset:offset + m * self.rank].view(m, self.rank)
                offset += m * self.rank
                sent[o:o + n * m].view(n, m).copy_(p @ q_local.t())         # for 7.
                flat[o:o + n * m].view(n, m).copy_(p @ q.t())               # 8.
                self.qs[(key, i)] = q.clone()                               # warm start
        if dense:
            values = torch.cat([acc[o:o + numel] for o, numel in dense])
            for o, numel in dense:
                sent[o:o + numel] = acc[o:o + numel]
            allreduce_avg(values)
            handed += values.numel() * 4
            offset = 0
            for o, numel in dense:
                flat[o:o + numel] = values[offset:offset + numel]
                offset += numel
        self.feedback.keep(key, acc, sent)                                  # 7.
        return handed
