"""fp16's skipped step, undone in a lossy compressor's state.

Under --precision fp16 a bucket is compressed while backward still runs (sync/buckets.py),
before the overflow vote that decides whether the step is taken (runtime/precision.py,
step 4).  A lossy compressor has by then folded the step's gradients into what it
carries to the next step: error feedback's residuals (error_feedback.py), PowerSGD's
warm-start Q, top-k's velocity.  The vote skips a step whose gradients hold an inf or a
NaN, and that step must leave no trace (Micikevicius et al., "Mixed Precision
Training", ICLR 2018, section 3.2: the weights and the optimizer untouched): an inf
kept in a residual would come back in every later step, each then skipped too.

So the sync keeps a copy of the compressor's state as it was when the step began and
loads it back where the vote skips the step:

    kept = KeptState(compressor)         built with the sync (and after a resume)
    ... backward: buckets compressed, the state moves ...
    kept.decided(stepped)                after the vote: keep the new state, or go back

The step the compressor is at (top-k's warm-up) goes by the loop's steps and is not
taken back.

The state is in the units of the gradients the buckets hold, S x g for a loss scale S:
where the vote changes S (halved on a skip, doubled after `window` clean steps), the
residuals and top-k's velocity are multiplied by S' / S (a power of two: exact in
floating point), so that what they add to the next step's S' x g is of S' too.  Kept
at the old S, one halving would send the held-back gradients twice over, and one
doubling half of them.

Cost: one copy of the state a step (a float32 copy of the gradients for the
residuals), and on a GPU one host read of the vote, only under fp16 with a lossy
compressor.  Under the parameter servers (--sync ps, hybrid) nothing is to be undone:
the pushes, and so the push compressor, wait for the vote (sync/server_buckets.py).
"""
import torch


class KeptState:
    """The state `compressor` had when the step began, put back if the step is skipped."""

    def __init__(self, compressor):
        self.compressor = compressor
        self.kept = compressor.state_dict()          # a copy (error_feedback.copies)

    def decided(self, stepped, rescale=1.0):
        """After fp16's vote: `stepped` (a bool, or a bool tensor: read on the host), and
        the loss scale's new value over its old (a number, or a tensor beside the scale)."""
        if not bool(stepped):
            step = self.compressor.step
            self.compressor.load_state_dict(self.kept)   # loads a copy: kept stays intact
            self.compressor.set_step(step)
        if torch.is_tensor(rescale) or rescale != 1.0:
            self.compressor.rescale(rescale)
        self.kept = self.compressor.state_dict()


def kept_state(cfg, compressor):
    """A KeptState where fp16 may skip a step that `compressor` has seen (a lossy one),
    else None."""
    return KeptState(compressor) if cfg.precision == "fp16" and compressor.lossy else None
