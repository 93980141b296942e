"""Data parallelism's gradient synchronisation: one contract, every backend.

    gradient_sync.py  GradientSync (the contract), local and the all-reduce syncs
    buckets.py        flat gradient buckets, all-reduced during backward
    comm_thread.py    the one communication thread that buckets and ZeRO's layers leave on
    zero.py           ZeRO stages 0-3: the training state sharded over the data-parallel ranks
    ps_sync.py        parameter servers, and hybrid (all-reduce in a node, servers between),
                      for a whole model
    server_buckets.py the bucket engine's reduction as a push and a pull to the servers
                      (ps, hybrid), for a model cut over the grid

Uses compression/ for what goes on the wire and allreduce/ or psrv/ to move it.
"""
