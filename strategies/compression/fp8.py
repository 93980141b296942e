"""FP8 on the wire: each bucket as e4m3 bytes with one float32 scale, and error feedback.

Micikevicius et al., "FP8 Formats for Deep Learning", 2022: e4m3 (4 exponent bits,
3 mantissa bits, no infinities, largest value 448) for values that need precision,
e5m2 for range; a tensor is scaled into the format's range by a factor taken from
its largest magnitude (amax) before the cast, and the factor travels beside it.

Per bucket of n float32 entries, on every rank:

    step  what                                            on the wire (per rank)
    1     acc = g + e                (error_feedback.py)  -
    2     s = 448 / amax(acc)        (1 where acc is 0)   -
    3     q = e4m3(acc * s)          (round to nearest)   -
    4     e = acc - q / s            what rounding dropped waits for the next step
    5     all-gather [q bytes | s]   of every rank        n + 4 bytes handed over
    6     out = sum_r q_r / s_r in float32, / P

Why an all-gather, not an all-reduce of fp8.  An all-reduce adds on the way, in
the wire's type: fp8 sums overflow past 448 (P ranks each near amax) and every
addition rounds again to 3 mantissa bits, P - 1 roundings that error feedback,
which sees only this rank's own, never returns.  Each rank also has its own
scale, and q_a / s_a + q_b / s_b is no sum of bytes.  So each rank's bytes travel
untouched and are added where they arrive, in float32, as top-k's pairs are
(topk.py): the only rounding is step 3, and step 4 keeps all of it, so
sent_1 + ... + sent_t + e_t = g_1 + ... + g_t exactly as error feedback promises.

The bytes.  A rank hands n + 4 bytes to the collective against float32's 4n: a
quarter.  On a ring the all-gather sends (P - 1)(n + 4) bytes per rank, against
the float32 all-reduce's 2 (P - 1)/P 4n: P/8 of it, a quarter at P = 2, a half at
P = 4, no saving from P = 8.  Past P = 2 a ring that re-quantises each partial
sum at every hop of its reduce-scatter keeps the quarter at every P, at the price
of the P - 1 unfed roundings above; this file keeps the exact sum.

Through the parameter servers (--sync ps, hybrid) a push carries each slice of a
bucket as steps 1-4 make it (`encode`), and the server adds the pushes in float32
(psrv/protocol.py's FP8 encoding): the same exact sum, L + 4 bytes a slice.

Packing: the n bytes (padded to a multiple of 4) and the scale's float32 bits
travel as one int32 message (the collectives' dtypes have no byte type), as
top-k's indices and values do.
"""
import torch

from ..runtime.fp8_formats import E4M3, FP8_MAX, dequantize, quantize
from .casts import Compressor
from .error_feedback import ErrorFeedback

E4M3_MAX = FP8_MAX[E4M3]                  # 448


def quantise(x):
    """Steps 2-3 of a bucket x: (its e4m3 values, its scale), runtime/fp8_formats.py's
    quantize in the wire's one format."""
    return quantize(x, E4M3)


dequantise = dequantize                   # step 6's q / s (and step 4's)


def pack(q, scale):
    """[q's bytes, zero-padded to whole int32 words | scale's float32 bits]: int32."""
    raw = q.view(torch.uint8)
    padded = torch.zeros(-(-raw.numel() // 4) * 4, dtype=torch.uint8, device=raw.device)
    padded[:raw.numel()] = raw
    return torch.cat([padded.view(torch.int32), scale.reshape(1).float().view(torch.int32)])


def unpack(message, n):
    """(q, scale) of one rank's packed message of a bucket of n entries."""
    return message[:-1].view(torch.uint8)[:n].view(E4M3), message[-1:].view(torch.float32)[0]


class Fp8Compressor(Compressor):
    """fp8 (e4m3) frames over a collective that can all-gather (every allreduce/ algorithm)."""
    name = "fp8"
    lossy = True           # rounds to 3 mantissa bits: an all-gather, with error feedback

    def __init__(self, coll, error_feedback=True):
        self.coll = coll
        self.feedback = ErrorFeedback(error_feedback)

    def state_dict(self):
        return {"feedback": self.feedback.state_dict()}

    def load_state_dict(self, state):
        self.feedback.load_state_dict(state["feedback"])

    def rescale(self, factor):
        self.feedback.rescale(factor)

    def encode(self, key, flat):
        """Steps 1-4 of `flat` (a bucket, or a slice a push carries: server_buckets.py):
        (its e4m3 values, its scale), what the rounding dropped kept as the residual."""
        acc = self.feedback.accumulate(key, flat)                 # 1. g + e
        q, scale = quantise(acc)                                  # 2., 3.
        self.feedback.keep(key, acc, dequantise(q, scale))        # 4. e = acc - q / s
        return q, scale

    def reduce_bucket(self, key, flat, wire, shapes, allreduce_avg, coll=None):
        coll = coll or self.coll                                  # the bucket's replicas
        n, P = flat.numel(), coll.size
        message = pack(*self.encode(key, flat))                   # 1.-4.
        words = message.numel()
        gathered = torch.as_tensor(coll.allgather(message, n=words * P))        # 5.
        flat.zero_()                                              # 6. sum in float32
        for r in range(P):
            flat.add_(dequantise(*unpack(gathered[r * words:(r + 1) * words], n)))
        flat.div_(P)
        return words * 4
