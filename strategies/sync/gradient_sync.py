"""GradientSync: the one contract between a training loop and every synchronisation.

    sync.setup(model)                  once: the replicas start equal (rank 0's weights,
                                       or the parameter servers'); hooks attached
    each step s:
        sync.before_backward()         fresh (zero) gradients
        with sync.no_sync():           optional, gradient accumulation in a loop of one's
            loss_i.backward()          own (optimizer.py): micro-batches whose gradients
                                       only add up locally
        loss.backward()                all-reduce syncs may already communicate here
        sync.synchronize(s)            every replica's gradients of step s are combined
        sync.step(optimizer)           the update: afterwards every replica holds the
                                       parameters of step s + 1
    sync.state_dict() / sync.load_state_dict(state)   its own part of a checkpoint
    sync.abort(error)                  only if the loop failed; close() follows
    sync.close()

The class docstring of GradientSync says what each call promises; its defaults
are those of one process training alone.  Every run builds its sync through one
call, data_parallel.py's data_parallel (strategies.train's parallelize for every
split, DistributedOptimizer for a user's own loop), over the one bucket engine
(buckets.py).  Implementations:
  LocalSync       one process, nothing to do: the reference the others must reproduce.
  ZeRO            ring, tree, halving_doubling, hierarchical, mpi, torch, auto
                  (allreduce/): stage 0 all-reduces each bucket (plain data
                  parallelism), stages 1-3 reduce-scatter it and shard the state (zero.py)
  ServerBuckets   ps: each bucket pushed to the parameter servers (psrv/), which average
                  the workers' gradients and run the optimizer, its new values pulled;
                  hybrid: the ring inside a node first, then the node leader's push and
                  pull, broadcast in the node (server_buckets.py)

Every data-parallel rank computes the mean loss over its B/P samples, and the
syncs average over P ranks, so the update is the one of the mean over all B
samples: exactly one process's update, up to the order of float additions.

A sync reads its settings from `cfg`, a TrainConfig: its SyncOptions section (and,
under ps, its OptimizerOptions, which the servers run), for strategies.train's loop,
ZeRO and --ep alike; DistributedOptimizer makes one of its keywords' sections
(TrainConfig.of), so a user's loop hands the syncs the same object.
"""
from contextlib import contextmanager

import torch

import allreduce
from allreduce.buffers import TORCH_DTYPES

from ..compression.casts import make_compressor
from ..compression.fp8 import Fp8Compressor
from ..compression.powersgd import PowerSGDCompressor
from ..compression.topk import TopKCompressor
from ..config.choices import EMULATED_SYNCS
from ..config.compress_spec import parse_compress


def build_compressor(compress, coll=None, error_feedback=True, momentum=0.0, warmup=0):
    """The compressor of a --compress spec: compression/casts.py's casts, topk.py,
    powersgd.py, fp8.py.
    `coll`: the collective top-k all-gathers over; `momentum`: top-k's momentum
    correction (0: none); `warmup`: top-k's --sparsity-warmup steps (0: none)."""
    spec = parse_compress(compress)
    if spec.kind == "topk":
        return TopKCompressor(spec.ratio, coll, error_feedback, momentum, warmup)
    if spec.kind == "powersgd":
        return PowerSGDCompressor(spec.rank, error_feedback)
    if spec.kind == "fp8":
        return Fp8Compressor(coll, error_feedback)
    return make_compressor(spec.kind)


def total(counts):
    """A sum of byte counts; None (not observable) if any of them is."""
    counts = list(counts)
    return None if None in counts else sum(counts)


