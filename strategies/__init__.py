"""The common training worker: one loop, one model, one data set, any synchronisation.

    opt = strategies.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model,
                                          sync="ring")   # your model, your loop (optimizer.py)
    python -m strategies.train --sync ring ...     (see train.py for launch commands)
    python -m strategies.bench --syncs ring,ddp    (throughput beside torch DDP)
    python -m strategies.train --sync ring --pp 2 --tp 2 --zero 1 ...   (under mpiexec -n 4)

Read in this order:
    choices.py     ConfigError and the values of each choice flag (imports nothing)
    config.py      TrainConfig (frozen, validated) and the --key value command line
    combinations.py  which flags go together; the sync checks SyncOptions shares
    context.py     RunContext: ranks, data-parallel communicator, servers (psrv decides), device
    data.py        synthetic teacher / Markov data, user .npz / text, global-batch sharding
    models.py      MLP, a small GPT, and the GPT with mixture-of-experts MLPs
    moe.py         the MoE layer: top-1/top-2 gating, expert capacity per group, balance loss
    buckets.py     flat gradient buckets, all-reduced during backward by a comm thread
    compress.py    none / fp16 / bf16 on the wire
    precision.py   --precision bf16 / fp16: autocast, fp32 master weights, loss scaling
    compressor.py  the --compress spec (topk:RATIO, powersgd:RANK) and its refusals
    error_feedback.py  residuals per rank: what compression did not send comes next step
    topk.py        top-k sparsification over an all-gather (DGC's momentum correction)
    powersgd.py    PowerSGD: low-rank factors P, Q all-reduced, warm-started
    sync.py        the sync contract (GradientSync); local and the all-reduce backends
    ps_sync.py     parameter servers, and hybrid (all-reduce in a node, servers between)
    optimizer.py   DistributedOptimizer: builds every sync, for a loop of the user's own
    optimizer_checks.py  its argument checks (model, comm, server settings)
    accumulation.py  --grad-accum: k micro-steps, communication once (sync.no_sync)
    recompute.py   --recompute: each block's forward re-run in backward (checkpointing)
    example_user_model.py  a complete run of it on a small CNN of its own
    metrics.py     JSON Lines records, progress bar, summary
    checkpoint.py  atomic checkpoints and --resume; --sync ps: sets of one step
    stopping.py    SIGINT/SIGTERM under --sync ps: the workers stop at one agreed step
    loop.py        the training loop, once, over a step engine; the data-parallel engine
    train.py       the command line: preflight, then the engine the flags ask for
    expert_parallel.py  --ep: experts split over ranks, tokens moved by all-to-alls
    bench.py       interleaved throughput benchmark
  the dp x pp x tp grid (train.py hands over with --dp/--pp/--tp/--zero/--micro-batches):
    mesh.py        Mesh: arange(world).reshape(dp, pp, tp), ep cut out of dp, a
                   communicator per axis
    zero.py        ZeRO stages 0-3 over the dp axis, layer by layer
    tensor_parallel.py  Megatron's f and g, column/row-parallel linears, split heads
    sequence_parallel.py  LayerNorms and residuals on T/tp positions (--sequence-parallel)
    pipeline.py    stages of blocks; GPipe and 1F1B over the point-to-point transport
    interleaved.py  interleaved 1F1B: v chunks of layers a rank (--virtual-stages)
    bubble.py      the pipeline formulas: bubble fractions, activations in flight
    memory.py      params / grads / optimizer / saved-activation bytes, measured
    trace.py       Chrome trace (Perfetto) of forward, backward, comm and idle time
    parallel.py    the grid's step engine: builds the rank's share, runs the step
    bench_parallel.py  ZeRO memory and traffic, pipeline bubbles, ZeRO-3 speed
"""

__all__ = ["DistributedOptimizer", "ps_roles", "SyncOptions"]


def __getattr__(name):
    # Imported on first use: `import strategies` (or of choices.py, which imports nothing)
    # does not cost an `import torch`, which takes seconds.  strategies.config does pay it,
    # through the allreduce package it reads its flag helpers from.
    if name in ("DistributedOptimizer", "ps_roles"):
        from . import optimizer
        return getattr(optimizer, name)
    if name == "SyncOptions":
        from .sync import SyncOptions
        return SyncOptions
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
