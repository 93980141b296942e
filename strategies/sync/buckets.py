"""Gradient buckets: flat buffers reduced while backward is still running.

This is the one engine of data parallelism: plain data parallelism and ZeRO
(zero.py) both hand their gradients to it, and differ only in what a bucket's
collective is (an all-reduce, or a reduce-scatter into this rank's shard).

The teaching ladder (picotron's): the naive data-parallel step all-reduces
every gradient after backward, one call per tensor.  Two improvements, as in
PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020):

1. Bucketing.  Gradients travel in a few flat buffers of at most --bucket-mb
   each, so one collective moves many small tensors at once instead of paying
   a latency each.  A bucket holds whole layers (a layer bigger than the cap
   gets a bucket of its own), all of one dtype and one set of replicas, as
   Megatron-LM's gradient buffer cuts its buckets.
2. Overlap.  Backward produces gradients from the last layer to the first.
   Layers are put in buckets in reverse order, so the bucket of the last
   layers fills first; a post-accumulate-grad hook counts a bucket's ready
   gradients and, when it is full, hands it to a communication thread, which
   reduces it while backward computes the earlier layers' gradients.

       backward:  [layer 3 grads][layer 2 grads][layer 1 grads]
       comm:                     [bucket 0 ----][bucket 1 ----][bucket 2]
                                                                ^ exposed

Only the communication still running when backward ends is "exposed" and
costs step time.  Ordering constraint: every rank must issue the same
collectives in the same order, so buckets go to the thread (comm_thread.py) in
index order 0, 1, 2 ..., a bucket that is ready early waiting for the ones
before it (DDP does the same).  --no-overlap reduces each bucket on the main
thread, inside the hook, in the same order: backward waits for it.

Micro-batches.  Every schedule of strategies.train (a pipeline's, and the one
stage's of engine/accumulation.py) runs m backwards a step (backwards_per_step): a
bucket is complete when each of its parameters' gradients arrived m times,
autograd adding them up in between.  A loop of one's own, which does not say m in
advance, uses `accumulating()` instead (DDP's no_sync, DistributedOptimizer's): its
hooks count nothing, and the backward after it sends the sum.  A second backward beyond
those, before `wait`, would add into buffers the thread may be sending; the
hook refuses it.  `wait` re-arms the buckets, so the next backward works
whoever cleared the gradients (a user loop may call model.zero_grad() or not
clear them at all).
"""
from contextlib import contextmanager
from typing import NamedTuple

import torch

from allreduce import shard_of

from .comm_thread import CommThread


class Replicas:
    """The ranks that hold replicas of a layer, over which its gradient is averaged (and,
    under ZeRO, its state sharded): the dp axis, or (expert parallelism) an expert's
    replicas.

    coll: an allreduce/ collective over them; thread_coll: another over a duplicate of
    its communicator, for the comm thread where the main thread talks on the first
    meanwhile (None: the same); scale: a factor after the average (an expert's gradient,
    summed over the tokens of its expert group by autograd, is averaged over the world,
    not its replicas); place: how the parameter servers' keys name these replicas
    ("ep1": an expert's at place 1 of its expert group; "": the dp axis)."""

    def __init__(self, coll, thread_coll=None, scale=1.0, place=""):
        self.coll, self.thread_coll, self.scale = coll, thread_coll or coll, scale
        self.rank, self.size, self.place = coll.rank, coll.size, place


class OneRank:
    """The replicas of a bucket with none to talk to: the whole buffer is this rank's."""
    rank, size, scale, coll, thread_coll, place = 0, 1, 1.0, None, None, ""


class Layer(NamedTuple):
    """A unit that is never cut between buckets: its name, module (None for a lone
    parameter), parameters, and replicas (None: the engine's default)."""
    name: str
    module: object
    params: list
    replicas: object = None


