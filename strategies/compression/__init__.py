"""What travels on the wire instead of float32 gradients (--compress).

    casts.py          the Compressor interface; none / fp16 / bf16 casts
    error_feedback.py residuals per rank: what a lossy compression dropped comes next step
    skipped_step.py   fp16: a skipped step's state put back, the state following the scale
    topk.py           top-k sparsification over an all-gather (DGC's momentum correction)
    powersgd.py       PowerSGD: low-rank factors P, Q all-reduced, warm-started
    fp8.py            e4m3 bytes and a scale per bucket, all-gathered, summed in float32

A compressor reduces one flat bucket through a collective it is handed; the buckets
and ZeRO's layers (sync/buckets.py, sync/zero.py) decide when.
"""
