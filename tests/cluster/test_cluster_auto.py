"""Tier (d): `auto` across 2 emulated hosts x 2 ranks at 2 Gbit/s (see conftest.py):
the layout MPI finds makes rank 0 price the candidates with the two-level model."""
import json

import pytest

from allreduce.auto import Layout, model_choice
from allreduce.costs import Machine
from allreduce.twolevel import cluster_allreduce_time, link_from_calibration
from conftest import check_ok, run

# A calibration as experiments.calibrate writes it on a cluster, its link at the
# fixture's 2 Gbit/s (4 ns a byte); made up, so the test takes seconds.
CALIBRATION = {"alpha_s": 20e-6, "alpha_exchange_s": 8e-6, "beta_s_per_byte": 2.5e-10,
               "gamma_s_per_byte": 1e-10, "inter_alpha_s": 0.1e-3,
               "inter_beta_s_per_byte": 4e-9}
SIZES = (4, 16 << 20)


@pytest.mark.timeout(120)
def test_auto_across_hosts_matches_the_reference_and_takes_the_two_level_choice(cluster,
                                                                                tmp_path):
    cal, out = tmp_path / "cal.json", tmp_path / "bench.jsonl"
    cal.write_text(json.dumps(CALIBRATION))
    # auto reads TOPOLAB_CALIBRATION on rank 0, mpiexec hands the variable to every rank.
    # The mpi row goes first: the cluster tool then counts no link bytes for the job,
    # which it cannot for auto either (its schedule is chosen per call).
    check_ok(run(cluster.command("run", "--", "allreduce.bench", "--algos", "mpi,auto", "--ops",
                                 "allreduce", "--sizes", ",".join(map(str, SIZES)),
                                 "--iters", 1, "--warmup", 0, "--jsonl", out),
                 100, env={**cluster.env, "TOPOLAB_CALIBRATION": str(cal)}))
    rows = {r["bytes"]: r for r in map(json.loads, open(out))
            if r.get("kind") != "wire" and r["algo"].startswith("auto")}
    assert sorted(rows) == list(SIZES)
    for size, r in rows.items():
        assert r["wrong"] == 0, r                       # checked against each rank's reference
        assert r["chosen"] == model_choice("allreduce", size, Layout([2, 2]), "mpi", CALIBRATION)
    # 16 MiB: the two-level model's times themselves favour hierarchical (it crosses
    # each link with n bytes, the ring with 1.5 n), and auto took it
    intra, link = Machine.from_calibration(CALIBRATION), link_from_calibration(CALIBRATION)
    times = {algo: cluster_allreduce_time(algo, 16 << 20, 2, 2, intra, link)
             for algo in ("ring", "tree", "halving_doubling", "hierarchical")}
    assert min(times, key=times.get) == "hierarchical"
    assert rows[16 << 20]["chosen"] == "hierarchical"
