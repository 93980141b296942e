"""Tier (a): the arithmetic behind the algorithms, no processes."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import allreduce
from allreduce import check, theory
from allreduce.units import parse_size
from allreduce.buffers import CollectiveError, as_bytes, validate
from allreduce.halving_doubling import blocks, fold, real_rank, virtual_rank
from allreduce.ring import allgather_chunks, reduce_scatter_chunks
from allreduce.shards import bounds_from_sizes, shard_bounds
from allreduce.tree import children, parent, subtree


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shard_bounds_match_array_split(n, parts):
    bounds = shard_bounds(n, parts)
    expected = np.array_split(np.arange(n), parts)
    assert [b - a for a, b in bounds] == [len(e) for e in expected]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1))


def test_shard_bounds_rejects_nonsense():
    with pytest.raises(ValueError):
        shard_bounds(10, 0)
    with pytest.raises(ValueError):
        shard_bounds(-1, 2)
    assert bounds_from_sizes([2, 0, 3]) == [(0, 2), (2, 2), (2, 5)]


@pytest.mark.parametrize("P", range(1, 9))
def test_ring_schedule_leaves_rank_r_with_chunk_r(P):
    # Simulate who has contributed to each copy of each chunk.
    held = [[{r} for _ in range(P)] for r in range(P)]       # held[rank][chunk] = contributors
    for step in range(P - 1):
        sent = {}
        for r in range(P):
            send, _ = reduce_scatter_chunks(r, step, P)
            sent[(r + 1) % P] = (send, set(held[r][send]))
        for r in range(P):
            chunk, contributors = sent[r]
            assert chunk == reduce_scatter_chunks(r, step, P)[1]  # what the right neighbour expects
            held[r][chunk] |= contributors
    for r in range(P):
        assert held[r][r] == set(range(P)), f"rank {r} lacks contributions to chunk {r}"
    # All-gather: every rank receives every other chunk exactly once.
    for r in range(P):
        got = {allgather_chunks(r, step, P)[1] for step in range(P - 1)}
        assert got | {r} == set(range(P))
        for step in range(P - 1):
            assert allgather_chunks((r + 1) % P, step, P)[1] == allgather_chunks(r, step, P)[0]


@pytest.mark.parametrize("P", range(1, 40))
def test_binomial_tree_spans_all_ranks(P):
    seen = {0}
    for v in range(1, P):
        assert v in children(parent(v), P)
        seen.add(v)
    assert parent(0) is None and seen == set(range(P))
    depth = lambda v: 0 if v == 0 else 1 + depth(parent(v))   # noqa: E731
    # depth: the most set bits of any vrank; the root has ceil(log2 P) children (rounds)
    assert max(depth(v) for v in range(P)) == max(bin(v).count("1") for v in range(P))
    assert len(children(0, P)) == (P - 1).bit_length()
    for v in range(P):                      # a subtree is the rank and its descendants, contiguous
        first, stop = subtree(v, P)
        desc = {v} | {c for c in range(P) if c != v and _ancestor(v, c)}
        assert desc == set(range(first, stop))


def _ancestor(a, c):
    while c:
        c = parent(c)
        if c == a:
            return True
    return False


@pytest.mark.parametrize("P", range(1, 20))
def test_halving_doubling_fold(P):
    p2, extra = fold(P)
    assert p2 & (p2 - 1) == 0 and p2 <= P < 2 * p2 and extra == P - p2
    taking_part = [r for r in range(P) if virtual_rank(r, P) is not None]
    assert sorted(virtual_rank(r, P) for r in taking_part) == list(range(p2))
    assert all(real_rank(virtual_rank(r, P), P) == r for r in taking_part)
    owned = blocks(shard_bounds(100, P), P)
    assert owned[0][0] == 0 and owned[-1][1] == 100
    assert all(owned[i][1] == owned[i + 1][0] for i in range(p2 - 1))


def test_validate_names_the_problem():
    with pytest.raises(CollectiveError, match="not C-contiguous"):
        validate(np.zeros((4, 4))[:, 0], "x")
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(CollectiveError, match="read-only"):
        validate(ro, "x")
    validate(ro, "x", writable=False)
    with pytest.raises(CollectiveError, match="unsupported dtype complex64"):
        validate(np.zeros(3, np.complex64), "x")
    with pytest.raises(CollectiveError, match="unsupported dtype torch.bool"):
        validate(torch.zeros(3, dtype=torch.bool), "x")
    with pytest.raises(CollectiveError, match="requires grad"):
        validate(torch.zeros(3, requires_grad=True), "x")
    with pytest.raises(CollectiveError, match="numpy array or a torch tensor"):
        validate([1.0], "x")


def test_as_bytes_is_a_view_for_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = torch.arange(6).to(dtype)
        b = as_bytes(t)
        assert b.nbytes == t.numel() * t.element_size()
        b[:] = 0
        assert (t == 0).all()
    assert as_bytes(torch.zeros(1).expand(1)).nbytes == 4    # one element, stride 0


def test_unknown_algorithm_is_rejected_before_any_transport():
    with pytest.raises(CollectiveError, match="unknown algorithm 'rign'"):
        allreduce.create("rign")
    with pytest.raises(CollectiveError, match="unknown algorithm"):
        allreduce.make("bogus", transport=None)


def test_signature_description():
    sig = check.signature("allreduce", 10, 0, "sum")
    assert check.describe(sig) == "allreduce(count=10, float32, op=sum)"
    assert "root=2" in check.describe(check.signature("broadcast", 5, 5, None, 2))


def test_theory_and_sizes():
    assert theory.bus_factor("allreduce", 4) == 1.5
    assert theory.bytes_sent("ring", "allreduce", 1000, 4) == 1500
    assert theory.bytes_sent("halving_doubling", "allreduce", 1 << 20, 4) == 1.5 * (1 << 20)
    # short messages: recursive doubling, lg 4 = 2 swaps of the whole vector
    assert theory.bytes_sent("halving_doubling", "allreduce", 1024, 4) == 2048
    assert theory.bytes_sent("tree", "broadcast", 100, 5) == 300
    assert parse_size("4K") == 4096 and parse_size("64M") == 64 << 20 and parse_size("100") == 100


@settings(max_examples=50)
@given(st.integers(0, 10), st.integers(1, 5))
def test_numpy_and_torch_views_agree(n, k):
    a = np.arange(n * k, dtype=np.float32)
    t = torch.from_numpy(a)
    assert bytes(as_bytes(a)) == bytes(as_bytes(t))


class OneRank(allreduce.Transport):
    """A transport of one rank: the collectives move nothing, their checks still run."""

    def node_id(self):
        return 0


def test_validation_cache_still_checks_every_buffer():
    coll = allreduce.make("ring", OneRank())
    good = np.zeros((4, 4), np.float32)
    coll.allreduce(good)                               # float32 is now known
    read_only = np.zeros((4, 4), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(CollectiveError, match="read-only"):
        coll.allreduce(read_only)
    with pytest.raises(CollectiveError, match="not C-contiguous"):
        coll.allreduce(np.zeros((4, 8), np.float32)[:, ::2])   # same shape, strided
    coll.reduce_scatter(read_only)                     # nothing is written into the input
    coll.allreduce(np.zeros(4, np.int64))              # int64 is known too, for sums
    with pytest.raises(CollectiveError, match="floating dtype"):
        coll.allreduce(np.zeros(4, np.int64), op="avg")
    with pytest.raises(CollectiveError, match="unsupported dtype complex64"):
        coll.allreduce(np.zeros((4, 4), np.complex64))
    coll.allreduce(torch.zeros(4, 4))
    with pytest.raises(CollectiveError, match="requires grad"):
        coll.allreduce(torch.zeros(4, 4, requires_grad=True))
    with pytest.raises(CollectiveError, match="not contiguous"):
        coll.allreduce(torch.zeros(4, 4).t())
    with pytest.raises(CollectiveError, match="numpy array or a torch tensor"):
        coll.allreduce([0.0] * 16)
    coll.allreduce(good)                               # and the good one still passes
