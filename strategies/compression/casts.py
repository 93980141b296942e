"""Gradient compression on the wire: Horovod's two-method Compressor, for the casts.

    c = make_compressor("fp16")
    wire = c.compress(flat_grad, scratch)   # what the collective moves
    c.decompress(wire, flat_grad)           # back into the float32 buffer

fp16 and bf16 halve the bytes on the wire.  The all-reduce then also *adds*
in 16 bits (as Horovod's fp16 compression does), so the sum loses precision:
fp16 keeps 11 significant bits but overflows above 65504 (gradients rarely
come near); bf16 keeps float32's range but only 8 significant bits.  Neither
is bit-equal to float32 training, so the equivalence tests use `none`.

A bucket (buckets.py) is reduced by `reduce_bucket`: for these casts, compress,
all-reduce, decompress.  The lossy compressions (topk.py, powersgd.py) write
their own `reduce_bucket`, with error feedback (error_feedback.py), and may
call other collectives (top-k all-gathers).  It returns the bytes this rank
handed to the collectives: the "wire bytes" of the step records.

What a compressor carries from one step to the next (residuals, PowerSGD's warm-start
Q, top-k's velocity and step) is its own, and it hands it over as torch's optimizers
do: `state_dict()` for a checkpoint, `load_state_dict(state)` on --resume, through the
sync's own state_dict (runtime/checkpoint/rank_file.py stores what the sync hands it).  The
casts keep nothing.
"""
import torch

from ..runtime.precision import HALF_DTYPES


class Compressor:
    """The identity: float32 on the wire."""
    name = "none"
    wire_dtype = torch.float32
    step = 0                     # the step whose buckets come next (set_step)
    kept_ratio = None            # top-k: the fraction of each bucket its last step sent
    lossy = False                # drops part of each bucket (top-k, PowerSGD): it compresses
                                 # an all-reduce, not a reduce-scatter (zero.py)

    def set_step(self, step):
        """The sync says which step's buckets come next (ZeRO.synchronize); only
        top-k's warm-up reads it (topk.py), the others keep no schedule."""
        self.step = step

    def compress(self, flat, scratch=None):
        return flat

    def decompress(self, wire, out):
        if wire.data_ptr() != out.data_ptr():
            out.copy_(wire)

    def state_dict(self):
        """What carries across steps, for this rank's checkpoint file: {} for the casts."""
        return {}

    def load_state_dict(self, state):
        """Resume from `state` (a state_dict of the same compression, its tensors already
        where the buckets live)."""

    def rescale(self, factor):
        """fp16's loss scale changed by `factor`: what the state holds of the gradients
        follows it (compression/skipped_step.py); nothing for the casts."""

    def reduce_bucket(self, key, flat, wire, shapes, allreduce_avg, coll=None):
        """flat := the mean over the ranks of flat (bucket `key`, its tensors of `shapes`
        laid out in order; `wire` a scratch buffer of wire_dtype or None); returns the
        bytes handed to the collective.  `allreduce_avg` averages over the bucket's
        replicas; `coll` is a collective over them for the compressors that all-gather
        (None: the one they were built with, the dp axis's), an expert's replicas for
        an expert's bucket (--ep)."""
        sent = self.compress(flat, wire)
        allreduce_avg(sent)
        self.decompress(sent, flat)
        return sent.numel() * sent.element_size()


class CastCompressor(Compressor):
    """Cast to a 16-bit float type for the wire and back afterwards."""

    def __init__(self, name, dtype):
        self.name, self.wire_dtype = name, dtype

    def compress(self, flat, scratch=None):
        if scratch is None:
            return flat.to(self.wire_dtype)
        scratch.copy_(flat)        # a cast into a buffer kept between steps
        return scratch

    def decompress(self, wire, out):
        out.copy_(wire)


def make_compressor(name):
    """A cast compressor; sync.build_compressor makes every kind of --compress."""
    if name == "none":
        return Compressor()
    if name in HALF_DTYPES:
        return CastCompressor(name, HALF_DTYPES[name])
    raise ValueError(f"unknown compression {name!r}; choose none, fp16, bf16")
