"""--precision fp8 (strategies/runtime/fp8_linear.py): the linear layers through torch._scaled_mm.

Tier (a): one fp8 linear layer's output and gradients against fp32's, within the
formats' rounding.  A value t scaled by s = FP8_MAX / amax and cast is off by at
most u |t| + eta, where u = 2^-(mantissa bits + 1) is round-to-nearest's relative
error (e4m3: 2^-4, e5m2: 2^-3) and eta = half the subnormal spacing / s, for the
values that land below the format's smallest normal (e4m3: 2^-10 / s, e5m2:
2^-17 / s).  A product's error is then, entry by entry,

    |sum_k a_k b_k - sum_k a'_k b'_k| <= sum_k (e_a |b| + |a| e_b + e_a e_b)_k

with e = u |t| + eta for each operand; the bound below adds 1e-5 relative for
fp32's own accumulation.  The swap keeps the module objects, their parameters and
names; an older GPU is refused with its name.

Tier (c), two ranks, 30 steps of the small GPT (Adam): --sync ring --precision fp8
ends within 5 % of fp32's final loss (FINAL_RTOL; measured 1.1 % for one process),
while a run that did not train stays near its first loss, 30-50 % above; the grid's
--tp 2 --sequence-parallel and --dp 2 --zero 1 under fp8 train and end within the
same 5 %, and ZeRO-1's ranks hold memory.zero_memory's fp8 states (bf16's).  The
record's config says the precision.
"""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import check_ok, mpirun
from strategies.config.choices import ConfigError
from strategies.config.settings import TrainConfig
from strategies.runtime import fp8_linear
from strategies.runtime.fp8_linear import E4M3, E5M2, FP8_MAX, Fp8Linear, to_fp8
from strategies.runtime.memory import zero_memory
from test_parallel_runs import COMMON, GPT, SEVERAL

STEPS = 30
FINAL_RTOL = 0.05
SUBNORMAL_HALF_SPACING = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}


# ------------------------------------------------------------------- tier (a)
def rounding(t, fp8):
    """e = u |t| + eta, the largest error of t's fp8 copy, entry by entry (the docstring)."""
    u = 2.0 ** -(fp8_linear.MANTISSA_BITS[fp8] + 1)
    eta = SUBNORMAL_HALF_SPACING[fp8] * t.abs().max() / FP8_MAX[fp8]
    return u * t.abs() + eta


def product_bound(a, e_a, b, e_b):
    """The bound on |a b^T - a' b'^T| of a (M x K) and b (N x K), entry by entry."""
    return e_a @ b.abs().t() + a.abs() @ e_b.t() + e_a @ e_b.t() + 1e-5 * (a.abs() @ b.abs().t())


def test_an_fp8_linear_is_fp32s_within_the_formats_rounding():
    torch.manual_seed(0)
    # K = 40, N = 24 not multiples of 16 (padded); magnitudes over three decades
    x = (torch.randn(3, 5, 40) * torch.logspace(-2, 1, 40)).requires_grad_()
    layer = nn.Linear(40, 24)
    fp8 = Fp8Linear(40, 24)
    fp8.load_state_dict(layer.state_dict())
    dy = torch.randn(3, 5, 24)
    y = fp8(x)
    y.backward(dy)
    xf = x.detach().clone().requires_grad_()
    layer(xf).backward(dy)

    x2, w, dy2 = xf.detach().reshape(-1, 40), layer.weight.detach(), dy.reshape(-1, 24)
    e_x, e_w, e_dy = rounding(x2, E4M3), rounding(w, E4M3), rounding(dy2, E5M2)
    # forward: x and W in e4m3; dx = dy W (dy e5m2, W e4m3); dW = dy^T x (dy e5m2, x e4m3)
    checks = [
        ("y", y.detach().reshape(-1, 24), F.linear(x2, w, layer.bias.detach()),
         product_bound(x2, e_x, w, e_w)),
        ("dx", x.grad.reshape(-1, 40), xf.grad.reshape(-1, 40),
         product_bound(dy2, e_dy, w.t(), e_w.t())),
        ("dW", fp8.weight.grad, layer.weight.grad,
         product_bound(dy2.t(), e_dy.t(), x2.t(), e_x.t())),
    ]
    for name, got, want, bound in checks:
        err = (got - want).abs()
        assert (err <= bound).all(), (name, (err - bound).max().item())
        assert err.max() > 0, name                # it did round: fp8 was used
    torch.testing.assert_close(fp8.bias.grad, layer.bias.grad)   # a sum of dy, in fp32
    assert fp8.weight.grad.dtype == torch.float32                 # onto the fp32 master


