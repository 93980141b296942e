"""The common training worker: one loop, one model, one data set, any synchronisation.

    python -m strategies.train --sync ring ...     (see train.py for launch commands)
    python -m strategies.bench --syncs ring,ddp    (throughput beside torch DDP)

Read in this order:
    config.py      TrainConfig (frozen, validated) and the --key value command line
    context.py     RunContext: ranks, data-parallel communicator, servers, device
    data.py        synthetic teacher / Markov data, user .npz / text, global-batch sharding
    models.py      MLP and a small GPT
    buckets.py     flat gradient buckets, all-reduced during backward by a comm thread
    compress.py    none / fp16 / bf16 on the wire
    sync.py        GradientSync: local, all-reduce backends, parameter servers, hybrid
    metrics.py     JSON Lines records, progress bar, summary
    checkpoint.py  atomic checkpoints and --resume
    train.py       the loop
    bench.py       interleaved throughput benchmark
"""
