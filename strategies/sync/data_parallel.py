"""The one data-parallel call: every run's gradients meet through it.

    sync = data_parallel(units, comms, cfg, device=device)     # collective over comms
    optimizer = sync.make_optimizer(model)
    ... each step: sync.before_backward(), backward, sync.synchronize(s), sync.step(optimizer)

`units` are what the caller hands over, [(name, module, [parameters])] in forward order
(with a fourth element where a layer has replicas of its own: an expert's):

    strategies.train on a grid      this rank's layers: its pipeline stage, its tp piece
    strategies.train, --ep / MoE    the dense layers and this rank's experts
    a whole model                   its parameters one by one (parameter_units):
                                    strategies.train without a split, DistributedOptimizer

It always builds the one bucket engine (buckets.py) over them, and the sync section of
the config (--sync, --zero) chooses what a bucket's reduction is:

    --sync                   --zero   a bucket's reduction                     built by
    local                     -       none: one process, the reference          LocalSync
    ring, tree, halving_      0       all-reduce (average)                      zero.py
    doubling, hierarchical,   1-3     reduce-scatter (average), the shards'     zero.py
    mpi, torch, auto                  all-gather after the step
    ps                        -       push the bucket, pull its new values     server_buckets.py
    hybrid                    -       the ring inside the node, then the node  server_buckets.py
                                      leader's push and pull

Megatron-LM's DistributedDataParallel has the same shape: one bucketed gradient buffer
(param_and_grad_buffer.py) whatever the reduction, its distributed optimizer a choice of
reduce-scatter for all-reduce; BytePS puts its servers behind the same per-bucket hook.
A new sync is one more row: a bucket's reduction in a file of its own, chosen here.

Precision (runtime/precision.py): `precision` given, the buckets keep 16-bit values and
fp32 master weights (ZeRO's setting: the grid), and the sync unscales and skips an
fp16 overflow itself (`scales_itself`); None, the parameters stay fp32 under autocast
(a whole model, the experts) and the loop unscales the reduced gradients.  Either way
a bucket is reduced in the precision its gradients have, through --compress.
"""
from ..config.choices import PS_SYNCS
from .gradient_sync import LocalSync, build_compressor, collective_for
from .server_buckets import ServerBuckets
from .zero import ZeRO


def parameter_units(model):
    """A whole model's parameters, each a unit of its own: DDP's view of a model, and
    the finest buckets --bucket-mb can cut."""
    return [(name, None, [p]) for name, p in model.named_parameters()]


def data_parallel(units, comms, cfg, *, device, tracer=None, precision=None, agree=None,
                  backwards_per_step=1, role=None, host="", coll=None):
    """This rank's sync of `units` (the module docstring).  Collective over comms.

    comms: the run's mesh.MeshComms over the workers (its dp_cp axis is the replicas);
    None where `coll`, a collective over the replicas, is given instead (a user's loop:
    DistributedOptimizer).  agree: fp16's overflow vote where the
    ranks hold different gradients at the check (a split model, the experts);
    backwards_per_step: how many backwards fill a bucket in a step (the schedule's
    micro-batches; 1 in a loop of one's own, whose no_sync holds the others back).  role, host: ps and
    hybrid's psrv.launch Role and this rank's host name (the hybrid's nodes)."""
    if cfg.sync == "local":
        return LocalSync(cfg, None, device)
    if cfg.sync in PS_SYNCS:
        return ServerBuckets(units, comms, role, cfg, backwards_per_step, tracer, device,
                             collective_for, host, precision)
    # over the replicas of the parameters: the dp axis, times cp where context
    # parallelism cuts each replica's sequences (its ranks hold the same parameters)
    coll = coll or collective_for(cfg.sync, cfg, comms.dp_cp, device=device)
    # the comm thread's collective: over a duplicate of that communicator where the
    # main thread talks on it meanwhile (ZeRO-3's gathers, the grid); a user's loop
    # talks on neither during backward, so its one collective serves both
    thread = None if not cfg.overlap else \
        coll if comms is None else collective_for(cfg.sync, cfg, comms.dp_cp.Dup(),
                                                  device=device)
    compressor = build_compressor(cfg.compress, thread or coll, cfg.error_feedback,
                                  cfg.compressor_momentum, cfg.sparsity_warmup)
    return ZeRO(cfg.zero, units, coll, cfg, backwards_per_step, tracer, precision,
                agree=agree, thread_coll=thread, compressor=compressor, overlap=cfg.overlap,
                device=device)