class Bucket:
    """A run of whole layers whose gradients travel as one flat buffer.

    keep_flat (plain data parallelism, ZeRO 1): the bucket owns a persistent flat
    gradient; each .grad is copied into its slice as it arrives and pointed at it,
    one copy, where keeping .grad a view for good (DDP's gradient_as_bucket_view)
    would cost zeroing the buffer every step plus autograd's read-add-write.  A
    bucket of one parameter reduces that .grad in place.  Without it (ZeRO 2, 3),
    the gradients are concatenated when the bucket is complete and let go at once:
    only the shard the reduce-scatter returns is kept.
    """

    def __init__(self, index, layers, replicas, wire_dtype, keep_flat=True):
        self.index, self.layers, self.replicas = index, layers, replicas
        self.name = layers[0].name if len(layers) == 1 else \
            f"{layers[-1].name}..{layers[0].name}"
        self.params = [p for layer in layers for p in layer.params]
        self.shapes = [p.shape for p in self.params]     # the flat layout, for powersgd
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self.start, self.stop = shard_of(replicas.rank, self.numel, replicas.size)
        self.device = self.params[0].device
        self.keep_flat, self.wire_dtype = keep_flat, wire_dtype
        self.alone = keep_flat and len(self.params) == 1
        # allocated at the first gradient, in its dtype: ZeRO may rebind the parameters
        # to a 16-bit buffer after the buckets are planned
        self.flat = self.wire = None
        self.views = {}
        self.target = self.flat          # what is reduced this step
        self.arrivals = {}               # parameter -> backwards whose gradient came
        self.count = 0                   # gradients arrived this step, all parameters
        self.complete = False            # handed over this step
        self.event = None

    def rearm(self):
        self.arrivals.clear()
        self.count = 0
        self.complete = False

    def take(self, p):
        """p's gradient joins the bucket (from p's hook; again after each micro-batch)."""
        if not self.keep_flat:
            return                       # concatenated when the bucket is complete
        if self.alone:
            if not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            self.target = p.grad.view(-1)
        else:
            if self.flat is None or self.flat.dtype != p.grad.dtype:
                self._allocate(p.grad.dtype)
            if p.grad is self.views[p]:
                return                   # already in place (a later micro-batch, or kept)
            self.views[p].copy_(p.grad)
            p.grad = self.views[p]       # later micro-batches add into the slice itself

    def _allocate(self, dtype):
        self.flat = torch.zeros(self.numel, dtype=dtype, device=self.device)
        self.wire = None if self.wire_dtype in (torch.float32, dtype) else \
            torch.empty(self.numel, dtype=self.wire_dtype, device=self.device)
        self.views, offset = {}, 0
        for p, shape, n in zip(self.params, self.shapes, self.sizes):
            self.views[p] = self.flat[offset:offset + n].view(shape)
            offset += n
        self.target = self.flat

    def gradient(self):
        """The flat gradient to reduce, once complete."""
        if self.keep_flat:
            return self.target
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        for p in self.params:
            p.grad = None                # ZeRO 2, 3: only the reduced shard is kept
        return flat

    def fill_missing(self):
        """Parameters that got no gradient in the last backward contribute the one they
        hold (accumulated under no_sync, or left by a loop that did not clear it), or zeros."""
        for p, shape in zip(self.params, self.shapes):
            if p not in self.arrivals:
                if p.grad is None:       # (the shape kept: ZeRO 3 may hold no data now)
                    p.grad = torch.zeros(shape, dtype=p.dtype, device=self.device)
                self.take(p)


def plan_buckets(layers, cap_bytes):
    """Runs of consecutive layers (in the order given; a bare parameter is a layer of its
    own), each at most cap_bytes, of one dtype and one set of replicas; a layer larger
    than the cap gets a bucket of its own, and cap_bytes 0 gives every layer its own."""
    groups, current, size = [], [], 0
    for item in layers:
        layer = item if isinstance(item, Layer) else Layer("", None, [item])
        nbytes = sum(p.numel() * p.element_size() for p in layer.params)
        if current and (size + nbytes > cap_bytes or layer.replicas is not current[0][1].replicas
                        or layer.params[0].dtype != current[0][1].params[0].dtype):
            groups.append([i for i, _ in current])
            current, size = [], 0
        current.append((item, layer))
        size += nbytes
    if current:
        groups.append([i for i, _ in current])
    return groups


def as_layers(params_or_layers, replicas):
    """Layers, each with its replicas: a bare parameter is a layer of its own."""
    return [Layer(x.name, x.module, x.params, x.replicas or replicas) if isinstance(x, Layer)
            else Layer(f"param {i}", None, [x], replicas)
            for i, x in enumerate(params_or_layers)]


