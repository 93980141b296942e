"""What drives training: the step engines, the loop, and the user's own optimizer.

    optimizer.py     DistributedOptimizer: any sync, in a loop of the user's own
    accumulation.py  --grad-accum: k micro-steps, communication once
    loop.py          the training loop, once, over a step engine; the data-parallel engine
    grid.py          the dp x pp x tp grid's engine: builds the rank's share, runs the step
    experts.py       the --ep engine: experts split, ZeRO's layers for the rest
    stopping.py      SIGINT/SIGTERM under --sync ps: the workers stop at one agreed step

The top of the worker's layers: train.py, bench.py and the other commands above it.
"""
