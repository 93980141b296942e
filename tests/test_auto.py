"""allreduce's `auto`: its rules (tier a), one decision on every rank and bench
records that name the choice (tier c).  Across emulated hosts: tests/cluster/test_cluster_auto.py."""
import json

import pytest

from allreduce.auto import (NATIVE_BELOW, Layout, model_choice, model_rule, read_calibration,
                            table_choice)
from allreduce.costs import Machine
from allreduce.twolevel import cluster_allreduce_time, link_of_rate
from conftest import check_ok, mpirun

ONE_NODE = Layout([4])
TWO_NODES = Layout([2, 2])

# A calibration in experiments.calibrate's format: 20 us a step of ours, 8 us a
# bare exchange, 4 GB/s each way, adding at 10 GB/s.
CALIBRATION = {"alpha_s": 20e-6, "alpha_exchange_s": 8e-6, "beta_s_per_byte": 2.5e-10,
               "gamma_s_per_byte": 1e-10}
# The same hosts joined by links of 1 Gbit/s (8 ns a byte), as experiments.calibrate
# writes a link it measured across hosts (inter_*), here without latency or curves.
ACROSS_1GBIT = {**CALIBRATION, "inter_alpha_s": 0.0, "inter_beta_s_per_byte": 8e-9}


def test_layout_from_node_ids():
    assert Layout.from_node_ids([0, 0, 2, 2]).node_sizes == (2, 2)
    assert Layout.from_node_ids([0, 0, 2, 2]).multi_node
    assert not Layout.from_node_ids([0, 0, 0]).multi_node
    assert not Layout.from_node_ids([0, 1, 2]).multi_node       # a rank a node: one level
    mixed = Layout.from_node_ids([0, 1, 0, 1])                  # round-robin placement
    assert not mixed.consecutive and not mixed.multi_node       # hierarchical needs blocks


def test_table_takes_the_library_for_small_messages_and_the_ring_for_large():
    assert table_choice("allreduce", 4 << 10, ONE_NODE, "mpi") == "mpi"
    assert table_choice("allreduce", 4 << 10, ONE_NODE, None) == "halving_doubling"
    assert table_choice("allreduce", NATIVE_BELOW, ONE_NODE, "mpi") == "halving_doubling"
    assert table_choice("allreduce", 64 << 20, ONE_NODE, "mpi") == "ring"
    assert table_choice("allreduce", 64 << 20, TWO_NODES, "mpi") == "hierarchical"
    assert table_choice("reduce_scatter", 64 << 20, TWO_NODES, "mpi") == "ring"
    assert table_choice("broadcast", 256 << 10, ONE_NODE, None) == "tree"
    assert table_choice("allreduce", 64 << 20, Layout([1]), None) == "ring"


def test_cost_model_picks_the_least_predicted_time():
    # 4 ranks, 4 KiB: one bare exchange per round (the library) beats our steps
    assert model_choice("allreduce", 4 << 10, ONE_NODE, "mpi", CALIBRATION) == "mpi"
    # without the library, halving-doubling's 2 log P steps beat the ring's 2 (P - 1)
    assert model_choice("allreduce", 4 << 10, ONE_NODE, None, CALIBRATION) == \
        "halving_doubling"
    # 64 MiB: the library is no candidate, and the ring's bytes are the fewest (at
    # P = 4 halving-doubling's too, 2 alpha less: a tie, which goes to the ring)
    assert model_choice("allreduce", 64 << 20, ONE_NODE, "mpi", CALIBRATION) == "ring"
    assert model_choice("allreduce", 64 << 20, Layout([2]), "mpi", CALIBRATION) == "ring"
    assert model_choice("allreduce", 64 << 20, Layout([3]), "mpi", CALIBRATION) == "ring"


def test_on_several_hosts_the_two_level_model_decides():
    n = 16 << 20
    # The reference: the two-level model's own times on 2 hosts x 2 ranks at the
    # link's nominal rate.  Hierarchical crosses each link with n bytes, the ring with
    # 1.5 n: a clear win, not a tie.
    intra = Machine.from_calibration(CALIBRATION)
    times = {algo: cluster_allreduce_time(algo, n, 2, 2, intra, link_of_rate(1.0))
             for algo in ("ring", "tree", "halving_doubling", "hierarchical")}
    assert min(times, key=times.get) == "hierarchical"
    assert times["hierarchical"] < 0.8 * min(t for a, t in times.items() if a != "hierarchical")
    assert model_rule(TWO_NODES, ACROSS_1GBIT) == "two-level cost model"
    assert model_choice("allreduce", n, TWO_NODES, "mpi", ACROSS_1GBIT) == "hierarchical"
    # One host: the one-level choice, whatever the calibration says of a link.
    assert model_rule(ONE_NODE, ACROSS_1GBIT) == "cost model"
    assert model_choice("allreduce", n, ONE_NODE, "mpi", ACROSS_1GBIT) == \
        model_choice("allreduce", n, ONE_NODE, "mpi", CALIBRATION) == "ring"
    # Nodes declared on one host (ranks_per_node) have no link: the one-level model,
    # which prices hierarchical's extra steps at shared memory's speed, keeps the ring.
    declared = Layout([2, 2], hosts=False)
    assert model_rule(declared, ACROSS_1GBIT) == "cost model"
    assert model_choice("allreduce", n, declared, "mpi", ACROSS_1GBIT) == "ring"


