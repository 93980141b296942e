"""GPU tier (b): collectives on CUDA tensors, and the benchmark on a GPU.

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  NCCL (transport "torch")
needs a GPU per rank, so its cases run at as many ranks as there are GPUs, up
to 3; the MPI transports move CUDA tensors through pinned host memory
(allreduce.host_staged), and their ranks may share one GPU; made for the GPU
(allreduce.create(..., device=)), the textbook algorithms hand them over device
to device between the ranks that share it (allreduce/cuda_ipc.py).

The collectives are checked by tests/mpi/collectives_matrix.py (inputs that
depend on rank and position, a float64 reference every rank computes alone,
tolerance P * eps * 4P for sums, exact for the rest) with "device": "cuda",
which checks every torch dtype.
"""
import json

import pytest

from conftest import check_ok, mpirun

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no GPU: torch.cuda.is_available() is False")]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NCCL_RANKS = [p for p in (1, 2, 3) if p <= GPUS]

CUDA = {"device": "cuda"}
STAGED = [{"algo": a, **CUDA} for a in ("ring", "tree", "halving_doubling", "mpi")] + [
    {"algo": "hierarchical", **CUDA, "options": {"ranks_per_node": 2}},
    {"algo": "ring", **CUDA, "split": "reversed"}]
# made for the GPU: device to device through CUDA IPC, since the ranks share it
IPC = [{"algo": a, **CUDA, "ipc": True} for a in ("ring", "tree", "halving_doubling")] + [
    {"algo": "ring", **CUDA, "ipc": True, "split": "reversed"}]
NCCL = [{"algo": a, "transport": "torch", **CUDA}
        for a in ("ring", "tree", "halving_doubling")] + [
    {"algo": "hierarchical", "transport": "torch", **CUDA, "options": {"ranks_per_node": 2}},
    {"algo": "torch", **CUDA},
    {"algo": "ring", "transport": "torch", **CUDA, "split": "reversed"},
    {"algo": "torch", **CUDA, "split": "parity"}]


def matrix(nprocs, specs):
    result = check_ok(mpirun(nprocs, ["tests/mpi/collectives_matrix.py", json.dumps(specs)],
                             timeout=400))
    assert f"OK P={nprocs}" in result.stdout
    assert result.stdout.count("checked ") == len(specs)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_mpi_transports_stage_cuda_tensors_through_the_host(nprocs):
    matrix(nprocs, STAGED)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_ranks_sharing_the_gpu_move_cuda_tensors_device_to_device(nprocs):
    matrix(nprocs, IPC)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_nccl_collectives_match_the_reference(nprocs):
    if nprocs not in NCCL_RANKS:
        pytest.skip(f"NCCL needs a GPU per rank: {nprocs} ranks, {GPUS} GPU(s)")
    matrix(nprocs, NCCL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["mpi", "torch"])
def test_bench_on_cuda_has_nccl_as_the_baseline_row(tmp_path, transport):
    """The torch row (NCCL's all-reduce) is added even where --algos leaves it out."""
    nprocs = max(NCCL_RANKS)            # the NCCL row needs a GPU per rank
    out = tmp_path / "bench.jsonl"
    algos = "ring,mpi" if transport == "mpi" else "ring,tree"
    check_ok(mpirun(nprocs, ["-m", "allreduce.bench", "--device", "cuda", "--algos", algos,
                             "--transport", transport, "--sizes", "4K,1M", "--iters", "3",
                             "--jsonl", out], timeout=280))
    records = [json.loads(line) for line in open(out)]
    assert {r["algo"] for r in records} >= {"ring", "torch"}       # torch: added as the bar
    assert all(r["device"] == "cuda" and r["wrong"] == 0 for r in records)
    assert all(r["world_size"] == nprocs for r in records)
    # NCCL moves its own; MPI takes them direct where CUDA-aware, else staged
    assert {r["cuda_path"] for r in records if r["transport"] == "torch"} == {"direct"}
    assert {r["cuda_path"] for r in records} <= {"direct", "ipc", "staged"}


@pytest.mark.timeout(300)
def test_bench_with_more_ranks_than_gpus_leaves_the_nccl_row_out(tmp_path):
    """NCCL would fail ("Duplicate GPU detected"); the MPI rows may share a GPU."""
    nprocs = GPUS + 1
    out = tmp_path / "bench.jsonl"
    result = check_ok(mpirun(nprocs, ["-m", "allreduce.bench", "--device", "cuda", "--algos",
                                      "ring,mpi", "--sizes", "4K,1M", "--iters", "3",
                                      "--jsonl", out], timeout=280))
    notes = [ln for ln in result.stdout.splitlines() if ln.startswith("# no torch (NCCL) row:")]
    assert len(notes) == 1 and "NCCL needs a GPU per rank" in notes[0]
    assert any(ln.startswith("# CUDA buffers: ") for ln in result.stdout.splitlines())
    records = [json.loads(line) for line in open(out)]
    assert {r["algo"] for r in records} == {"ring", "mpi"}
    assert all(r["wrong"] == 0 and r["world_size"] == nprocs for r in records)
