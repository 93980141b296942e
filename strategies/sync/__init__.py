"""Data parallelism's gradient synchronisation: one contract, every backend.

    gradient_sync.py  GradientSync (the contract), the local sync, collectives and compressors
    data_parallel.py  the one data-parallel call: the bucket engine over a rank's units,
                      the --sync choosing what a bucket's reduction is
    buckets.py        flat gradient buckets, reduced during backward
    comm_thread.py    the one communication thread that buckets and ZeRO's layers leave on
    zero.py           all-reduce (stage 0) and ZeRO stages 1-3: the training state sharded
                      over the data-parallel ranks
    server_buckets.py a bucket's reduction as a push and a pull to the servers (ps, hybrid)

Uses compression/ for what goes on the wire and allreduce/ or psrv/ to move it.
"""
