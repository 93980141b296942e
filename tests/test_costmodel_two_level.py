"""Tier (a): the two-level cost model (allreduce/twolevel.py) against the one-level
formulas, the bytes on the links (allreduce.theory.host_link_bytes) and hand-computed values."""
import pytest

from allreduce import costs, twolevel
from allreduce.theory import _allreduce_messages, allreduce_steps, host_link_bytes
from experiments.calibrate_link import LINK_SIZES, fit_link

ALGOS = ("ring", "tree", "halving_doubling", "hierarchical")
LAYOUTS = [(1, 1), (1, 4), (2, 1), (2, 2), (3, 2), (4, 1), (4, 2), (2, 3), (8, 4)]
MiB = 1 << 20
# a host with curves (beta exchanged and one way, gamma per size) and two cores
HOST = costs.Machine(20e-6, 1e-9, 3e-10, cores=2,
                     beta_curve=((MiB, 0.8e-9), (16 * MiB, 1.2e-9)),
                     beta_one_way_curve=((MiB, 0.6e-9), (16 * MiB, 0.9e-9)),
                     gamma_curve=((MiB, 2e-10), (16 * MiB, 4e-10)))
FREE = costs.Machine(0.0, 0.0, 0.0)          # copying and adding cost nothing
GBIT = twolevel.link_of_rate(1.0)            # 1 Gbit/s, no latency: 8 ns a byte


@pytest.mark.timeout(10)
@pytest.mark.parametrize("algo", ALGOS)
def test_one_host_is_the_one_level_model(algo):
    for P in (1, 2, 3, 4, 5, 8, 12):
        for n in (4096, MiB, 3 * 4 * MiB, 64 * MiB):
            assert twolevel.cluster_allreduce_time(algo, n, 1, P, HOST) == pytest.approx(
                costs.allreduce_time(algo, n, P, HOST, ranks_per_node=P), rel=1e-12)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("algo", ALGOS)
