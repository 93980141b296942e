"""What drives training: the one step engine, the loop, and the user's own optimizer.

    optimizer.py     DistributedOptimizer: any sync, in a loop of the user's own
    parallelize.py   one rank's share of the model: tp, recompute, pipeline, experts, then
                     data parallelism, in that order; the schedule over the result
    accumulation.py  the trivial schedule: k micro-steps, communication once
    loop.py          the one step engine (one step for every run) and the training loop
    grid.py          how the grid's pieces meet in a step; the whole model from its pieces
    stopping.py      SIGINT/SIGTERM under --sync ps: the workers stop at one agreed step

The top of the worker's layers: train.py, bench.py and the other commands above it.
"""
