"""GPU tier (e): the layout planner's machine at hand on a GPU (experiments.plan
--device cuda): the rate timed in every rank at once on the GPU they share, and
--verify running the best and the worst layouts with strategies.train --device
cuda, each measured beside its prediction.

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  Only the records' presence
and sense are checked: the figures are the card's (docs/planner.md).
"""
import json
import sys

import pytest

from conftest import check_ok, mpi_env, run

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no GPU: torch.cuda.is_available() is False")]


@pytest.mark.timeout(300)
def test_verify_on_ranks_sharing_the_gpu(tmp_path):
    (tmp_path / "calibration.json").write_text(json.dumps(
        {"alpha_s": 2e-5, "beta_s_per_byte": 2e-10, "gamma_s_per_byte": 1e-10}))
    out = tmp_path / "plan.jsonl"
    result = check_ok(run([sys.executable, "-m", "experiments.plan", "--layers", "2",
                           "--d-model", "64", "--heads", "2", "--seq-len", "32", "--vocab",
                           "64", "--global-batch", "8", "--calibration", tmp_path,
                           "--device", "cuda", "--gpus-per-node", "2", "--zero", "0,1",
                           "--micro-batch-sizes", "4", "--verify", "1", "--steps", "4",
                           "--jsonl", out], 280, mpi_env()))
    assert f"2 ranks on {torch.cuda.device_count()}" in result.stdout, result.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    checked = [r for r in rows if r["kind"] == "plan_verify"]
    assert len(checked) == 2 and all(r["measured_s"] > 0 and r["predicted_s"] > 0
                                     for r in checked), checked
    assert rows[0]["cluster_figures"]["overlaps"] is True     # MPI on the host, compute on the GPU