def test_the_schedules_send_what_host_link_bytes_counts(algo):
    for nodes, R in LAYOUTS:
        crossed = [0.0] * nodes
        total = 0.0
        for step in allreduce_steps(algo, 1.0, nodes * R, R):
            for a, b, m in step.messages:
                total += m * step.repeat
                if a // R != b // R:
                    crossed[a // R] += m * step.repeat
        assert crossed == pytest.approx(host_link_bytes(algo, 1.0, nodes, R))
        if algo != "hierarchical":
            assert total == pytest.approx(sum(m for _, _, m in
                                              _allreduce_messages(algo, 1.0, nodes * R)))


@pytest.mark.timeout(10)
def test_link_bound_time_is_the_bytes_on_the_busiest_link_at_its_rate():
    n = 16 * MiB
    for nodes, R in [(2, 1), (2, 2), (4, 1), (4, 2), (3, 2), (8, 4)]:
        for algo in ("ring", "halving_doubling", "hierarchical"):
            if algo == "halving_doubling" and nodes * R & (nodes * R - 1):
                continue        # P not a power of two: the fold goes one way, on some links only
            # every step crosses in both directions at once, so a host's sends set the pace
            busiest = max(host_link_bytes(algo, n, nodes, R))
            assert twolevel.cluster_allreduce_time(algo, n, nodes, R, FREE, GBIT) == \
                pytest.approx(busiest * 8e-9), (algo, nodes, R)
    # the tree uses each link one way at a time: host 1 sends n up, then receives n down
    assert twolevel.cluster_allreduce_time("tree", n, 2, 2, FREE, GBIT) == pytest.approx(
        2 * n * 8e-9)
    # 2 hosts x 2 ranks: the ring puts 1.5 n on a link, hierarchical n, halving-doubling 2 n
    # (its first and last steps send n/2 from both ranks of a host through one link)
    t = {a: twolevel.cluster_allreduce_time(a, n, 2, 2, FREE, GBIT) for a in ALGOS}
    assert [t[a] / (n * 8e-9) for a in ("ring", "hierarchical", "halving_doubling")] == \
        pytest.approx([1.5, 1.0, 2.0])


@pytest.mark.timeout(10)
def test_a_step_takes_the_longer_of_its_two_parts():
    n = 4 * MiB
    slow_host = costs.Machine(0.0, 100e-9, 0.0)     # slower than the 8 ns/B link
    # the ring on 2 x 1: every step crosses, nothing stays inside a host
    assert twolevel.cluster_allreduce_time("ring", n, 2, 1, slow_host, GBIT) == pytest.approx(
        n * 8e-9)
    # on 2 x 2 the steps inside a host now set the pace: 6 steps of n/4 at 100 ns/B
    assert twolevel.cluster_allreduce_time("ring", n, 2, 2, slow_host, GBIT) == pytest.approx(
        6 * n / 4 * 100e-9)
    # full duplex: an exchange step reads the link's exchange beta, a tree round its one-way beta
    link = costs.Machine(0.0, 10e-9, beta_one_way_curve=((1, 5e-9),))
    assert twolevel.cluster_allreduce_time("ring", n, 2, 1, FREE, link) == pytest.approx(
        n * 10e-9)
    assert twolevel.cluster_allreduce_time("tree", n, 2, 1, FREE, link) == pytest.approx(
        2 * n * 5e-9)


@pytest.mark.timeout(10)
def test_latencies_per_step_and_per_segment():
    slow = twolevel.link_of_rate(1.0, latency_s=1e-3)
    tiny = 4096
    # a ring step pays one latency: 2 (P-1) of them; halving-doubling 2 log2 P, and
    # below 32 KiB recursive doubling log2 P, each step the whole vector
    assert twolevel.cluster_allreduce_time("ring", tiny, 4, 1, FREE, slow) == pytest.approx(
        6 * (1e-3 + tiny / 4 * 8e-9))
    assert twolevel.cluster_allreduce_time("halving_doubling", tiny, 4, 1, FREE, slow) == \
        pytest.approx(2 * (1e-3 + tiny * 8e-9))
    big = 64 * 1024
    assert twolevel.cluster_allreduce_time("halving_doubling", big, 4, 1, FREE, slow) == \
        pytest.approx(2 * (1e-3 + big / 2 * 8e-9) + 2 * (1e-3 + big / 4 * 8e-9))
    # a tree round goes segment by segment (1 MiB each), a latency each: 2 rounds of 4
    assert twolevel.cluster_allreduce_time("tree", 4 * MiB, 2, 1, FREE, slow) == pytest.approx(
        2 * (4 * 1e-3 + 4 * MiB * 8e-9))


@pytest.mark.timeout(10)
def test_hierarchical_beats_the_ring_where_the_link_is_the_bottleneck():
    # memory at 10 GB/s, the link at 1 Gbit/s: 80 times slower
    host = costs.Machine(5e-6, 0.1e-9, 0.05e-9)
    for nodes, R in [(2, 2), (2, 4), (4, 2), (8, 4)]:
        for n in (MiB, 16 * MiB, 256 * MiB):
            ring = twolevel.cluster_allreduce_time("ring", n, nodes, R, host, GBIT)
            hier = twolevel.cluster_allreduce_time("hierarchical", n, nodes, R, host, GBIT)
            assert hier < ring, (nodes, R, n)
    # hierarchical saves link bytes, 2(N-1)/N n against 2(P-1)/P n, but its steps inside a
    # host (reduce-scatter, gather, broadcast) hide under nothing: with memory only 8 times
    # faster than the link it still wins on 2 hosts x 2 ranks, no longer on 8 x 4
    n = 16 * MiB
    assert twolevel.cluster_allreduce_time("hierarchical", n, 2, 2, HOST, GBIT) < \
        twolevel.cluster_allreduce_time("ring", n, 2, 2, HOST, GBIT)
    assert twolevel.cluster_allreduce_time("hierarchical", n, 8, 4, HOST, GBIT) > \
        twolevel.cluster_allreduce_time("ring", n, 8, 4, HOST, GBIT)


@pytest.mark.timeout(10)
def test_the_model_has_no_schedule_for_the_libraries_and_needs_a_link():
    assert twolevel.cluster_allreduce_time("mpi", MiB, 2, 2, HOST, GBIT) is None
    with pytest.raises(ValueError, match="link"):
        twolevel.cluster_allreduce_time("ring", MiB, 2, 2, HOST)


@pytest.mark.timeout(10)
def test_the_link_calibration_recovers_alpha_and_beta():
    alpha, beta_x, beta_1 = 0.5e-3, 9e-9, 8e-9          # exchanges cost more per byte here
    medians = {("ping_pong", LINK_SIZES[0]): alpha}
    for n in LINK_SIZES:
        medians[("one_way", n)] = alpha + n * beta_1
        medians[("exchange", n)] = alpha + n * beta_x
        medians[("shared", n)] = alpha + 2 * n * beta_x   # two ranks of a host at once
    cal = fit_link(medians, flows=2)
    assert cal["inter_alpha_s"] == alpha                    # half a ping-pong
    assert cal["inter_beta_s_per_byte"] == pytest.approx(beta_x)
    assert cal["inter_beta_one_way_s_per_byte"] == pytest.approx(beta_1)
    assert cal["inter_beta_shared_s_per_byte"] == pytest.approx(beta_x)  # bytes on a link add
    link = twolevel.link_from_calibration({**cal, "inter_gbps": 1.0})
    assert link.beta_at(4 * MiB) == pytest.approx(beta_x)
    assert link.beta_one_way_at(4 * MiB) == pytest.approx(beta_1)


@pytest.mark.timeout(10)
def test_any_schedule_can_be_priced():
    from allreduce.theory import Step
    n = 16 * MiB
    # the textbook schedules priced as lists of steps: the same as by name
    for algo in ALGOS:
        steps = allreduce_steps(algo, n, 4, 2)
        assert twolevel.steps_time(steps, 2, 2, HOST, GBIT) == pytest.approx(
            twolevel.cluster_allreduce_time(algo, n, 2, 2, HOST, GBIT))
    # a flat broadcast from rank 0 on 2 x 2: ranks 2 and 3 both take n through host 0's link
    flat = [Step([(0, 1, n), (0, 2, n), (0, 3, n)], exchange=False)]
    assert twolevel.steps_time(flat, 2, 2, FREE, GBIT) == pytest.approx(2 * n * 8e-9)
