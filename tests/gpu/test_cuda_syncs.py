"""GPU tier (c): every --sync with --device cuda reproduces --sync local on the CPU.

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  Ranks of the MPI syncs may
share one GPU (their buffers travel through pinned host memory); NCCL (--sync
torch) needs a GPU per rank, so its runs are skipped where there are fewer.

Tolerance: rtol 1e-4, atol 1e-5 on every loss and final parameter after 5
steps (tests/test_train_runs.py allows 1e-5 / 1e-6 between CPU runs).  Besides
the order of the collective's additions, the GPU's kernels sum in an order of
their own (cuBLAS splits a matrix product's inner dimension differently from
the CPU's BLAS), a few ulps (6e-8 relative) per operation; TF32 is off
(NVIDIA_TF32_OVERRIDE=0), so every product is a float32 one.  A real fault
(gradients not averaged, a bucket copied back to the wrong place, parameters
not broadcast) moves values by O(lr * grad) ~ 1e-2, far outside.
"""
import json

import numpy as np
import pytest

from conftest import check_ok, mpirun
from test_train_runs import SEVERAL, TINY, read_records

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no GPU: torch.cuda.is_available() is False")]
RTOL, ATOL = 1e-4, 1e-5
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def train(tmp_path, nprocs, runs, timeout=300):
    """Train each (name, flags) in one launch; {name: (step records, final parameters)}."""
    argvs = [[str(a) for a in TINY + flags + ["--jsonl", tmp_path / f"{name}.jsonl",
                                              "--params-out", tmp_path / f"{name}.npz"]]
             for name, flags in runs]
    check_ok(mpirun(nprocs, SEVERAL + [json.dumps(argvs)], timeout=timeout,
                    NVIDIA_TF32_OVERRIDE=0))
    return {name: (read_records(tmp_path / f"{name}.jsonl"),
                   dict(np.load(tmp_path / f"{name}.npz"))) for name, _ in runs}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("cpu"), 1, [("local", ["--sync", "local"])])["local"]


def assert_close(run, reference, workers, what):
    (records, params), (ref_records, ref_params) = run, reference
    ref_loss = [r["loss"] for r in ref_records]
    for rank in range(workers):
        mine = [r["loss"] for r in records if r["rank"] == rank]
        np.testing.assert_allclose(mine, ref_loss, rtol=RTOL, atol=ATOL, err_msg=what)
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: {name}")


CUDA = ["--device", "cuda"]
MPI_SYNCS = [("ring", []), ("tree", []), ("halving_doubling", []),
             ("hierarchical", ["--ranks-per-node", "1"]), ("mpi", [])]


@pytest.mark.timeout(400)
def test_mpi_syncs_on_cuda_reproduce_one_cpu_process(tmp_path, reference):
    """Two ranks (one GPU is enough): the setup broadcast and the buckets, with and
    without overlap and with fp16 on the wire, through the host staging."""
    runs = [(sync, ["--sync", sync] + extra + CUDA) for sync, extra in MPI_SYNCS]
    runs.append(("ring_no_overlap", ["--sync", "ring", "--no-overlap"] + CUDA))
    got = train(tmp_path, 2, runs + [("fp16", ["--sync", "ring", "--compress", "fp16"] + CUDA)])
    for name, _ in runs:
        assert_close(got[name], reference, 2, name)
    fp16_loss = [r["loss"] for r in got["fp16"][0] if r["rank"] == 0]
    np.testing.assert_allclose(fp16_loss, [r["loss"] for r in reference[0]], rtol=1e-2)


@pytest.mark.timeout(400)
def test_parameter_server_syncs_on_cuda_reproduce_one_cpu_process(tmp_path, reference):
    """Two workers on the GPU and one server (BSP): the servers average, so
    ps and hybrid (nodes of one worker) must give the one-process step."""
    got = train(tmp_path, 3, [
        ("ps", ["--sync", "ps", "--servers", "1"] + CUDA),
        ("hybrid", ["--sync", "hybrid", "--servers", "1", "--ranks-per-node", "1"] + CUDA)])
    for name in ("ps", "hybrid"):
        assert_close(got[name], reference, 2, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", [1, 2])
def test_torch_sync_on_cuda_reproduces_one_cpu_process(tmp_path, reference, nprocs):
    """NCCL: one GPU per rank."""
    if GPUS < nprocs:
        pytest.skip(f"NCCL needs a GPU per rank: {nprocs} ranks, {GPUS} GPU(s)")
    got = train(tmp_path, nprocs, [("torch", ["--sync", "torch"] + CUDA)])
    assert_close(got["torch"], reference, nprocs, "torch")
