"""Gradient buckets: flat buffers all-reduced while backward is still running.

The teaching ladder (picotron's): the naive data-parallel step all-reduces
every gradient after backward, one call per tensor.  Two improvements, as in
PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020):

1. Bucketing.  Gradients travel in a few flat buffers of at most --bucket-mb
   each, so one collective moves many small tensors at once instead of paying
   a latency each (a tensor bigger than the cap is reduced alone, in place).
2. Overlap.  Backward produces gradients from the last layer to the first.
   Parameters are put in buckets in reverse order, so the bucket of the last
   layers fills first; a post-accumulate-grad hook counts a bucket's ready
   gradients and, when it is full, hands it to a communication thread, which
   all-reduces it while backward computes the earlier layers' gradients.

       backward:  [layer 3 grads][layer 2 grads][layer 1 grads]
       comm:                     [bucket 0 ----][bucket 1 ----][bucket 2]
                                                                ^ exposed

Only the communication still running when backward ends is "exposed" and
costs step time.  Ordering constraint: every rank must issue the same
collectives in the same order, so buckets go to the thread (comm_thread.py) in
index order 0, 1, 2 ..., a bucket that is ready early waiting for the ones
before it (DDP does the same).  --no-overlap reduces the buckets on the main
thread after backward, the same calls in the same order.

One backward per step: a bucket is handed over once its parameters' gradients
arrived, so a second backward before `wait` would add into buffers the thread
may be sending; the hook refuses it.  Except inside `accumulating()` (DDP's
no_sync, used by accumulation.py): there the hooks hand nothing over and
autograd adds each micro-batch's gradients into .grad; the backward after it
sends the sum, one all-reduce per bucket for the whole step.  `wait` re-arms
the buckets, so the next backward works whoever cleared the gradients (a user
loop may call model.zero_grad() or not clear them at all).
"""
from contextlib import contextmanager

import torch

from .comm_thread import CommThread


class Bucket:
    """A run of parameters whose gradients travel as one flat buffer.

    A bucket of one parameter all-reduces that parameter's .grad in place; a
    bucket of several copies each .grad into its slice of `flat` as it arrives
    and points .grad at the slice.  That costs one copy, where keeping .grad a
    view of `flat` for good (DDP's gradient_as_bucket_view) would cost zeroing
    the buffer every step plus autograd's read-add-write into it.
    """

    def __init__(self, index, params, device, wire_dtype):
        self.index = index
        self.params = params
        n = sum(p.numel() for p in params)
        self.alone = len(params) == 1                # reduced in place: no flat buffer
        self.flat = None if self.alone else torch.zeros(n, dtype=torch.float32, device=device)
        self.wire = None if wire_dtype == torch.float32 else \
            torch.empty(n, dtype=wire_dtype, device=device)
        self.views = {}
        self.shapes = [p.shape for p in params]      # the flat layout, for powersgd
        offset = 0
        for p in params if not self.alone else ():
            self.views[p] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.target = self.flat          # what is reduced this step
        self.pending = len(params)
        self.arrived = set()             # parameters whose gradient came this step
        self.event = None

    def rearm(self):
        self.pending = len(self.params)
        self.arrived.clear()

    def take(self, p):
        """p's fresh gradient joins the bucket (called from p's hook)."""
        if self.alone:
            if not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            self.target = p.grad.view(-1)
        else:
            self.views[p].copy_(p.grad)
            p.grad = self.views[p]
            self.target = self.flat

    def fill_missing(self):
        """Parameters that got no gradient in the last backward contribute the one they
        hold (accumulated under no_sync, or left by a loop that did not clear it), or zeros."""
        for p in self.params:
            if p not in self.arrived:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.take(p)


def plan_buckets(params, cap_bytes):
    """Group params (in the order given) into runs of at most cap_bytes of float32;
    a parameter larger than the cap gets a bucket of its own."""
    groups, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * 4
        if current and size + nbytes > cap_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)
    return groups


class GradBuckets:
    """Owns the gradients of `params`; `reduce(flat_tensor)` is the collective
    (in place, averaging over the data-parallel ranks).  `reduce` takes the
    buckets on their device: AllReduceSync gives it a collective made with
    allreduce.host_staged, which carries CUDA buckets through pinned host memory
    where MPI moves them, the one staging of every user of a collective."""

    def __init__(self, params, reduce, cap_bytes, compressor, overlap=True):
        params = [p for p in params if p.requires_grad]
        self.reduce, self.compressor, self.overlap = reduce, compressor, overlap
        device = params[0].device
        ordered = list(reversed(params))             # roughly the order backward makes them
        self.buckets = [Bucket(i, group, device, compressor.wire_dtype)
                        for i, group in enumerate(plan_buckets(ordered, cap_bytes))]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.reductions = 0                          # bucket all-reduces so far
        self._accumulating = False
        # this rank's bytes handed to the collectives, and what float32 all-reduces of
        # the same buckets would have handed over: compression's saving, measured
        self.wire_bytes = self.dense_bytes = 0
        self._next = 0                               # the next bucket to hand to the thread
        self._thread = CommThread() if overlap else None
        self.zero_()

    # ------------------------------------------------------------ per step
    def zero_(self):
        """Before forward: no gradients yet (autograd then hands over fresh ones)."""
        for b in self.buckets:
            b.rearm()
            for p in b.params:
                p.grad = None

    @contextmanager
    def accumulating(self):
        """Backwards inside add into .grad and launch no all-reduce (DDP's no_sync):
        the micro-batches of gradient accumulation before the last one."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _on_grad_ready(self, p):
        # Runs inside backward, once p.grad holds this step's full gradient.
        if self._accumulating:
            return                                   # autograd keeps adding into p.grad
        b = self.bucket_of[p]
        if b.pending < 0 or p in b.arrived:
            raise RuntimeError("a second backward before the gradients of the first were "
                               "synchronised: call step() after each backward (to accumulate "
                               "micro-batches, add their losses and call backward once)")
        b.arrived.add(p)
        b.take(p)
        b.pending -= 1
        if b.pending == 0:
            self._mark_ready(b)

    def _mark_ready(self, b):
        b.pending = -1                               # handed over; not again this step
        if b.target.is_cuda:                         # UNVERIFIED on GPU: the hook runs when
            b.event = torch.cuda.Event()             # the kernel is queued, not finished
            b.event.record()
        # strictly in index order on every rank: bucket i leaves after 0 .. i-1
        while self.overlap and self._next < len(self.buckets) and \
                self.buckets[self._next].pending == -1:
            self._thread.submit(lambda b=self.buckets[self._next]: self._reduce(b))
            self._next += 1

    def wait(self):
        """After backward: finish every bucket's all-reduce; grads are then averaged."""
        for b in self.buckets:                       # parameters that got no gradient
            if b.pending >= 0:
                b.fill_missing()
                self._mark_ready(b)
        try:
            if self.overlap:
                self._thread.flush()                 # raises a reduction's error here
            else:
                for b in self.buckets:
                    self._reduce(b)
        finally:
            for b in self.buckets:                   # ready for the next backward
                b.rearm()
            self._next = 0

    # -------------------------------------------------- communication side
    def _reduce(self, b):
        if b.event is not None:
            b.event.synchronize()
        self.reductions += 1
        self.wire_bytes += self.compressor.reduce_bucket(b.index, b.target, b.wire, b.shapes,
                                                         self.reduce)
        self.dense_bytes += b.target.numel() * 4

    def close(self):
        for h in self._hooks:
            h.remove()
        if self._thread is not None:
            self._thread.close()
