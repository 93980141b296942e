"""fp16's loss scale kept on the device (strategies/runtime/loss_scaling.py), tier (a).

The device's path (DeviceLossScaler, SkipWhereFound) runs here on CPU tensors,
which stand for CUDA ones: the same kernels (torch._amp_*), the same masks.
It must train exactly as the host's path (LossScaler), bit for bit, with the
same records, whichever optimizer steps; and on the common path it must not
read a tensor on the host, which on a GPU would wait for backward to finish.
A host read is counted by patching the Tensor methods that make one.
"""
import math
import sys

import pytest
import torch

from strategies.runtime.loss_scaling import DeviceLossScaler, LossScaler
from strategies.runtime.precision import MixedPrecision, any_rank, any_rank_of

INF, NAN = float("inf"), float("nan")


def test_the_device_scaler_follows_the_host_rule():
    host, device = LossScaler(8.0, window=3), DeviceLossScaler(8.0, window=3)
    for overflow in [True, False, False, False, False, True, True, False, False, False]:
        host.update(overflow)
        device.update(torch.tensor([float(overflow)]))
        assert device.snapshot() == host.snapshot(), overflow
    device.restore({"scale": 0.5, "clean_steps": 2, "overflow_skips": 7})
    assert (device.scale, device.clean_steps, device.overflow_skips) == (0.5, 2, 7)


def test_unscaling_flags_an_inf_or_a_nan_in_any_dtype():
    device = DeviceLossScaler(4.0)
    grads = [torch.tensor([4.0, 8.0]), None, torch.tensor([2.0], dtype=torch.float64)]
    assert device.unscale(grads).tolist() == [0.0]
    assert grads[0].tolist() == [1.0, 2.0] and grads[2].tolist() == [0.5]
    for bad in (INF, NAN):
        assert device.unscale([torch.tensor([1.0]), torch.tensor([bad])]).tolist() == [1.0]


class CountingOptimizer(torch.optim.SGD):
    """Plain SGD keeping a Python number in its state: the state the device cannot mask."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["taken"] = self.state[p].get("taken", 0) + 1


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "fused-adam": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "fused-sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),     # the GPU's, by default
    "host-state": lambda ps: CountingOptimizer(ps, lr=0.1),
}


def train(make_optimizer, on_device, poisoned=(0, 1, 5), steps=9):
    """Steps of a small model under fp16's scaling; a gradient set to inf or NaN at
    `poisoned` steps.  Returns everything a step leaves behind."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = make_optimizer(model.parameters())
    precision = MixedPrecision("fp16", loss_scale=1024.0, loss_scale_window=2,
                               on_device=on_device)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    stepped, records = [], []
    for step in range(steps):
        optimizer.zero_grad()
        precision.backward(torch.nn.functional.mse_loss(model(x), y))
        if step in poisoned:
            model[2].weight.grad[0, 1] = INF if step % 2 else NAN
        stepped.append(bool(precision.step([p.grad for p in model.parameters()],
                                           optimizer.step)))
        records.append(precision.record())
    return model.state_dict(), optimizer.state_dict()["state"], stepped, records


def same(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_device_path_trains_as_the_host_path_bit_for_bit(name):
    host = train(OPTIMIZERS[name], on_device=False)
    device = train(OPTIMIZERS[name], on_device=True)
    assert host[2] == [False, False, True, True, True, False, True, True, True]
    assert host[3][-1] == {"loss_scale": 512.0, "overflow_skips": 3}
    for part, h, d in zip(("params", "optimizer state", "stepped", "records"), host, device):
        assert same(h, d), (name, part)


@pytest.fixture
def host_reads(monkeypatch):
    """The reads of a tensor's value on the host that strategies/ makes (torch's own
    Adam reads its step count, a CPU tensor on a GPU too: no wait there)."""
    reads = []
    for method in ("__bool__", "item", "tolist", "__float__", "__int__"):
        original = getattr(torch.Tensor, method)

        def counted(self, *a, original=original, method=method):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("strategies."):
                reads.append(method)
            return original(self, *a)
        monkeypatch.setattr(torch.Tensor, method, counted)
    return reads


@pytest.mark.parametrize("name, first, later", [
    ("sgd", 0, 0),               # no state: never a read
    ("momentum", 1, 0),          # the first step creates the buffers: one read
    ("adam", 1, 0),              # its CPU step count is on found_inf's device here
    ("fused-adam", 1, 0),        # found_inf handed to the kernel
    ("fused-sgd", 0, 0),
    ("host-state", 1, 1),        # a Python number in the state: read every step
])
def test_the_common_path_reads_nothing_on_the_host(host_reads, name, first, later):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = OPTIMIZERS[name](model.parameters())
    precision = MixedPrecision("fp16", loss_scale=64.0, on_device=True)
    counts = []
    for _ in range(3):
        optimizer.zero_grad()
        precision.backward(model(torch.randn(5, 3)).square().mean())
        host_reads.clear()
        precision.step([p.grad for p in model.parameters()], optimizer.step)
        counts.append(len(host_reads))
    assert counts == [first, later, later], counts


def test_the_vote_reduces_the_flag_where_it_is():
    class Max:                    # two ranks; the other one saw an overflow
        size = 2

        def allreduce(self, x, op):
            assert op == "max" and x.shape == (1,)
            return x.clamp_(min=1.0)
    found = torch.zeros(1)
    assert any_rank(Max())(found) is found and found.tolist() == [1.0]
    assert any_rank(Max())(False) is True

    class Comm:                   # mpi4py's (or a TorchComm's) allgather of Python objects
        def allgather(self, value):
            return [value, 1]
    assert any_rank_of(Comm())(torch.zeros(1)).tolist() == [1.0]
    # the device's path: a rank whose own gradients are finite still skips
    precision = MixedPrecision("fp16", loss_scale=4.0, on_device=True)
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    optimizer = torch.optim.SGD([weight], lr=1.0)
    assert not precision.step([weight.grad], optimizer.step, agree=any_rank(Max()))
    assert weight.tolist() == [1.0, 1.0] and precision.record()["overflow_skips"] == 1
    assert not math.isnan(precision.record()["loss_scale"])
