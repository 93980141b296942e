"""Tier (a): the cost model, simulator and calibration fits against hand-computed values."""
import math

import numpy as np
import pytest

from experiments import costmodel as cm
from experiments import simulate
from experiments.fits import fit_alpha_beta, fit_two_regimes
from strategies.config.settings import parse_straggler

# alpha 10 us, 1 GB/s links, reducing at 2 GB/s; one core per rank
M = cm.Machine(alpha=1e-5, beta=1e-9, gamma=5e-10)
N = 1_000_000


@pytest.mark.timeout(10)
def test_ring_by_hand():
    # 2(P-1) alpha + (P-1)/P n (2 beta + gamma) = 6e-5 + 0.75e6 * 2.5e-9
    assert cm.ring_allreduce(N, 4, M) == pytest.approx(6e-5 + 1.875e-3)
    assert cm.ring_allreduce(N, 1, M) == 0.0
    assert cm.ring_reduce_scatter(N, 4, M) == pytest.approx(3e-5 + 0.75e6 * 1.5e-9)
    assert cm.ring_allgather(N, 4, M) == pytest.approx(3e-5 + 0.75e6 * 1e-9)


@pytest.mark.timeout(10)
def test_tree_and_halving_doubling_by_hand():
    # tree: 2 lg P (alpha + n beta) + lg P n gamma, lg 4 = 2
    assert cm.tree_allreduce(N, 4, M) == pytest.approx(4 * (1e-5 + 1e-3) + 2 * 5e-4)
    # P = 4: 2 log2 4 alpha + 3/4 n (2 beta + gamma)
    assert cm.halving_doubling_allreduce(N, 4, M) == pytest.approx(4e-5 + 1.875e-3)
    # P = 3 folds to p = 2, plus 2 (alpha + n beta) + n gamma
    assert cm.halving_doubling_allreduce(N, 3, M) == pytest.approx(
        2e-5 + 0.5e6 * 2.5e-9 + 2 * (1e-5 + 1e-3) + 5e-4)


@pytest.mark.timeout(10)
def test_hierarchical_by_hand():
    # P = 8 as 2 nodes of 4, intra and inter alike
    rs = 3e-5 + 0.75e6 * 1.5e-9
    gather = 3e-5 + 0.75e6 * 1e-9
    bcast = 3e-5 + 1e6 * 1e-9
    inter = 2e-5 + 0.5e6 * 2.5e-9
    assert cm.hierarchical_allreduce(N, 8, 4, M, M) == pytest.approx(rs + gather + bcast + inter)
    assert cm.allreduce_time("hierarchical", N, 8, M, ranks_per_node=4) == pytest.approx(
        rs + gather + bcast + inter)
    assert cm.allreduce_time("mpi", N, 8, M) is None


@pytest.mark.timeout(10)
def test_parameter_server_is_bytepss_max():
    # W n / (S B) = 4e6 / 2 * 1e-9 = 2 ms beats n / B = 1 ms: the servers are the bottleneck
    assert cm.ps_push_pull(N, 4, 2, 1e-9, 1e-9, alpha=1e-4) == pytest.approx(1e-4 + 2e-3)
    assert cm.ps_push_pull(N, 4, 2, 1e-9, 1e-9, alpha=1e-4, duplex=False) == pytest.approx(
        1e-4 + 4e-3)
    assert cm.ps_push_pull(N, 4, 8, 1e-9, 1e-9) == pytest.approx(1e-3)   # enough servers
    m = cm.Machine(1e-5, 1e-9, ps_alpha=2e-4, ps_beta=1e-9)
    assert cm.psrv_time(N, 1, 1, m) == pytest.approx(2e-4 + 2e-3)
    assert cm.psrv_time(N, 2, 1, m) == pytest.approx(2e-4 + 4e-3)
    assert cm.psrv_time(N, 1, 1, M) is None                              # not calibrated


