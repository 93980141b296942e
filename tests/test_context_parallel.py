"""Context parallelism: ring attention (strategies/parallel/ring_attention.py) and Ulysses
(strategies/parallel/ulysses.py).

Tier (a): the causal block table, the byte formulas by hand, Ulysses' head check.
Tier (c): under mpiexec at 2 and 3 ranks (3: left and right differ, so a ring run
the wrong way round shows), forward and the gradients of q, k, v against
whole-sequence attention in one process (tests/mpi/context_parallel.py): float64 at
rtol = atol = 1e-6, float32 at 1e-4, on values of order 1, causal and not for the
ring; the bytes each rank's transport counted equal the formulas exactly.
"""
import json

import pytest
import torch

from conftest import check_ok, mpirun
from strategies.config.choices import ConfigError
from strategies.parallel.ring_attention import block_state, ring_bytes
from strategies.parallel.ulysses import Ulysses, check_heads, ulysses_bytes


def test_causal_blocks_before_the_diagonal_are_full_after_it_skipped():
    assert [block_state(j, 2, causal=True) for j in range(4)] == \
        ["full", "full", "diagonal", "skip"]
    assert {block_state(j, 2, causal=False) for j in range(4)} == {"full"}


@pytest.mark.parametrize("cp, blocks", [(1, 0), (2, 8), (3, 14), (4, 20), (8, 44)])
def test_ring_sends_k_v_round_twice_and_dk_dv_home(cp, blocks):
    # forward 2 (cp-1); backward 2 (cp-1) + 2 cp; a block: b (T / cp) C values
    block = 2 * (4096 // cp) * 64 * 4
    assert ring_bytes(2, 4096, 64, cp) == blocks * block
    assert ring_bytes(2, 4096, 64, cp, backward=False) == 2 * (cp - 1) * block


def test_ulysses_sends_four_tensors_each_way_by_the_pairwise_exchange():
    # cp 2: the pairwise exchange sends half of each buffer; q, k, v and the output
    # in the forward, their gradients in the backward: 8 (cp-1)/cp n
    n = 2 * 2048 * 64 * 4
    assert ulysses_bytes(2, 4096, 64, 2) == 8 * n / 2
    assert ulysses_bytes(2, 4096, 64, 2, backward=False) == 4 * n / 2
    assert ulysses_bytes(2, 4096, 64, 1) == 0


def test_ulysses_needs_heads_divisible_by_cp():
    check_heads(8, 4)
    with pytest.raises(ConfigError, match=r"heads 6 is not a multiple of cp 4 \(6 % 4 = 2\)"):
        check_heads(6, 4)

    class TwoRanks:                  # refused before anything is sent
        size = 2
    q = torch.zeros(1, 4, 6)
    with pytest.raises(ConfigError, match="heads 3 is not a multiple of cp 2"):
        Ulysses(TwoRanks())(q, q, q, 3)


@pytest.mark.mpi
@pytest.mark.timeout(150)
@pytest.mark.parametrize("cp", [2, 3])
def test_ring_and_ulysses_equal_whole_sequence_attention(cp):
    # about 3 s a launch here.  Without TOPOLAB_CHECK: its signature exchange before each
    # all-to-all travels on the same transport and would add to the bytes counted
    result = check_ok(mpirun(cp, ["tests/mpi/context_parallel.py"], timeout=140,
                             TOPOLAB_CHECK=0))
    assert f"context parallel OK on {cp} ranks" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_at_seq_4096_each_rank_keeps_half_the_attention_activations_at_cp_2():
    """The bytes autograd saves for the attention's backward (q, k, v, the output and
    the log-sum-exp), per rank at seq 4096: ring attention and Ulysses on 2 ranks each
    keep about half of what one rank keeps for the whole sequence (measured: exactly
    half, 2,129,920 of 4,259,840 bytes; the bound leaves 10 % for a kernel that saves
    a little more)."""
    result = check_ok(mpirun(2, ["tests/mpi/context_memory.py"], timeout=100,
                             TOPOLAB_CHECK=0))
    everyone = json.loads(result.stdout.strip().splitlines()[-1])
    assert [peaks["rank"] for peaks in everyone] == [0, 1]
    for peaks in everyone:
        for kind in ("ring", "ulysses"):
            assert peaks[kind] == pytest.approx(peaks["cp1"] / 2, rel=0.1), peaks
