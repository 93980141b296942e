"""The layout planner: predict, rank and check every dp x pp x tp x ZeRO layout of a GPT
on a cluster you do not have (python -m experiments.plan; docs/planner.md).

    transformer.py   the model's side: parameters, FLOPs, activation bytes (the papers' formulas;
                     GQA, the MLP's width, gating)
    kernels.py       a layer's compute kernel by kernel: GEMMs by shape, the rest by bandwidth
    cluster.py       the machine's side: GPUs, memory, bandwidth, links; presets with sources
    stages.py        which layers sit on which pipeline stage and chunk, what each holds
    step.py          one layout's predicted step: time split by cause, memory per rank
    search.py        every layout of a model on a cluster, why each is out or where it ranks
    figure.py        step time against memory per rank, the Pareto front marked
    verify.py        the best and the worst layouts run with strategies.train on this machine
    shared_cores.py  a rank's rate among ranks sharing cores, and an exchange's wait (verify's)

It imports the cost model (experiments/costmodel.py), strategies/runtime/memory.py's
zero_memory, strategies/parallel/bubble.py's formulas and strategies/parallel/stages.py's
split of the layers into stages (the trainer's own); nothing below experiments imports it.
"""