def test_under_autocast_the_output_is_bf16_and_the_gradients_the_masters_dtype():
    layer = Fp8Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == layer.weight.grad.dtype == torch.float32


def test_the_swap_keeps_modules_parameters_and_names():
    from strategies.model.models import GPT as GPTModel
    model = GPTModel(vocab=12, seq_len=8, d_model=16, heads=2, layers=2)
    before = dict(model.named_parameters())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    to_fp8(model)
    assert all(type(m) is Fp8Linear for m in linears) and linears
    assert {n: id(p) for n, p in model.named_parameters()} == \
        {n: id(p) for n, p in before.items()}
    assert not any(type(m) is nn.Linear for m in model.modules())


def test_tensor_parallel_layers_take_the_function_of_the_linear_they_cut():
    from strategies.parallel.tensor_parallel import ColumnParallelLinear, TensorParallel
    tp = TensorParallel(None, 0, 1)
    assert ColumnParallelLinear(to_fp8(nn.Linear(8, 4)), tp, [(0, 4)]).linear is \
        fp8_linear.fp8_linear
    assert ColumnParallelLinear(nn.Linear(8, 4), tp, [(0, 4)]).linear is F.linear


def test_an_older_gpu_is_refused_with_its_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8.9 .* NVIDIA A100 is 8.0"):
        fp8_linear.check_device(torch.device("cuda", 0))
    fp8_linear.check_device(torch.device("cpu"))       # this torch multiplies fp8 on the CPU


def test_fp8_is_taken_with_every_split():
    for fields in (dict(sync="ring", dp=2, zero=1), dict(sync="ring", model="gpt", tp=2),
                   dict(sync="ring", model="moe", ep=2), dict(sync="ps"),
                   dict(sync="ring", model="gpt", pp=2, micro_batches=2)):
        assert TrainConfig(precision="fp8", **fields).precision == "fp8"


# ------------------------------------------------------------------- tier (c)
SMALL_GPT = GPT[:-4] + ["--optimizer", "adam", "--lr", "0.01"]


def final_loss(records):
    return [r for r in records if r["kind"] == "summary"][0]["final_loss"]


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_two_ranks_fp8_train_within_five_percent_of_fp32(tmp_path):
    runs = [("fp32", ["--sync", "ring"]),
            ("fp8", ["--sync", "ring", "--precision", "fp8"]),
            ("tp", ["--sync", "ring", "--tp", "2", "--sequence-parallel", "--precision", "fp8"]),
            ("zero", ["--sync", "ring", "--dp", "2", "--zero", "1", "--precision", "fp8"])]
    argvs = [COMMON[2:] + SMALL_GPT + ["--steps", str(STEPS)] + flags +
             ["--jsonl", str(tmp_path / f"{name}.jsonl")] for name, flags in runs]
    check_ok(mpirun(2, SEVERAL + [json.dumps(argvs)], timeout=220))
    records = {name: [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
               for name, _ in runs}
    fp32 = final_loss(records["fp32"])
    first = [r for r in records["fp32"] if r["kind"] == "step"][0]["loss"]
    assert fp32 < 0.8 * first, (first, fp32)                  # the reference trains
    for name in ("fp8", "tp", "zero"):
        assert final_loss(records[name]) == pytest.approx(fp32, rel=FINAL_RTOL), name
        config = [r for r in records[name] if r["kind"] == "config"][0]
        assert config["precision"] == "fp8", name
    # ZeRO-1 under fp8 holds zero_memory's fp8 states, bf16's: 2 + 2 + 12 / 2 bytes a
    # parameter, Ψ read off the 16-bit parameters (Adam's step counters are the rest)
    steps = [r for r in records["zero"] if r["kind"] == "step"]
    want = zero_memory(steps[0]["memory"]["params"] / 2, 2, 1, "fp8")
    for r in steps:
        assert {part: r["memory"][part] for part in want} == pytest.approx(want, rel=0.01)


def test_a_mixture_of_experts_keeps_its_router_wide():
    from strategies.model.moe import MoE
    layer = to_fp8(MoE(16, 4, top_k=2, capacity_factor=1.0, group_size=0, balance_coef=0.01))
    assert type(layer.gate) is nn.Linear
    assert all(type(m) is Fp8Linear for e in layer.experts.values()
               for m in e.modules() if isinstance(m, nn.Linear))
