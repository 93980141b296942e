"""GPU tier (d): a training step waits for the GPU once, at its end.

    pytest tests/gpu          # on a machine where torch.cuda.is_available()

Skipped, with that reason, where torch sees no GPU.  A plain PyTorch loop waits
once a step, where it reads its loss back; the kernels of its update are queued
while the GPU still runs backward.  The step engine (strategies/engine/loop.py)
times its phases with CUDA events (runtime/metrics.StepClock) and copies the loss,
with fp16's scale, into pinned memory before the last event, so it may wait only
where the clock reads its events.
torch.cuda.set_sync_debug_mode("error") makes every other synchronising call (a
.item(), a torch.cuda.synchronize, a copy to pageable memory) an error.  The
batch's own copy from pageable host memory waits in the plain loop too, and is
let through.
"""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no GPU: torch.cuda.is_available() is False")


class SyncsAllowed:
    def __enter__(self):
        self.mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.mode)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_local_step_waits_for_the_gpu_once_at_its_end(monkeypatch, precision):
    from strategies.config.settings import TrainConfig
    from strategies.engine.loop import StepEngine
    from strategies.model.data import load_data
    from strategies.model.models import build_model
    from strategies.runtime.context import RunContext
    from strategies.runtime.metrics import StepClock

    cfg = TrainConfig(model="gpt", layers=2, d_model=32, heads=2, vocab=16, seq_len=8,
                      dataset_size=64, global_batch=8, steps=3, lr=0.05, momentum=0.9,
                      progress=False, threads=1, sync="local", device="cuda",
                      precision=precision)
    device = torch.device("cuda")
    data = load_data(cfg)
    engine = StepEngine(cfg, RunContext.create(cfg), device, data,
                        build_model(cfg, data.spec, device))
    engine.step(0)          # the first step makes the optimizer's state and cuBLAS's handles
    waits, seconds, batch = [], StepClock.seconds, data.batch

    def read_the_clock(clock, *marks):
        waits.append(len(marks))
        with SyncsAllowed():                        # the step's one wait
            return seconds(clock, *marks)

    def batch_from_host(*args, **kwargs):
        with SyncsAllowed():
            return batch(*args, **kwargs)

    monkeypatch.setattr(StepClock, "seconds", read_the_clock)
    monkeypatch.setattr(data, "batch", batch_from_host)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, fields = engine.step(1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        engine.sync.close()
    assert waits == [4]                             # start, backward, gradients, update
    # the loss and fp16's scale came with that wait (StepClock.read): no read after it
    assert isinstance(loss, float) and loss == loss
    if precision == "fp16":
        assert fields["loss_scale"] > 0 and fields["overflow_skips"] in (0, 1)
    assert fields["step_time_s"] >= fields["compute_time_s"] > 0
    assert fields["comm_time_s"] >= 0
