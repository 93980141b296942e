"""GPU tier (a): fp16's loss scale on the device (strategies/runtime/loss_scaling.py).

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  The device's path gives the
host's skips, scale and parameters, and its common path makes no synchronising
CUDA call: torch.cuda.set_sync_debug_mode("error") turns each one (a .item(), a
copy to pageable host memory, ...) into an error.  The same path on CPU tensors,
bit for bit against the host's: tests/test_loss_scaling.py.
"""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no GPU: torch.cuda.is_available() is False")

OPTIMIZERS = {
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "fused-adam": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "capturable-adam": lambda ps: torch.optim.Adam(ps, lr=0.01, capturable=True),
}


def run(name, device, on_device, steps=6, poisoned=(0, 3), after_first=None):
    from strategies.runtime.precision import MixedPrecision
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    opt = OPTIMIZERS[name](model.parameters())
    precision = MixedPrecision("fp16", device.type, 1024.0, 2, on_device=on_device)
    x = torch.arange(32.0, device=device).reshape(8, 4) / 32
    for step in range(steps):
        opt.zero_grad()
        precision.backward(model(x).square().mean())
        if step in poisoned:
            model.weight.grad[0, 0] = float("inf")
        grads = [p.grad for p in model.parameters()]
        if after_first and step > poisoned[0] + 1:        # the state exists by now
            with after_first():
                precision.step(grads, opt.step)
        else:
            precision.step(grads, opt.step)
    return [p.detach().cpu() for p in model.parameters()], precision.record()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fp16_on_the_gpu_skips_and_steps_as_on_the_cpu(name):
    cpu = run(name, torch.device("cpu"), False) if name != "capturable-adam" else None
    gpu = run(name, torch.device("cuda"), True)
    assert gpu[1] == {"loss_scale": 1024.0, "overflow_skips": 2}
    if cpu is not None:
        assert cpu[1] == gpu[1]
        for a, b in zip(cpu[0], gpu[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class NoSync:
    def __enter__(self):
        torch.cuda.synchronize()
        self.mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.mode)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_after_the_first_waits_for_nothing_on_the_host(name):
    """Unscale, check, masked or fused step and scale update: no synchronising call,
    an overflowing step (the fourth) included."""
    run(name, torch.device("cuda"), True, after_first=NoSync)
