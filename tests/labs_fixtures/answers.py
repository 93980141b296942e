"""Right answers to labs 1-8 and 10, for the tests only (the teacher's keys in
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

# Lab 6, worked by hand (the teacher's sheet): bytes the busiest host sends across its
# link, and ms if only the link took time.  2 x 2: ring 2(P-1)/P n = 1.5 n; tree n (host
# 1 sends its sum up, host 0 the result down, one after the other: 2 n of time);
# halving-doubling n/2 from both ranks of a host in its first and last steps: 2 n;
# hierarchical the leaders' ring over 2 hosts: n.  4 x 1: the tree's root sends n to
# hosts 1 and 2.
N = 16 << 20                 # 16 MiB
MS = N * 8e-9 * 1e3          # n bytes through a 1 Gbit/s link, in ms: 134.2
CLUSTER = f"""
bytes = {N}
gbps = 1
[2x2]
ring = {1.5 * N:.0f}
tree = {N}
halving_doubling = {2 * N}
hierarchical = {N}
[2x2.link_ms]
ring = {1.5 * MS:.1f}
tree = {2 * MS:.1f}
halving_doubling = {2 * MS:.1f}
hierarchical = {MS:.1f}
[4x1]
ring = {1.5 * N:.0f}
tree = {2 * N}
halving_doubling = {1.5 * N:.0f}
hierarchical = {1.5 * N:.0f}
[4x1.link_ms]
tree = {4 * MS:.1f}
"""

# Lab 10: b = 8, C = 64, L = 2, float32; a block b (T / cp) C 4 bytes.  Ring: 2 (cp - 1)
# blocks a layer forward, 2 (cp - 1) + 2 cp backward; Ulysses: (cp - 1) / cp of 4 blocks
# each way.  cp 2, T 64: a block 65,536 bytes, ring 8 and Ulysses 4 blocks a layer.
CONTEXT = """batch = 8
d_model = 64
layers = 2
[ring]
cp2_seq64 = 1_048_576
cp2_seq512 = 8_388_608
cp8_seq4096 = 92_274_688
[ulysses]
cp2_seq64 = 524_288
cp2_seq512 = 4_194_304
cp8_seq4096 = 14_680_064
"""
