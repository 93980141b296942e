"""Lab 5: where does a rank sit in the dp x pp x tp grid?  Fill in coords_of, then

    .venv/bin/python -m experiments.labs.check_answers grid my_grid.py

The layout (the one torchtitan and Megatron-LM use, and strategies/config/mesh.py builds):

    grid = np.arange(world).reshape(dp, pp, tp)    # tp varies fastest

so the tp ranks of one stage are neighbours (on one node, on the fastest links),
and dp varies slowest.  With dp=2, pp=2, tp=2:

    rank:  0  1  2  3  4  5  6  7
    d:     0  0  0  0  1  1  1  1
    p:     0  0  1  1  0  0  1  1
    t:     0  1  0  1  0  1  0  1
"""


def coords_of(rank, dp, pp, tp):
    """(d, p, t) of `rank`; without numpy, with // and %."""
    raise NotImplementedError("TODO")


def group_of(rank, axis, dp, pp, tp):
    """The ranks that share every coordinate with `rank` except `axis`
    ('dp', 'pp' or 'tp'): the sub-communicator of that axis, in any order.
    (Checked once it no longer raises NotImplementedError.)"""
    raise NotImplementedError("TODO")
