"""Gradient accumulation: one step's batch in k micro-steps, communicated once.

A rank that cannot hold the activations of its whole share b = B/P of the global
batch splits it into k micro-batches of b/k samples, runs forward and backward on
each in turn and lets autograd add their gradients up in .grad.  Each micro-batch's
loss (a mean over its b/k samples) is scaled by 1/k, so the sum is the gradient of
the mean over all b samples: the step is the one of the unsplit batch, up to the
order of float additions (Goyal et al. 2017, "Accurate, Large Minibatch SGD:
Training ImageNet in 1 Hour", on keeping the update a function of the global batch
however it is cut).

Communication is suppressed on the first k-1 micro-steps with the sync's no_sync()
(PyTorch DDP's context of the same name: Li et al. 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", section 3.2.4).  Only the last
backward runs outside it, so the gradient buckets are all-reduced once per step,
overlapped with that last backward, and a parameter server sees one push:

    micro-step   batch rows           loss scale   inside no_sync   communication
    1            [0, b/k)             1/k          yes              none: .grad += g_1
    2            [b/k, 2b/k)          1/k          yes              none: .grad += g_2
    ...
    k            [(k-1)b/k, b)        1/k          no               buckets all-reduced as
                                                                    backward fills them (ps:
                                                                    one push_pull in
                                                                    synchronize)
    then         sync.synchronize(step), sync.step(optimizer): once, as with k = 1

    memory:  activations of b/k samples at a time instead of b
    time:    k smaller forwards and backwards (less efficient kernels), the same traffic

In a loop of one's own, DistributedOptimizer's `no_sync()` does the same (the loop is
in optimizer.py's docstring).

This is the trivial schedule: the pipeline's (parallel/pipeline.py) with one stage,
what the step engine (engine/loop.py) drives where the model is not cut into stages.
`--micro-batches k` sets k on every run (`--grad-accum k` is its other name,
config/settings.py); on the grid the pipeline's schedules run the same k.
"""
from contextlib import nullcontext

from ..runtime.metrics import now
from ..runtime.precision import MixedPrecision


class Accumulation:
    """The schedule of one stage: `run(x, y)` is accumulate's k micro-steps over the
    whole model, the shape of Pipeline.run (parallel/pipeline.py).  forward: what the
    micro-batches go through (the model, or a wrapper of it such as torch's DDP)."""

    def __init__(self, model, forward, k, sync, device, tracer=None, recompute=None,
                 precision=None):
        self.model, self.forward, self.k, self.sync = model, forward, k, sync
        self.clock = lambda: now(device)
        self.tracer, self.recompute, self.precision = tracer, recompute, precision

    def run(self, x, y, step):
        """Step `step`'s forwards and backwards; returns the loss of the local batch, a
        tensor (reading it would wait for the GPU before the update is queued)."""
        loss = accumulate(step, self.model, self.forward, x, y, self.k, self.sync,
                          self.clock, self.tracer, self.recompute, self.precision)
        return loss        # a tensor: read after the step's update (engine/loop.py)


def accumulate(step, model, forward, x, y, k, sync, clock, tracer=None, recompute=None,
               precision=None):
    """Forward and backward of this rank's batch (x, y) in k micro-steps, communicating
    on the last only; returns the loss of the whole batch (the mean over its samples),
    detached.  clock() reads the device's time (metrics.now); tracer, recompute
    (recompute.Recompute) and precision (precision.MixedPrecision: autocast, fp16's
    scaled backward) are optional."""
    precision = precision or MixedPrecision()
    if tracer is None:          # the spans need the times; a GPU's wait for them does not
        clock = float
    micro_x, micro_y = x.chunk(k), y.chunk(k)      # config/settings.py checked that k divides b
    total = 0.0
    for i, (xi, yi) in enumerate(zip(micro_x, micro_y)):
        last = i == k - 1
        # the first k-1 micro-steps only add into .grad; the last one sends the sum
        with nullcontext() if last else sync.no_sync():
            t0 = clock()
            with precision.autocast():
                loss = model.criterion(forward(xi), yi) / k
            t1 = clock()
            with recompute.backward() if recompute else nullcontext():
                precision.backward(loss)
            t2 = clock()
        total = total + loss.detach()
        if tracer:                                  # --trace: each micro-step as lived
            name = f"{step}" if k == 1 else f"{step}.{i}"
            tracer.add(f"forward {name}", "forward", t0, t1)
            tracer.add(f"backward {name}", "backward", t1, t2)
    return total
