"""GPU tier (c): the grid and the experts with --device cuda reproduce --device cpu.

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  Every rank shares one GPU
over --sync ring (MPI, not CUDA-aware here): the collectives of the dp, tp and
expert axes go through pinned host memory (allreduce.HostStaged) and so do the
pipeline's activations and gradients (allreduce.HostStagedTransport), each decided
in one place, strategies/sync/gradient_sync.py's for_device.  Each layout trains
on the CPU and on the GPU in the same launch, and the two must agree.

Tolerance: rtol 1e-4, atol 1e-5 on every loss and final parameter after 3 steps,
as tests/gpu/test_cuda_syncs.py allows and for its reason (cuBLAS and the CPU's
BLAS sum a product's inner dimension in different orders; TF32 is off).  fp16
computes in 16 bit on both, where the kernels' orders move a loss by ~1e-3
relative: rtol 1e-2 there, and the same skipped steps.  A real fault (an
activation received as zeros, a shard copied back to the wrong place, an
all-to-all's blocks misplaced) moves values by O(lr * grad) ~ 1e-2 or more.
The staging itself, bit for bit with CPU tensors standing for CUDA ones:
tests/test_cuda_grid.py.
"""
import json

import numpy as np
import pytest

from conftest import check_ok, mpirun
from test_train_runs import SEVERAL, read_records

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no GPU: torch.cuda.is_available() is False")]
RTOL, ATOL = 1e-4, 1e-5
COMMON = ["--steps", "3", "--threads", "1", "--no-progress", "--sync", "ring",
          "--lr", "0.05", "--momentum", "0.9", "--dataset-size", "64", "--global-batch", "8"]
MLP = ["--model", "mlp", "--width", "32", "--depth", "2", "--in-dim", "8", "--classes", "4"]
GPT = ["--model", "gpt", "--layers", "2", "--d-model", "16", "--heads", "2", "--vocab", "12",
       "--seq-len", "8"]
MOE = ["--model", "moe", "--experts", "4", "--layers", "2", "--d-model", "16", "--heads", "2",
       "--vocab", "12", "--seq-len", "8", "--top-k", "2", "--capacity-factor", "1.0"]


def on_both(tmp_path, nprocs, layouts):
    """Train each (name, flags) on the CPU and on the GPU in one launch:
    {name: {device: (step records, final parameters)}}."""
    argvs, names = [], []
    for name, flags in layouts:
        for device in ("cpu", "cuda"):
            out = tmp_path / f"{name}-{device}"
            argvs.append([str(a) for a in COMMON + flags + [
                "--device", device, "--jsonl", f"{out}.jsonl", "--params-out", f"{out}.npz"]])
            names.append((name, device, out))
    check_ok(mpirun(nprocs, SEVERAL + [json.dumps(argvs)], timeout=240, NVIDIA_TF32_OVERRIDE=0))
    got = {}
    for name, device, out in names:
        got.setdefault(name, {})[device] = (read_records(f"{out}.jsonl"),
                                            dict(np.load(f"{out}.npz")))
    return got


def assert_close(runs, name, rtol=RTOL, atol=ATOL):
    (records, params), (cpu_records, cpu_params) = runs["cuda"], runs["cpu"]
    loss = sorted((r["rank"], r["step"], r["loss"]) for r in records if r.get("loss") is not None)
    cpu_loss = sorted((r["rank"], r["step"], r["loss"]) for r in cpu_records
                      if r.get("loss") is not None)
    assert [k[:2] for k in loss] == [k[:2] for k in cpu_loss] and loss, name
    np.testing.assert_allclose([k[2] for k in loss], [k[2] for k in cpu_loss], rtol=rtol,
                               atol=atol, err_msg=name)
    assert sorted(params) == sorted(cpu_params), name
    for key in cpu_params:
        np.testing.assert_allclose(params[key], cpu_params[key], rtol=rtol, atol=atol,
                                   err_msg=f"{name}: {key}")


@pytest.mark.timeout(300)
def test_four_ranks_on_one_gpu_reproduce_the_cpu(tmp_path):
    """dp2 x pp2 under ZeRO-1 (activations and their gradients staged between stages,
    the dp shards' reduce-scatters and gathers); dp2 x tp2 with sequence parallelism
    under ZeRO-2 (the tp axis's all-reduces, all-gathers and reduce-scatters)."""
    got = on_both(tmp_path, 4, [
        ("dp2_pp2_zero1", MLP + ["--dp", "2", "--pp", "2", "--micro-batches", "2",
                                 "--zero", "1"]),
        ("dp2_tp2_sp_zero2", GPT + ["--dp", "2", "--tp", "2", "--sequence-parallel",
                                    "--zero", "2"])])
    for name, runs in got.items():
        assert_close(runs, name)


@pytest.mark.timeout(300)
def test_two_ranks_on_one_gpu_reproduce_the_cpu(tmp_path):
    """ZeRO-3 (each layer gathered on the device before its forward and backward; its
    checkpoint written from host copies), fp16 under ZeRO-2 (the ranks' vote on the
    device's overflow flag: both skip step 0, then step), and the experts'
    all-to-alls under ZeRO-1."""
    saved = tmp_path / "checkpoints"      # written by the CPU run, then by the GPU's
    got = on_both(tmp_path, 2, [
        ("zero3", MLP + ["--zero", "3", "--checkpoint-dir", saved]),
        # step 0 overflows at a scale above ~9e4 (measured on the CPU: 85000 does not,
        # 95000 does), so 1.3e5 skips it and its half, 6.5e4, steps, with room either side
        ("fp16_zero2", GPT + ["--zero", "2", "--precision", "fp16", "--loss-scale", "1.3e5"]),
        ("moe_ep2_zero1", MOE + ["--ep", "2", "--zero", "1"])])
    assert_close(got["zero3"], "zero3")
    for rank in range(2):               # the GPU run's shards, masters, optimizer: host copies
        where = []
        last = max(saved.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        torch.load(last / f"rank-{rank}.pt", weights_only=True,
                   map_location=lambda storage, location: where.append(location) or storage)
        assert where and set(where) == {"cpu"}, (rank, set(where))
    assert_close(got["moe_ep2_zero1"], "moe_ep2_zero1")
    assert_close(got["fp16_zero2"], "fp16_zero2", rtol=1e-2, atol=1e-3)
    skips = {device: sorted((r["rank"], r["step"], r["overflow_skips"]) for r in records)
             for device, (records, _) in got["fp16_zero2"].items()}
    assert skips["cuda"] == skips["cpu"] == [(r, s, 1) for r in range(2) for s in range(3)]