class GradBuckets:
    """Owns the gradients of `layers` (parameters, or Layer tuples in forward order).

    reduce_bucket(bucket, flat) -> the bytes this rank handed to the collectives: the
    bucket's collective, which its owner chooses (zero.py: an all-reduce at stage 0, a
    reduce-scatter into this rank's shard at 1-3, through the compressor).  CUDA
    buckets reach it on their device: their collectives are made with
    allreduce.host_staged, which carries them through pinned host memory where MPI
    moves them, the one staging of every user of a collective.
    after_backward(bucket): called each time one backward completed the bucket's
    gradients (ZeRO 3 frees the layer's parameters there)."""

    def __init__(self, layers, reduce_bucket, cap_bytes, compressor, overlap=True, *,
                 replicas=None, keep_flat=True, backwards_per_step=1, after_backward=None,
                 name="grad-comm"):
        layers = [layer for layer in as_layers(layers, replicas or OneRank())
                  if any(p.requires_grad for p in layer.params)]
        layers = [layer._replace(params=[p for p in layer.params if p.requires_grad])
                  for layer in layers]
        self.reduce_bucket, self.compressor, self.overlap = reduce_bucket, compressor, overlap
        self.backwards_per_step, self.after_backward = backwards_per_step, after_backward
        ordered = list(reversed(layers))             # roughly the order backward makes them
        self.buckets = [Bucket(i, group, group[0].replicas, compressor.wire_dtype, keep_flat)
                        for i, group in enumerate(plan_buckets(ordered, cap_bytes))]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in self.buckets for p in b.params]
        self.reductions = 0                          # bucket collectives so far
        self._accumulating = False
        # this rank's bytes handed to the collectives, and what float32 all-reduces of
        # the same buckets would have handed over: compression's saving, measured
        self.wire_bytes = self.dense_bytes = 0
        self._next = 0                               # the next bucket to hand over
        self._thread = CommThread(name) if overlap else None
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
        """Backwards inside add into .grad and launch no collective (DDP's no_sync):
        the micro-batches of gradient accumulation before the last one."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _on_grad_ready(self, p):
        # Runs inside backward, once p.grad holds this backward's full gradient.
        if self._accumulating:
            return                                   # autograd keeps adding into p.grad
        b = self.bucket_of[p]
        seen = b.arrivals.get(p, 0) + 1
        if b.complete or seen > self.backwards_per_step:
            raise RuntimeError("a second backward before the gradients of the first were "
                               "synchronised: call step() after each backward (to accumulate "
                               "micro-batches, add their losses and call backward once)")
        b.arrivals[p] = seen
        b.take(p)
        b.count += 1
        if b.count == len(b.params) * self.backwards_per_step:
            self._mark_complete(b)
        if self.after_backward is not None and b.count % len(b.params) == 0:
            self.after_backward(b)                   # one backward through the bucket done

    def _mark_complete(self, b):
        b.complete = True                            # handed over; not again this step
        # strictly in index order on every rank: bucket i leaves after 0 .. i-1
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            bucket = self.buckets[self._next]
            flat = bucket.gradient()
            # recorded after the flat gradient is made: without keep_flat that is a
            # concatenation queued here, which the thread's stream must wait for too
            bucket.event = self._ready(bucket)
            if self.overlap:               # on a GPU the thread's stream waits for the event
                self._thread.submit(lambda b=bucket, flat=flat: self._reduce(b, flat),
                                    after=bucket.event)
            else:
                self._reduce(bucket, flat)
            self._next += 1

    @staticmethod
    def _ready(bucket):
        """A CUDA event after the kernels queued so far on the current stream, None on a
        CPU.  A hook runs when backward's kernels are queued, not finished (comm_thread.py)."""
        if bucket.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self):
        """After backward: finish every bucket's collective; grads are then reduced."""
        try:
            for b in self.buckets:                   # parameters that got no gradient
                if not b.complete:
                    b.fill_missing()
                    self._mark_complete(b)
            if self.overlap:
                self._thread.flush()                 # raises a reduction's error here
        finally:
            for b in self.buckets:                   # ready for the next backward
                b.rearm()
            self._next = 0

    # -------------------------------------------------- communication side
    def _reduce(self, b, flat):
        # no host wait for the bucket's event: the collective's device work (staging's
        # copy down, NCCL) orders itself after the current stream, the thread's (which
        # waits for the event) or, without overlap, the one that made the gradients
        self.reductions += 1
        self.wire_bytes += self.reduce_bucket(b, flat)
        self.dense_bytes += b.numel * 4

    def close(self):
        for h in self._hooks:
            h.remove()
        if self._thread is not None:
            self._thread.close()