@pytest.mark.timeout(10)
def test_psrv_time_reads_the_calibrated_curves():
    # W=1 round trips at 1 and 4 MB; each further worker adds 0.5 and 3 ms
    m = cm.Machine(1e-5, 1e-9, ps_alpha=1e-3, ps_beta=1e-9,
                   ps_curve=((1_000_000, 2e-3), (4_000_000, 9e-3)),
                   ps_marginal=((1_000_000, 0.5e-3), (4_000_000, 3e-3)))
    assert cm.psrv_time(1_000_000, 1, 1, m) == pytest.approx(2e-3)
    assert cm.psrv_time(4_000_000, 3, 1, m) == pytest.approx(9e-3 + 2 * 3e-3)
    # between the sizes: the per-byte cost, log-log interpolated; 2 MB is halfway in log
    per_byte = math.sqrt(1e-3 / 1e6 * 8e-3 / 4e6)
    assert cm.psrv_time(2_000_000, 1, 1, m) == pytest.approx(1e-3 + 2e6 * per_byte)
    # past the ends: linear in bytes at the end's per-byte cost
    assert cm.psrv_time(8_000_000, 1, 1, m) == pytest.approx(1e-3 + 2 * 8e-3)
    assert cm.psrv_time(8_000_000, 2, 1, m) == pytest.approx(1e-3 + 2 * 8e-3 + 2 * 3e-3)
    # S does not divide the per-worker cost on one host
    assert cm.psrv_time(4_000_000, 3, 2, m) == cm.psrv_time(4_000_000, 3, 1, m)


@pytest.mark.timeout(10)
def test_beta_and_gamma_curves_replace_the_constants():
    curve = cm.Machine(1e-5, 1e-9, 5e-10, beta_curve=((1 << 20, 1e-10), (16 << 20, 2e-10)),
                       gamma_curve=((1 << 20, 5e-11), (16 << 20, 1e-10)))
    assert curve.beta_at(1 << 10) == 1e-10 and curve.beta_at(1 << 30) == 2e-10   # flat ends
    assert curve.beta_at(4 << 20) == pytest.approx(1e-10 * 2 ** 0.5)             # half way in log
    assert M.beta_at(1 << 20) == M.beta and M.gamma_at(1 << 20) == M.gamma
    n = 32 << 20           # a ring step reads the curves at its message: 16 MiB, the flat end
    assert cm.ring_allreduce(n, 2, curve) == pytest.approx(2e-5 + 0.5 * n * (4e-10 + 1e-10))
    n = 2 << 20            # 1 MiB messages: the other end
    assert cm.ring_allreduce(n, 2, curve) == pytest.approx(2e-5 + 0.5 * n * (2e-10 + 5e-11))
    # halving-doubling's rounds halve: n/2, n/4, ...; at P = 2 it is the ring
    assert cm.halving_doubling_allreduce(n, 2, curve) == pytest.approx(
        cm.ring_allreduce(n, 2, curve))
    for P in (4, 8):       # constants: the closed form 2 log2 P alpha + (P-1)/P n (2 beta + gamma)
        assert cm.halving_doubling_allreduce(n, P, M) == pytest.approx(
            2 * math.log2(P) * M.alpha + (P - 1) / P * n * (2 * M.beta + M.gamma))
    cal = {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 5e-10,
           "beta_bytes": [1, 2], "beta_s_per_byte_at": [3e-9, 4e-9],
           "gamma_bytes": [1, 2], "gamma_s_per_byte_at": [5e-9, 6e-9],
           "ps_alpha_s": 1e-4, "ps_bytes": [1, 2], "ps_s": [1e-3, 2e-3],
           "ps_marginal_s": [1e-4, 2e-4]}
    m = cm.Machine.from_calibration(cal)
    assert m.beta_curve == ((1, 3e-9), (2, 4e-9)) and m.gamma_curve == ((1, 5e-9), (2, 6e-9))
    assert m.ps_curve == ((1, 1e-3), (2, 2e-3)) and m.ps_marginal == ((1, 1e-4), (2, 2e-4))
    assert m.beta_one_way_curve is None and m.beta_one_way_at(2) == m.beta_at(2)  # not measured
    one_way = cm.Machine.from_calibration({**cal, "beta_one_way_bytes": [1, 2],
                                           "beta_one_way_s_per_byte_at": [1e-9, 2e-9]})
    assert one_way.beta_one_way_at(2) == 2e-9 and one_way.beta_at(2) == 4e-9
    # a tree's rounds send one way; a ring's steps exchange
    n = 2
    assert cm.tree_allreduce(n, 2, one_way) == pytest.approx(2 * (1e-5 + n * 2e-9) + n * 6e-9)
    assert cm.ring_allreduce(n, 2, one_way) == cm.ring_allreduce(n, 2, m)
    # a cost that came out 0 (noise at small sizes): linear there, not log(0)
    assert cm.interpolate(((1, 0.0), (4, 2.0)), 2) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="beta_curve"):
        cm.Machine(1e-5, 1e-9, beta_curve=((2, 1e-9), (1, 1e-9)))     # sizes not increasing
    with pytest.raises(ValueError, match="ps_marginal_s"):
        cm.Machine.from_calibration({**cal, "ps_marginal_s": [1e-4]})


