"""What every layer of a running worker shares: where this rank sits, its numbers,
what it records.

    context.py     RunContext: ranks, the mesh's communicators, servers (psrv decides), device
    precision.py   --precision bf16 / fp16: autocast, fp32 master weights, loss scaling
    fp8_formats.py e4m3 / e5m2: largest values, scale from amax, saturating cast (fp8's one home)
    fp8_linear.py  --precision fp8: the linear layers' matmuls in e4m3 / e5m2 (_scaled_mm)
    loss_scaling.py  fp16's dynamic loss scale, on the host or as tensors on the GPU
    trace.py       Chrome trace (Perfetto) of forward, backward, communication and idle time
    metrics.py     JSON Lines records, progress bar, summary
    memory.py      params / grads / optimizer / saved-activation bytes, measured
    checkpoint/    atomic per-rank checkpoints, --sync ps's sets of one step, --resume
    waits.py       the control waits (records, barriers), each bounded by --timeout
    exits.py       an exit every rank takes together finalizes MPI instead of aborting

Above config/ and model/ (a checkpoint names the model it holds).
"""
