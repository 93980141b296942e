"""What a run is asked to do, checked before anything runs.

Only optimizer_checks.py imports torch (it checks a model and a communicator handed to
DistributedOptimizer); the rest imports no torch, so the command line, the sweeps and
the planner check a config without paying for `import torch`.

    choices.py         ConfigError (with the field it is about) and the values of each choice flag
    sections.py        the sections of a config: SyncOptions, PrecisionOptions, ParallelOptions, ...
                       (a frozen dataclass per component, each field written once)
    settings.py        TrainConfig: the sections' fields, flat, frozen and validated; the flat
                       command line
    validate.py        every rule, once: check_flags (the config alone), check_world (against
                       the world size)
    compress_spec.py   the --compress spec (topk:RATIO, powersgd:RANK) and its arithmetic
    mesh.py            Mesh: dp x pp x tp (ep cut out of dp) against the world size, a
                       communicator per axis
    optimizer_checks.py  DistributedOptimizer's arguments (model, communicator, servers, its
                       keywords' sections, the cross-rank check)

The lowest layer of the worker: every other subpackage may import it, it imports none.
"""
