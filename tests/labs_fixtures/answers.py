"""Right answers to labs 1-5 and 7, for the tests only (the teacher's keys in
experiments/labs/teacher/ explain them).  Students never need this file."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RING_SKELETON = os.path.join(ROOT, "experiments", "labs", "ring_skeleton.py")

# The five TODOs of ring_skeleton.py, filled in as allreduce/ring.py's
# reduce_scatter_chunks and allgather_chunks do it.
RING_TODOS = {
    "send_chunk = None      # TODO: which chunk goes right at this step?":
        "send_chunk = (r - step - 1) % P",
    "recv_chunk = None      # TODO: which chunk arrives from the left?":
        "recv_chunk = (r - step - 2) % P",
    "# TODO: add what arrived into our copy of recv_chunk": "x[r0:r1] += incoming[:r1 - r0]",
    "send_chunk = None      # TODO: the chunk this rank completed most recently":
        "send_chunk = (r - step) % P",
    "recv_chunk = None      # TODO: the chunk that arrives from the left\n":
        "recv_chunk = (r - step - 1) % P\n",
}


def ring(replacements=None):
    """ring_skeleton.py's text with its TODOs filled in (RING_TODOS, then `replacements`)."""
    text = open(RING_SKELETON).read()
    for old, new in {**RING_TODOS, **(replacements or {})}.items():
        assert old in text, f"ring_skeleton.py no longer has {old!r}"
        text = text.replace(old, new)
    return text


ZERO = """params = 1_000_000
ranks = 4
stage0 = 16_000_000
stage1 = 10_000_000
stage2 = 7_000_000
stage3 = 4_000_000
"""

# Lab 7: mixed-precision Adam, 2 + 2 + 12 bytes a parameter; SGD with momentum K = 8.
PRECISION = """params = 1_000_000
ranks = 4
stage0 = 16_000_000
stage1 = 7_000_000
stage2 = 5_500_000
stage3 = 4_000_000
momentum_stage0 = 12_000_000
"""

PIPELINE = """stages = 4
[bubble]
m1 = 0.75
m4 = 0.4286
m8 = 0.2727
[bubble_interleaved]
v2_m8 = 0.1579
[in_flight_first_stage]
gpipe_m8 = 8
1f1b_m8 = 4
"""

GRID = """def coords_of(rank, dp, pp, tp):
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def group_of(rank, axis, dp, pp, tp):
    d, p, t = coords_of(rank, dp, pp, tp)
    if axis == "tp":
        return [(d * pp + p) * tp + i for i in range(tp)]
    if axis == "pp":
        return [(d * pp + i) * tp + t for i in range(pp)]
    return [(i * pp + p) * tp + t for i in range(dp)]
"""

# Lab 2's predictions: psi = 1e6 fp32 parameters, W = 2 workers, S = 1 server, a ring of 3.
PS = """params = 1_000_000
workers = 2
servers = 1
ring_ranks = 3
[bytes_per_step]
ps_worker = 4_000_000
ps_server = 8_000_000
ring_rank = 5_333_333
[staleness]
bsp = 0
ssp_straggler = 1
"""

COMPRESS = """params = 1_000_000
ranks = 4
ratio = 0.01
dense_bytes = 6_000_000
topk_bytes = 240_000
break_even_ratio = 0.25
"""