@pytest.mark.timeout(10)
def test_zero_and_pipeline_formulas():
    psi, n = 1_000_000, 4
    totals = [sum(cm.zero_memory(psi, n, s).values()) for s in range(4)]
    assert totals == pytest.approx([16e6, 8e6 + 2e6, 4e6 + 3e6, 4e6])
    assert cm.zero_comm_bytes(psi, n, 3) == pytest.approx(1.5 * cm.zero_comm_bytes(psi, n, 1))
    assert cm.zero_comm_bytes(psi, n, 1) == pytest.approx(2 * 0.75 * 4e6)
    assert cm.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert cm.bubble_fraction(1, 8) == 0.0
    assert cm.pipeline_activations_in_flight(4, 8, "gpipe") == 8
    assert cm.pipeline_activations_in_flight(4, 8, "1f1b") == 4
    assert cm.pipeline_activations_in_flight(4, 8, "1f1b", stage=3) == 1
    assert cm.pipeline_step_time(4, 4, 1e-3, 2e-3, 1000, M) == pytest.approx(
        7 * (3e-3 + 2 * (1e-5 + 1e-6)))
    with pytest.raises(ValueError):
        cm.bubble_fraction(0, 4)
    with pytest.raises(ValueError):
        cm.zero_memory(psi, n, 4)


@pytest.mark.timeout(10)
def test_machine_is_validated_and_cores_stretch_bandwidth():
    with pytest.raises(ValueError):
        cm.Machine(alpha=-1, beta=1e-9)
    two_cores = cm.Machine(0.0, 1e-9, 0.0, cores=2)
    # 4 ranks on 2 cores: the bandwidth term takes twice as long
    assert cm.ring_allreduce(N, 4, two_cores) == pytest.approx(2 * cm.ring_allreduce(
        N, 4, cm.Machine(0.0, 1e-9)))
    assert cm.ring_allreduce(N, 2, two_cores) == pytest.approx(N * 1e-9)


@pytest.mark.timeout(10)
def test_fits_recover_a_known_line():
    sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
    times = [20e-6 + b / 5e9 for b in sizes]
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(20e-6, rel=1e-6) and beta == pytest.approx(1 / 5e9, rel=1e-6)
    alpha, beta = fit_two_regimes(sizes, times)
    assert alpha == pytest.approx(20e-6, rel=1e-3) and beta == pytest.approx(1 / 5e9, rel=1e-3)


