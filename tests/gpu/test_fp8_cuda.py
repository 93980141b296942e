"""GPU tier: --precision fp8 on CUDA (strategies/runtime/fp8_linear.py), as
tests/test_fp8_linear.py checks it on the CPU.

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  On a GPU of compute capability
8.9 or later (Ada, Hopper) cuBLASLt multiplies the fp8 operands: one layer's output
and gradients on the GPU agree with the same layer's on the CPU: both quantize the
same values alike (an amax is exact, the scale and the cast are the same
arithmetic), only the matmuls' sums run in other orders and, on the tensor cores,
with fewer accumulator bits; the bound allows an operand's whole fp8 step (2^-3
relative for e4m3, 2^-2 where an e5m2 gradient is in it) of the product's sum of
magnitudes, far more than that, and far less than a wrong scale or layout.  Two
ranks sharing the GPU, --sync ring, the small GPT for 30 steps end within 5 % of
fp32's final loss, and so does --tp 2.  On an older GPU the run is refused before
training, in one line naming the GPU.
"""
import json

import pytest

from conftest import mpirun
from test_train_runs import SEVERAL

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no GPU: torch.cuda.is_available() is False")
FINAL_RTOL = 0.05
STEPS = 30
COMMON = ["--threads", "1", "--no-progress", "--steps", str(STEPS), "--device", "cuda",
          "--model", "gpt", "--layers", "2", "--d-model", "16", "--heads", "2", "--vocab", "12",
          "--seq-len", "8", "--dataset-size", "120", "--global-batch", "8",
          "--optimizer", "adam", "--lr", "0.01", "--sync", "ring"]


def takes_fp8():
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.timeout(120)
def test_an_fp8_linear_on_the_gpu_is_the_cpus_within_one_rounding():
    if not takes_fp8():
        pytest.skip(f"{torch.cuda.get_device_name()} has no fp8 matmul (needs 8.9)")
    from strategies.runtime.fp8_linear import Fp8Linear
    torch.manual_seed(0)
    layer = Fp8Linear(40, 24)
    x = torch.randn(15, 40) * torch.logspace(-2, 1, 40)
    dy = torch.randn(15, 24)
    got = {}
    for device in ("cpu", "cuda"):
        on = Fp8Linear(40, 24).to(device)
        on.load_state_dict(layer.state_dict())
        xd = x.to(device).requires_grad_()
        y = on(xd)
        y.backward(dy.to(device))
        got[device] = [t.detach().cpu() for t in (y, xd.grad, on.weight.grad)]
    sums = [x.abs() @ layer.weight.detach().abs().t(), dy.abs() @ layer.weight.detach().abs(),
            dy.abs().t() @ x.abs()]
    for name, cpu, cuda, total, step in zip(("y", "dx", "dW"), got["cpu"], got["cuda"],
                                            sums, (2.0 ** -3, 2.0 ** -2, 2.0 ** -2)):
        assert ((cpu - cuda).abs() <= step * total + 1e-5).all(), name


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_two_ranks_on_the_gpu_train_fp8_within_five_percent_of_fp32(tmp_path):
    runs = [("fp32", []), ("fp8", ["--precision", "fp8"]),
            ("tp", ["--tp", "2", "--precision", "fp8"])]
    argvs = [COMMON + flags + ["--jsonl", str(tmp_path / f"{name}.jsonl")]
             for name, flags in runs]
    result = mpirun(2, SEVERAL + [json.dumps(argvs)], timeout=280, NVIDIA_TF32_OVERRIDE=0)
    if not takes_fp8():                 # refused before training, naming the GPU
        assert "compute capability 8.9" in result.stdout + result.stderr
        assert torch.cuda.get_device_name() in result.stdout + result.stderr
        return
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    records = {name: [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
               for name, _ in runs}

    def final(name):
        return [r for r in records[name] if r["kind"] == "summary"][0]["final_loss"]
    for name in ("fp8", "tp"):
        assert final(name) == pytest.approx(final("fp32"), rel=FINAL_RTOL), name
        config = [r for r in records[name] if r["kind"] == "config"][0]
        assert config["precision"] == "fp8" and config["device"] == "cuda"
