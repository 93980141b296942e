"""GPU tier (e): the layout planner's machine at hand on a GPU (experiments.plan
--device cuda): the rate timed in every rank at once on the GPU they share, and
--verify running the best and the worst layouts with strategies.train --device
cuda, each measured beside its prediction.

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  Only the records' presence
and sense are checked: the figures are the card's (docs/planner.md).
"""
import pytest

from test_plan import verify_on_two_ranks

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no GPU: torch.cuda.is_available() is False")]


@pytest.mark.timeout(300)
def test_verify_on_ranks_sharing_the_gpu(tmp_path):
    stdout, rows = verify_on_two_ranks(tmp_path, ["--d-model", "64", "--seq-len", "32",
                                                  "--vocab", "64", "--steps", "4",
                                                  "--device", "cuda"], timeout=280)
    assert f"2 ranks on {torch.cuda.device_count()}" in stdout, stdout
    assert rows[0]["cluster_figures"]["overlaps"] is True     # MPI on the host, compute on the GPU
    # the links inside the node: the trainer's ring between ranks on the GPU, timed
    assert rows[0]["cluster_figures"]["intra_latency_us"] > 0