@pytest.mark.timeout(10)
def test_simulator_crossovers():
    gamma = 1 / 500e9
    c = simulate.Cluster(8, cm.Machine(2e-6, 1 / 150e9, gamma),
                         cm.Machine(1e-5, 1 / 12.5e9, gamma))

    def time(algo, n, P):
        return simulate.allreduce(algo, n, P, c)
    # one node: the ring never leaves NVLink, a PS behind the network port cannot win
    assert simulate.ps(1 << 28, 8, c, 64) > time("ring", 1 << 28, 8)
    # thousands of ranks: latency makes the tree win small messages, the ring large ones
    assert time("tree", 1 << 10, 4096) < time("ring", 1 << 10, 4096)
    assert time("ring", 1 << 30, 4096) < time("tree", 1 << 30, 4096)
    # ring over 16 nodes: every step paced by the inter-node link; the adds inside a
    # node hide under the transfer (allreduce/twolevel.py: a step takes the longer part)
    assert time("ring", N, 128) == pytest.approx(254 * (1e-5 + N / 128 / 12.5e9))
    cross = {x["P"]: x for x in simulate.crossovers(c)}
    assert cross[8]["ps_servers_to_beat_ring"] is None
    s16 = cross[16]["ps_servers_to_beat_ring"]
    n = cross[16]["ps_message_bytes"]
    assert simulate.ps(n, 16, c, s16) < time("ring", n, 16) <= simulate.ps(n, 16, c, s16 - 1)
    assert all(math.isfinite(r["time_s"]) for r in simulate.table([1 << 20], c))


@pytest.mark.timeout(10)
def test_straggler_parsing():
    assert parse_straggler("1:0.05") == (1, 0.05)
    for bad in ("1", "x:1", "-1:0.1", "1:-2"):
        with pytest.raises(ValueError):
            parse_straggler(bad)
    assert np.isclose(cm.lg(4096), 12)


@pytest.mark.timeout(10)
def test_report_shows_the_machines_own_drift_from_the_calibration_rounds():
    from experiments import fidelity, report
    cal = {"kind": "calibration", "alpha_s": 1e-5, "beta_s_per_byte": 1e-9,
           "gamma_s_per_byte": 5e-10, "cores": 2,
           "verify": [{"algo": "ring", "bytes": 1 << 20, "world_size": 2, "time_us": 400.0,
                       "round_us": [300.0, 450.0, 400.0]},
                      {"algo": "tree", "bytes": 1 << 20, "world_size": 2, "time_us": 900.0,
                       "round_us": [900.0]}]}
    assert fidelity.drift(cal) == [(1 << 20, pytest.approx(3e-4), pytest.approx(4.5e-4), 3)]
    text = " ".join(str(b[1]) for b in report.fidelity_blocks([cal]) if b[0] == "p")
    assert "1M 0.30-0.45 ms (slowest +50%)" in text and "over 3 rounds" in text
    assert fidelity.drift({"verify": [{"algo": "ring", "bytes": 1, "time_us": 1.0}]}) == []


@pytest.mark.timeout(10)
def test_context_parallel_by_hand():
    # b 2, T 4096, C 64, cp 4, float32: a block (one of k, v, dk, dv) is 2 * 1024 * 64 * 4
    block = 524288
    # ring: 3 cp - 2 = 10 messages, 2 (cp-1) + 2 (cp-1) + 2 cp = 20 blocks
    assert cm.context_parallel_time("ring", 2, 4096, 64, 4, M) == \
        pytest.approx(10 * 1e-5 + 20 * block * 1e-9)
    # Ulysses: 4 pairwise all-to-alls (3 steps each) of 3, 1, 1, 3 blocks, 3/4 of each sent
    assert cm.context_parallel_time("ulysses", 2, 4096, 64, 4, M) == \
        pytest.approx(12 * 1e-5 + 0.75 * 8 * block * 1e-9)
    assert cm.context_parallel_time("ring", 2, 4096, 64, 1, M) == 0.0
    with pytest.raises(ValueError, match="ring or ulysses"):
        cm.context_parallel_time("zigzag", 2, 4096, 64, 2, M)
