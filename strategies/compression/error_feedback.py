"""Error feedback: what a lossy compression dropped is added to the next step's gradient.

Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014 (the idea,
for 1-bit quantisation); Karimireddy et al., "Error Feedback Fixes SignSGD and
other Gradient Compression Schemes", ICML 2019 (why it converges: the
compressed steps then add up to the uncompressed ones, only delayed).

Per rank and per bucket, a residual e (zero at the start):

    step  what                          why
    1     acc = g + e                   the gradient, plus all that earlier steps held back
    2     sent = C(acc)                 top-k entries (topk.py) or a low-rank P Qᵀ (powersgd.py)
    3     e = acc - sent                what was not sent waits for the next step
    4     all ranks' `sent` averaged    the collective; the optimizer steps on that

So after any number of steps, sent_1 + ... + sent_t + e_t = g_1 + ... + g_t on
every rank: no gradient is lost, a small one is only sent late (once its
accumulated value is large enough for top-k to pick it).  Without error
feedback (--no-error-feedback) top-k at 1 % sends the same few large entries
every step and the others never move.

The residuals are each rank's own: they never travel, so they are not in the
bytes on the wire, and they cost one float32 copy of the gradients in memory.
Being each rank's own, they are in each rank's checkpoint file (state_dict): a
run resumed with residuals set back to zero would drop what the steps before the
checkpoint held back, and no longer be the run that never stopped.
"""
import torch


def copies(tensors):
    """{key: a copy of its tensor}: what a compressor's state_dict hands out and its
    load_state_dict takes in.  The steps add into the residuals in place, so a state
    handed out by reference (a checkpoint still in memory, fp16's kept state:
    compression/skipped_step.py) would change with every later step, and one loaded
    twice would be shared by two compressors."""
    return {k: v.clone() for k, v in tensors.items()}


class ErrorFeedback:
    """The residual of each bucket (keyed by bucket index) of one rank.

        acc = feedback.accumulate(key, grad)    step 1 (acc is the residual's buffer)
        ...compress acc, exchange...            step 2
        feedback.keep(key, acc, sent)           step 3: e = acc - sent

    With enabled=False, accumulate returns grad itself and keep does nothing:
    plain compressed SGD, whatever was not sent is dropped."""

    def __init__(self, enabled=True):
        self.enabled = enabled
        self.residuals = {}

    def accumulate(self, key, grad):
        if not self.enabled:
            return grad
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = torch.zeros_like(grad)
        return residual.add_(grad)             # in place: the residual becomes acc

    def keep(self, key, acc, sent):
        """e = acc - sent (acc is the residual's own buffer, so in place)."""
        if self.enabled:
            acc.sub_(sent)

    def state_dict(self):
        return {"residuals": copies(self.residuals)}

    def load_state_dict(self, state):
        self.residuals = copies(state["residuals"])

    def rescale(self, factor):
        """Every residual times `factor` (fp16's loss scale changed: skipped_step.py)."""
        for residual in self.residuals.values():
            residual.mul_(factor)

    def residual(self, key):
        """The residual of `key` now (zeros before its first step); for tests and figures."""
        return self.residuals.get(key)
