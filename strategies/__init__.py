"""The common training worker: one loop, one model, one data set, any synchronisation.

    opt = strategies.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model,
                                          sync="ring")   # your model, your loop (engine/optimizer.py)
    python -m strategies.train --sync ring ...     (see train.py for launch commands)
    python -m strategies.bench --syncs ring,ddp    (throughput beside torch DDP)
    python -m strategies.train --sync ring --pp 2 --tp 2 --zero 1 ...   (under mpiexec -n 4)

Its layers, lowest first; each subpackage imports only from those before it
(tests/test_imports.py checks), and its __init__ lists its files:
    config/       what a run is asked to do: TrainConfig, the flag checks, the mesh
    model/        the MLP, the GPT, mixture of experts, the data
    runtime/      where this rank sits (RunContext), precision, trace, records, checkpoints
    compression/  what goes on the wire: casts, top-k, PowerSGD, error feedback
    sync/         data parallelism, one contract: buckets, the comm thread, ZeRO, servers
    parallel/     the splits of a model: tensor, sequence, pipeline, experts, recompute
    engine/       parallelize (the splits in one order), the one step engine and the loop;
                  DistributedOptimizer for your own loop
and the commands on top:
    train.py              the command line: preflight, then the one step engine
    bench.py              interleaved throughput benchmark, beside torch DDP
    bench_parallel.py     ZeRO memory and traffic, pipeline bubbles, overlap, ZeRO-3 speed
    compatibility.py      which techniques combine: the table in docs/training.md
    example_user_model.py a complete run of DistributedOptimizer on a CNN of its own
docs/architecture.md follows one gradient through them, file by file.
"""

__all__ = ["DistributedOptimizer", "ps_roles", "SyncOptions"]


def __getattr__(name):
    # Imported on first use: `import strategies` (or of choices.py, which imports nothing)
    # does not cost an `import torch`, which takes seconds.  strategies.config.settings does pay it,
    # through the allreduce package it reads its flag helpers from.
    if name in ("DistributedOptimizer", "ps_roles"):
        from .engine import optimizer
        return getattr(optimizer, name)
    if name == "SyncOptions":
        from .config.sections import SyncOptions
        return SyncOptions
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