def torch_optimizer(cfg, params):
    """The torch optimizer of cfg's OptimizerOptions (what a user would wrap); fused
    where every parameter is on a GPU (fused_fits)."""
    params = list(params)
    fused = fused_fits(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def fused_fits(params):
    """Whether the optimizer steps all `params` in one fused kernel: on a GPU, where
    each tensor of the step would otherwise be a kernel launch of its own, and where
    fp16's overflow flag goes to the kernel, which skips the step itself
    (runtime/loss_scaling.SkipWhereFound) instead of a copy and a mask per tensor.
    None (torch's default) elsewhere: the CPU's step stays the reference's."""
    on_gpu = bool(params) and all(p.device.type == "cuda" and p.is_floating_point()
                                  for p in params)
    return True if on_gpu else None


def make_optimizer(cfg, params):
    """The optimizer a sync steps with: torch_optimizer, without its momentum under
    --momentum-correction (the compressor holds it)."""
    optimizer = torch_optimizer(cfg, params)
    return without_momentum(optimizer) if cfg.momentum_correction else optimizer


def without_momentum(optimizer):
    """DGC's momentum correction (compression/topk.py): the velocity moves into the
    compressor, kept per rank before top-k, and the SGD steps without it."""
    for group in optimizer.param_groups:
        group["momentum"] = 0.0
    return optimizer


class GradientSync:
    """How data-parallel replicas combine their gradients: the calls a loop makes, in order.

    setup(model)         Once, before the first step, on every replica: afterwards every
                         replica holds the same parameters (rank 0's, or the servers' after
                         a resume) and `start_step` says which step comes next.
    before_backward()    Before each backward: the gradients start from zero.
    no_sync()            A context: backwards inside it only add into the local gradients
                         and communicate nothing (DDP's no_sync); the backward after it,
                         outside, carries the sum.  Gradient accumulation in a loop of
                         one's own; strategies.train's schedules build the sync for their
                         k backwards instead (backwards_per_step, accumulation.py).
    synchronize(step)    After backward: waits until the gradients of `step` of every
                         replica are combined (averaged into .grad; ps: sent to the servers,
                         whose new parameters have come back but are not in the model yet).
                         The model's parameters do not change here.
    step(optimizer)      The update, and the only call that changes the parameters: the
                         optimizer's step on the averaged gradients, or (ps, hybrid) the
                         servers' new parameters copied into the model.
    state_dict()         This sync's own part of a checkpoint, beside the model's and the
                         optimizer's ({} where those two are the whole state);
    load_state_dict(s)   and its check on resuming, after setup.
    abort(error)         The loop failed with `error`; close() follows.
    close()              Hooks detached, threads stopped, peers told; idempotent.

    Read-only figures: name, bytes_sent and bytes_received (this rank's traffic so far;
    None where a library's traffic is not observable), wire_bytes and dense_bytes
    (the gradient bytes handed to the collectives or pushed to the servers so far,
    compressed, and what float32 would have been; None for local), kept_ratio (top-k: the fraction
    of each bucket the last step sent; None elsewhere), staleness (ps: how many steps old
    the parameters of the last step were; None elsewhere), start_step, comm_rounds
    (the collectives or server round trips this rank has made so far), signal_stop
    (whether the loop may end a run on SIGINT/SIGTERM at a step the workers agree on:
    only where every wait inside a step runs Python's signal handlers, stopping.py).
    """
    name = "?"
    staleness = None
    start_step = 0               # ps / hybrid: where the servers resumed
    bytes_sent = bytes_received = 0
    comm_rounds = 0
    wire_bytes = dense_bytes = None    # all-reduce syncs: bytes handed to the collectives
    kept_ratio = None                  # top-k: the fraction of each bucket sent
    signal_stop = False                # ps: a signal ends the run at an agreed step
    # fp16's overflow vote, agree(found) -> found on any rank (precision.py), where the
    # ranks hold different gradients at the check (ps: each its own, pushed after it);
    # None where every rank holds the same averaged gradients
    agree = None
    # fp16 with a lossy compressor: its state of the step's start, put back where the
    # vote skips the step (compression/skipped_step.py's KeptState); None elsewhere
    kept = None
    # whether step unscales fp16's gradients and skips an overflow itself (16-bit
    # buffers, the servers' deferred pushes); else the loop does (precision.step)
    scales_itself = False

    def __init__(self, cfg, ctx, device):
        self.cfg, self.ctx, self.device = cfg, ctx, device

    def setup(self, model):
        self.model = model
        # walked twice a step: a module tree's parameters() costs ~0.1 ms of Python
        # for a small GPT, time a GPU's queue would otherwise wait for
        self.params = list(model.parameters())

    def make_optimizer(self, model):
        """The torch optimizer that `step` takes, as cfg describes it."""
        return make_optimizer(self.cfg, model.parameters())

    def before_backward(self):
        for p in self.params:
            p.grad = None

    @contextmanager
    def no_sync(self):
        """The default, right wherever nothing is sent before synchronize (local, the
        parameter servers: autograd adds every micro-batch into .grad, pushed once)."""
        yield

    def synchronize(self, step):
        pass

    def gradients(self):
        """The synchronised gradients the optimizer steps on, after synchronize: what
        fp16's overflow check reads (precision.py)."""
        return [p.grad for p in self.params]

    def step(self, optimizer):
        optimizer.step()

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def abort(self, error):
        """Parameter servers are told of a crash here, so that they do not wait for
        this worker; nothing to tell elsewhere."""

    def close(self):
        pass


class LocalSync(GradientSync):
    name = "local"


def collective_for(name, cfg, comm, transport=None, device=None):
    """An allreduce/ collective over `comm` (None: COMM_WORLD, or torchrun's world);
    transport None is allreduce's default for `name` (MPI, torch.distributed for torch).
    `device`: where the tensors it will be handed live (for_device); None: the host."""
    options = {}
    if name in ("hierarchical", "auto") and cfg.ranks_per_node:
        options["ranks_per_node"] = cfg.ranks_per_node
    if name in EMULATED_SYNCS:                     # a slower network, if asked for
        options.update(link_latency_us=cfg.link_latency_us, link_gbps=cfg.link_gbps or None)
    return for_device(allreduce.create(name, comm=comm, transport=transport,
                                       timeout=cfg.timeout, device=device, **options), device)


def for_device(coll, device):
    """`coll` (a collective, or a point-to-point transport) as `device`'s tensors need
    it.  On a GPU, where its transport moves host memory only (MPI without
    CUDA-awareness): device to device between ranks that share the GPU
    (allreduce/cuda_ipc.py: made by collective_for, or here for a pipeline's
    transport), through pinned host memory otherwise (allreduce.host_staged:
    HostStaged, or HostStagedTransport for a pipeline's messages); NCCL and a
    CUDA-aware MPI take CUDA tensors as they are.  The one place a worker decides it:
    every collective of the grid, of the experts and of plain data parallelism, and
    the pipeline's transport."""
    return allreduce.host_staged(coll, device) if device is not None and device.type == "cuda" \
        else coll


def broadcast_tensor(coll, t):
    """t (a tensor, no autograd) := rank 0's t.  The collectives take a few dtypes and
    contiguous memory only; anything else travels through a copy that they take
    and exact for its values (int64 for bool and small integers, float64 for float8)."""
    if t.numel() == 0:
        return
    if t.is_complex():
        t = torch.view_as_real(t)                  # a view: its pairs of reals are t's memory
    if t.dtype in TORCH_DTYPES and t.is_contiguous():
        coll.broadcast(t, root=0)
        return
    wire = t.dtype if t.dtype in TORCH_DTYPES else \
        torch.float64 if t.is_floating_point() else torch.int64
    staged = t.to(wire).contiguous()
    coll.broadcast(staged, root=0)
    t.copy_(staged)


def broadcast_buffers(coll, module):
    """Rank 0's buffers on every rank, as DDP does at construction (the bucket
    engine broadcasts the parameters, a bucket at a time)."""
    with torch.no_grad():
        for t in module.buffers():
            broadcast_tensor(coll, t.data)