def test_several_hosts_without_a_calibrated_link_go_by_the_table():
    # The one-level model would price the link as shared memory; the table knows better.
    for layout in (TWO_NODES, Layout([3, 1])):
        assert model_rule(layout, CALIBRATION) == "table"
        assert model_choice("allreduce", 64 << 20, layout, "mpi", CALIBRATION) == \
            table_choice("allreduce", 64 << 20, layout, "mpi")
    # uneven hosts: the two-level schedules assume R ranks on every host
    assert model_rule(Layout([3, 1]), ACROSS_1GBIT) == "table"
    assert model_rule(TWO_NODES, None) == "table"


def test_calibration_from_a_file_or_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(CALIBRATION))
    assert read_calibration(str(path)) == CALIBRATION
    monkeypatch.setenv("TOPOLAB_CALIBRATION", str(path))
    assert read_calibration(None) == CALIBRATION
    monkeypatch.delenv("TOPOLAB_CALIBRATION")
    assert read_calibration(None) is None
    with pytest.raises(Exception, match="cannot read the calibration"):
        read_calibration(str(tmp_path / "missing.json"))


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_every_rank_takes_the_same_algorithm(P, tmp_path):
    # Only rank 1 is given a calibration (one that favours other algorithms than
    # the table does): rank 0 decides, so the tables agree all the same.
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(CALIBRATION))
    result = check_ok(mpirun(P, ["tests/mpi/auto_agreement.py", path], timeout=100))
    assert f"same on {P} ranks" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_bench_records_name_the_chosen_algorithm(tmp_path):
    out = tmp_path / "bench.jsonl"
    result = check_ok(mpirun(2, ["-m", "allreduce.bench", "--algos", "mpi-raw,auto,ring",
                                 "--ops", "allreduce,reduce_scatter", "--sizes", "4K,4M",
                                 "--iters", "2", "--loop", "2", "--jsonl", out], timeout=180))
    # on one host the ring's all-reduces go by shm, in a buffer of auto.empty's
    assert "auto→mpi" in result.stdout and "auto→shm" in result.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 * 2 * 2
    by = {(r["algo"], r["op"], r["bytes"]): r for r in records}
    assert by[("auto→mpi", "allreduce", 4096)]["chosen"] == "mpi"
    assert by[("auto→shm", "allreduce", 4 << 20)]["chosen"] == "shm"
    ring = by[("auto→ring", "reduce_scatter", 4 << 20)]
    assert ring["chosen"] == "ring" and ring["sent_bytes"] == ring["theory_bytes"]
    # from 1 MiB every row carries its busbw as a fraction of memcpy's, printed too
    assert ring["busbw_of_memcpy"] > 0 and by[("auto→mpi", "allreduce", 4096)][
        "busbw_of_memcpy"] is None
    assert "busbw / memcpy" in result.stdout and "auto→ring" in result.stdout.split(
        "busbw / memcpy")[-1]
    for r in records:
        assert r["wrong"] == 0 and r["loop"] == 2, r
        assert r["vs_raw"] == pytest.approx(r["time_us"] / by[("mpi-raw", r["op"], r["bytes"])][
            "time_us"])


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_window_cost_times_both_paths_beside_the_private_ring():
    """allreduce.window_cost: its three rows, the last the unit of the ratios; bad
    flags and a world too small for shm are one line and exit 2, no traceback."""
    result = check_ok(mpirun(2, ["-m", "allreduce.window_cost", "--sizes", "64K", "--iters", "1",
                                 "--warmup", "0"], timeout=100))
    for row in ("shm in window", "ring in window", "ring private"):
        assert row in result.stdout, result.stdout
    assert "ring private" in result.stdout.splitlines()[-1] and "x1.00" in result.stdout
    bad = mpirun(2, ["-m", "allreduce.window_cost", "--iters", "0"], timeout=60)
    assert bad.returncode == 2 and "--iters must be >= 1" in bad.stderr, bad.stderr
    alone = mpirun(1, ["-m", "allreduce.window_cost", "--sizes", "64K"], timeout=60)
    assert alone.returncode == 2 and "shm needs 2 or more ranks" in alone.stderr, alone.stderr
    assert "Traceback" not in bad.stderr + alone.stderr
