"""Tier (d): `allreduce.bench --predict` across 2 emulated hosts x 2 ranks (see conftest.py):
every all-reduce row carries the two-level model's time for the layout MPI finds."""
import json

import pytest

from allreduce import costs, twolevel

# A calibration as experiments.calibrate writes it on a cluster (inter_* for the link);
# made up, so the test takes seconds: what is checked is the plumbing, not the figures.
CALIBRATION = {"alpha_s": 30e-6, "beta_s_per_byte": 0.5e-9, "gamma_s_per_byte": 0.2e-9,
               "inter_alpha_s": 0.3e-3, "inter_beta_s_per_byte": 4.2e-9, "inter_gbps": 2.0,
               "inter_beta_bytes": [1 << 20, 16 << 20],
               "inter_beta_s_per_byte_at": [4.4e-9, 4.2e-9],
               "inter_beta_one_way_s_per_byte_at": [4.1e-9, 4.0e-9]}


@pytest.mark.timeout(120)
def test_predict_rows_carry_the_two_level_models_time(cluster, tmp_path):
    cal, out = tmp_path / "cal.json", tmp_path / "bench.jsonl"
    cal.write_text(json.dumps(CALIBRATION))
    result = cluster.job("allreduce.bench", "--algos", "ring,hierarchical,tree,mpi", "--sizes",
                         "1M", "--iters", 1, "--warmup", 0, "--predict", cal, "--jsonl", out)
    assert "predicted" in result.stdout
    rows = {r["algo"]: r for r in map(json.loads, open(out)) if r.get("kind") != "wire"}
    assert set(rows) == {"ring", "hierarchical", "tree", "mpi"}
    intra, link = costs.Machine.from_calibration(CALIBRATION), \
        twolevel.link_from_calibration(CALIBRATION)
    for algo in ("ring", "hierarchical", "tree"):
        # MPI's shared-memory split found 2 hosts of 2 ranks: the model's time for that layout
        want = twolevel.cluster_allreduce_time(algo, 1 << 20, 2, 2, intra, link) * 1e6
        assert rows[algo]["predicted_us"] == pytest.approx(want), algo
    assert rows["mpi"]["predicted_us"] is None                  # the library's own schedule
