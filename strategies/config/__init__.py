"""What a run is asked to do, checked before anything runs.  Imports no torch.

    choices.py         ConfigError (with the field it is about) and the values of each choice flag
    settings.py        TrainConfig: every setting of a run, frozen and validated; the flat command line
    combinations.py    which flags go together: one technique checked against the rest
    compress_spec.py   the --compress spec (topk:RATIO, powersgd:RANK) and its arithmetic
    mesh.py            Mesh: dp x pp x tp (ep cut out of dp) against the world size, a
                       communicator per axis
    optimizer_checks.py  DistributedOptimizer's arguments (model, communicator, servers)

The lowest layer of the worker: every other subpackage may import it, it imports none.
"""
