"""The schedule of one stage: one step's batch in k micro-batches, communicated once.

Every run whose pipeline has one stage takes it: a whole model (plain data parallelism,
the parameter servers, the experts apart) and the grid at pp = 1 (its one Stage);
Pipeline and InterleavedPipeline (parallel/pipeline.py, interleaved.py) are the
schedules of pp >= 2 stages.  With one stage there is nothing to order: each
micro-batch's forward and backward run in turn, one micro-batch alive at a time (GPipe's
order would only hold all k of them for nothing, so --schedule names a pipeline's order).

Gradient accumulation.  A rank that cannot hold the activations of its whole share b of
the global batch splits it into k micro-batches (shard_bounds: sizes within one of each
other where k does not divide b), runs forward and backward on each in turn and lets
autograd add their gradients up in .grad.  Each micro-batch's loss (a mean over its
b_i samples) is scaled by its share b_i / b, so the sum is the gradient of the mean
over all b samples: the step is the one of the unsplit batch, up to the order of float
additions (Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in
1 Hour", on keeping the update a function of the global batch however it is cut).

Communication once per step.  The sync is built knowing the k backwards of a step
(data_parallel's backwards_per_step, sync/buckets.py): a bucket is complete when each
of its parameters' gradients arrived k times, so it leaves during the last backward,
overlapped with it, and a parameter server sees one push:

    micro-batch   batch rows      loss scale   bucket hooks          communication
    1             [0, b_1)        b_1 / b      count arrival 1 of k  none: .grad += g_1
    2             [b_1, b_1+b_2)  b_2 / b      count arrival 2 of k  none: .grad += g_2
    ...
    k             [b - b_k, b)    b_k / b      arrival k: complete   buckets reduced as
                                                                     backward fills them (ps:
                                                                     one push_pull)
    then          sync.synchronize(step), sync.step(optimizer): once, as with k = 1

    memory:  activations of b/k samples at a time instead of b
    time:    k smaller forwards and backwards (less efficient kernels), the same traffic

Why counting, not DDP's no_sync (Li et al. 2020, "PyTorch Distributed", section 3.2.4:
the first k-1 backwards inside a context that silences the hooks): the pipelines must
count, since an interleaved rank's chunks finish their last backwards at different
times, so counting is the one mechanism of every schedule; and under ZeRO-3 a silenced
hook would also silence the release of each layer after its backward (zero.py), so a
rank would hold every layer gathered between micro-batches.  no_sync stays the seam of
a loop of one's own, which does not say k in advance: DistributedOptimizer's
`no_sync()` (its loop is in optimizer.py's docstring).

`--micro-batches k` sets k on every run (`--grad-accum k` is its other name,
config/settings.py).
"""
from contextlib import nullcontext

from allreduce import shard_bounds

from ..runtime.metrics import now
from ..runtime.precision import MixedPrecision


class Accumulation:
    """The schedule of one stage, the shape of Pipeline.run: `run(x, y, step)` runs the
    k micro-batches of (x, y) forward and backward in turn through `forward`.

    forward: what the micro-batches go through (the whole model, the grid's one Stage,
        or a wrapper such as torch's DDP); criterion(out, y): a micro-batch's loss, the
        mean over its samples (the model's own: with one stage the output is the whole
        model's, and a mixture of experts' criterion adds every block's balance loss).
    meter: a memory.ActivationMeter around every forward, or None: the grid's records
        read it, and ZeRO-3 packs its saved parameters through it (zero.py).
    tracer, recompute (recompute.Recompute), precision (precision.MixedPrecision:
        autocast, fp16's scaled backward): optional."""

    peak_in_flight = 1          # micro-batches forwarded but not yet backwarded, at most

    def __init__(self, forward, criterion, k, device, tracer=None, recompute=None,
                 precision=None, meter=None):
        self.forward, self.criterion, self.k = forward, criterion, k
        self.clock = lambda: now(device)
        self.tracer, self.recompute, self.meter = tracer, recompute, meter
        self.precision = precision or MixedPrecision()
        self.micro_batch_bytes = 0      # saved activations of micro-batch 0, measured

    def run(self, x, y, step):
        """Step `step`'s forwards and backwards; returns the loss of the local batch (the
        mean over its samples), detached: a tensor, read after the step's update
        (engine/loop.py), so that no host waits for the GPU before it is queued."""
        precision, meter, tracer, n = self.precision, self.meter, self.tracer, len(x)
        # the spans need the times; a GPU's wait for them does not
        clock = self.clock if tracer else float
        total = 0.0
        for i, (start, stop) in enumerate(shard_bounds(n, self.k)):
            share = (stop - start) / n
            # its own storage, as a loader would give: the meter counts whole storages
            xi = x[start:stop].clone()
            before = meter.live_bytes if meter else 0
            t0 = clock()
            with meter or nullcontext(), precision.autocast():
                loss = self.criterion(self.forward(xi), y[start:stop]) * share
            t1 = clock()
            if meter and i == 0:        # what one micro-batch's saved activations cost
                self.micro_batch_bytes = meter.live_bytes - before
            with self.recompute.backward() if self.recompute else nullcontext():
                precision.backward(loss)          # fp16: of the scaled loss
            t2 = clock()
            total = total + loss.detach()
            if tracer:                  # each micro-batch as lived
                name = f"{step}" if self.k == 1 else f"{step}.{i}"
                tracer.add(f"forward {name}", "forward", t0, t1)
                tracer.add(f"backward {name}", "backward", t1, t2)
        return total
