"""Tier (a)/(b): activation recomputation (--recompute, strategies/parallel/recompute.py), in process.

Equivalence: a model with its blocks checkpointed trains exactly as the same model
without: the replayed forward runs the same kernels on the same block input (no
dropout), so losses and gradients agree bit for bit on the CPU; the tolerance below
(rtol 1e-6) only leaves room for a library that reorders a reduction on replay.

Memory: the bytes autograd saves for backward (memory.ActivationMeter) must drop to
the blocks' inputs plus what lies outside the blocks, and must still count those
inputs (the checkpoint keeps them by reference, recompute.py shows them to the meter).
"""
import json

import numpy as np
import pytest
import torch

from strategies.config.settings import TrainConfig
from strategies.model.models import GPT, MLP
from strategies.parallel.recompute import Recompute, saved_activation_bytes
from strategies.runtime.trace import Tracer

RTOL, ATOL = 1e-6, 1e-7
B, T, D, LAYERS, VOCAB = 8, 16, 32, 4, 12


def gpt():
    torch.manual_seed(0)
    return GPT(VOCAB, T, LAYERS, D, 2)


def mlp():
    torch.manual_seed(0)
    return MLP(32, 64, 4, 10)


def batch(kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "gpt":
        return (torch.randint(0, VOCAB, (B, T), generator=g),
                torch.randint(0, VOCAB, (B, T), generator=g))
    return torch.randn(2 * B, 32, generator=g), torch.randint(0, 10, (2 * B,), generator=g)


def train(model, kind, recompute, steps=3):
    """SGD with momentum; returns the losses and the final parameters."""
    rc = Recompute(model) if recompute else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(steps):
        x, y = batch(kind, s)
        opt.zero_grad()
        loss = model.criterion(model(x), y)
        with rc.backward() if rc else torch.enable_grad():
            loss.backward()
        opt.step()
        losses.append(loss.item())
    if rc:
        assert rc.replays == steps * (LAYERS if kind == "gpt" else 2)   # mlp: 2 segments
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind,make", [("gpt", gpt), ("mlp", mlp)])
def test_recomputed_training_equals_plain_training(kind, make):
    plain_losses, plain_params = train(make(), kind, recompute=False)
    losses, params = train(make(), kind, recompute=True)
    np.testing.assert_allclose(losses, plain_losses, rtol=RTOL, atol=ATOL)
    for a, b in zip(params, plain_params):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=RTOL, atol=ATOL)


def test_parameter_names_stay_the_same():
    plain, checkpointed = gpt(), gpt()
    Recompute(checkpointed)
    assert [n for n, _ in plain.named_parameters()] == \
        [n for n, _ in checkpointed.named_parameters()]


def test_saved_activations_drop_to_the_block_inputs():
    x, y = batch("gpt", 0)
    plain = saved_activation_bytes(gpt(), x, y)
    model = gpt()
    Recompute(model)
    kept = saved_activation_bytes(model, x, y)
    block_input = B * T * D * 4                    # fp32 (B, T, d) residual stream
    # the inputs are kept and counted; the blocks' insides (~16 inputs each) are not
    assert LAYERS * block_input <= kept < plain / 5, (plain, kept)
    # the MLP: segments of sqrt(4) = 2 hidden layers keep 2 of the 4 hidden outputs
    x, y = batch("mlp", 0)
    model = mlp()
    Recompute(model)
    hidden = 2 * B * 64 * 4
    assert saved_activation_bytes(mlp(), x, y) - saved_activation_bytes(model, x, y) == \
        2 * hidden


def test_the_trace_shows_each_replay_inside_backward():
    model, tracer = gpt(), Tracer(0)
    rc = Recompute(model, tracer)
    x, y = batch("gpt", 0)
    loss = model.criterion(model(x), y)
    assert tracer.events == []                     # the forward is not a replay
    with tracer.span("backward", "backward"), rc.backward():
        loss.backward()
    replays = [e for e in tracer.events if e[1] == "recompute"]
    assert [e[0] for e in replays] == [f"recompute block {i}" for i in reversed(range(LAYERS))]
    _, _, start, end = tracer.events[-1]           # the backward span holds them all
    assert all(start <= e[2] <= e[3] <= end for e in replays)


@pytest.mark.parametrize("flags", [
    dict(recompute=True, pp=2, sync="ring"),                # the MLP's layers on a stage
    dict(recompute=True, model="moe"),                      # the MoE's blocks
])
def test_what_was_refused_is_taken(flags):
    """Both were refused (the grid checkpointed GPT blocks only; the MoE had no blocks to
    replay); tests/test_parallel_runs.py and tests/test_moe.py run them against one process."""
    assert TrainConfig(**flags).recompute


def test_the_gantt_draws_the_recompute_spans(tmp_path):
    from experiments.recompute_gantt import last_step, recompute_gantt

    def span(name, cat, ts, dur):
        return {"name": name, "cat": cat, "ph": "X", "pid": 0, "ts": ts, "dur": dur}
    plain = [span("forward 0", "forward", 0, 10), span("backward 0", "backward", 10, 20),
             span("forward 1", "forward", 40, 10), span("backward 1", "backward", 50, 20)]
    recomputed = plain[:2] + [span("forward 1.0", "forward", 40, 10),
                              span("backward 1.0", "backward", 50, 30),
                              span("recompute block 0", "recompute", 55, 8)]
    assert [e["name"] for e in last_step(recomputed)] == \
        ["forward 1.0", "backward 1.0", "recompute block 0"]
    path = recompute_gantt({"plain": plain, "--recompute": recomputed}, str(tmp_path))
    assert path.endswith("recompute_gantt.png")
    data = json.load(open(tmp_path / "recompute_gantt.json"))
    assert data                                    # the numbers the figure draws
