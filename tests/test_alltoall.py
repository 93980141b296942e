"""All-to-all: the schedules on paper (tier a), then every algorithm under mpiexec (tier b)."""
import pytest

from allreduce import alltoall, shard_bounds
from allreduce.alltoall import (BRUCK_BELOW, bruck_destination, pairwise_peers, received_bounds,
                                uses_bruck)
from allreduce.theory import bus_factor, bytes_sent
from conftest import check_ok, mpirun


@pytest.mark.parametrize("P", range(1, 10))
def test_pairwise_meets_every_pair_once(P):
    pairs = {(r, pairwise_peers(r, step, P)[0]) for r in range(P) for step in range(1, P)}
    assert pairs == {(r, d) for r in range(P) for d in range(P) if r != d}
    for r in range(P):
        for step in range(1, P):         # what r sends, its destination receives at that step
            dest, _ = pairwise_peers(r, step, P)
            assert pairwise_peers(dest, step, P)[1] == r


def simulate_bruck(P):
    """Every rank's slots as (source, destination), moved as alltoall.bruck moves them."""
    slots = [[(r, (r + i) % P) for i in range(P)] for r in range(P)]      # 1. rotate
    distance = 1
    while distance < P:                                                  # 2. the steps
        before = [list(s) for s in slots]
        for r in range(P):
            source = (r - distance) % P
            for i in range(P):
                if i & distance:
                    # the size the receiver expects is that of the block's destination
                    assert before[source][i][1] == bruck_destination(source, i, distance, P)
                    slots[r][i] = before[source][i]
        distance <<= 1
    return slots


@pytest.mark.parametrize("P", range(1, 10))
def test_bruck_leaves_rank_r_the_block_of_rank_r_minus_i_in_slot_i(P):
    slots = simulate_bruck(P)
    for r in range(P):
        assert slots[r] == [((r - i) % P, r) for i in range(P)]     # 3. rotate back: slot (r-j)


def test_the_docstring_table_for_four_ranks():
    assert [s for s in simulate_bruck(4)[0]] == [(0, 0), (3, 0), (2, 0), (1, 0)]
    assert pairwise_peers(1, 1, 4) == (2, 0) and pairwise_peers(3, 3, 4) == (2, 0)


def test_received_bounds_are_P_blocks_of_this_ranks_shard():
    bounds = shard_bounds(10, 4)                              # sizes 3 3 2 2
    assert received_bounds(bounds, 0) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert received_bounds(bounds, 3) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_bruck_only_where_it_saves_steps_and_blocks_are_small():
    assert not uses_bruck(8, 3)                               # ceil(log2 3) = 2 = P - 1
    assert uses_bruck(8, 4) and uses_bruck(BRUCK_BELOW - 1, 64)
    assert not uses_bruck(BRUCK_BELOW, 4)


@pytest.mark.parametrize("P", [2, 4, 8, 16])
def test_bytes_formulas(P):
    n = 1 << 20
    assert alltoall.bytes_sent(n, P, bruck=False) == (P - 1) / P * n
    assert alltoall.bytes_sent(n, P, bruck=True) == n / 2 * (P.bit_length() - 1)
    # what the benchmark prints: Bruck for small blocks, pairwise for large ones
    assert bytes_sent("ring", "alltoall", 64 * P, P) == alltoall.bytes_sent(64 * P, P, P >= 4)
    assert bytes_sent("tree", "alltoall", n, P) == (P - 1) / P * n
    assert bytes_sent("mpi", "alltoall", n, P) is None and bus_factor("alltoall", P) == (P - 1) / P


@pytest.mark.mpi
@pytest.mark.timeout(150)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_every_algorithm_matches_the_reference(P):
    # 2-14 s a launch here (P = 1 .. 4); the limit leaves room for a loaded machine
    result = check_ok(mpirun(P, ["tests/mpi/alltoall_matrix.py"], timeout=140))
    assert f"OK P={P}" in result.stdout
