"""Tier (c): real training through real server processes and real worker processes.

BSP with 2 workers x 2 servers must reproduce single-process training on the
global batch.  Tolerance rtol=1e-5, atol=1e-6: the only differences are float
rounding, (g1 + g2) / 2 on the server against torch's mean over the whole batch,
and numpy rounding a + alpha*b twice where torch fuses it; over 8 steps of a
small MLP these stay around 1e-7.
"""
import multiprocessing as mp

import numpy as np
import pytest

import psrv

STEPS, GLOBAL_BATCH, WORKERS = 8, 12, 2


def make_model_and_data():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * GLOBAL_BATCH, 8, generator=g)
    y = torch.randint(0, 4, (STEPS * GLOBAL_BATCH,), generator=g)
    return model, x, y


def torch_optimizer(cfg, params):
    import torch
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def single_process(cfg):
    import torch
    model, x, y = make_model_and_data()
    opt = torch_optimizer(cfg, model.parameters())
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def bsp_worker(endpoints, w, cfg, results):
    import torch
    torch.set_num_threads(1)
    model, x, y = make_model_and_data()
    if w != 0:                               # worker 0's values must win
        for p in model.parameters():
            torch.nn.init.uniform_(p.data)
    # tiny slices and messages so that each weight is cut across both servers
    client = psrv.Client(endpoints, w, WORKERS, timeout=30, slice_bytes=256, message_bytes=512)
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    client.init(params, cfg)
    local = GLOBAL_BATCH // WORKERS
    for step in range(STEPS):
        for n, p in model.named_parameters():
            p.data.copy_(torch.from_numpy(params[n]))
        model.zero_grad()
        batch = slice(step * GLOBAL_BATCH + w * local, step * GLOBAL_BATCH + (w + 1) * local)
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        client.push_pull(grads, params, step).wait()
    results.put((w, params, client.staleness_log))
    client.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cfg", [
    pytest.param(psrv.OptimizerConfig("sgd", lr=0.1, momentum=0.9), id="sgd-momentum",
                 marks=pytest.mark.slow),
    pytest.param(psrv.OptimizerConfig("adam", lr=0.01), id="adam")])
def test_bsp_two_workers_two_servers_equals_single_process(cfg):
    expected = single_process(cfg)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with psrv.launch.start_local_servers(2, worker_timeout=30) as servers:
        procs = [ctx.Process(target=bsp_worker, args=(servers.endpoints, w, cfg, results))
                 for w in range(WORKERS)]
        for p in procs:
            p.start()
        got = dict((w, (params, log)) for w, params, log in (results.get(timeout=90) for _ in procs))
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert servers.wait(30) == [0, 0]
    for w in range(WORKERS):
        params, staleness = got[w]
        assert set(staleness) == {0}                     # BSP: never stale
        for name in expected:
            np.testing.assert_allclose(params[name], expected[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"worker {w} {name}")


# -- asynchronous modes: numpy linear regression, 3 workers of different speeds ------------
def async_worker(endpoints, w, num_workers, mode, staleness, steps, barrier, results):
    import time
    from psrv.example import data, grads, initial_params
    x, y = data()
    mine = slice(w * len(y) // num_workers, (w + 1) * len(y) // num_workers)
    client = psrv.Client(endpoints, w, num_workers, timeout=30,
                         consistency=psrv.Consistency(mode, staleness))
    params = initial_params(x.shape[1])
    client.init(params, psrv.OptimizerConfig("sgd", lr=0.1))
    for step in range(steps):
        _, g = grads(params, x[mine], y[mine])
        time.sleep(0.002 * w)                   # worker 2 is the straggler
        client.push_pull(g, params, step).wait()
    barrier.wait(60)                            # everyone has pushed: read the final model
    for name in params:
        client.pull(name, params[name])
    full_loss, _ = grads(params, x, y)
    stats = client.stats() if w == 0 else None
    results.put((w, full_loss, stats))
    client.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,s", [("asp", 0), ("ssp", 1)])
def test_async_modes_converge_and_respect_the_bound(mode, s):
    from psrv.example import data, grads, initial_params
    x, y = data()
    initial_loss, _ = grads(initial_params(x.shape[1]), x, y)
    W, steps = 3, 40
    ctx = mp.get_context("spawn")
    results, barrier = ctx.Queue(), ctx.Barrier(W)
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        procs = [ctx.Process(target=async_worker,
                             args=(servers.endpoints, w, W, mode, s, steps, barrier, results))
                 for w in range(W)]
        for p in procs:
            p.start()
        out = [results.get(timeout=90) for _ in procs]
        for p in procs:
            p.join(30)
    losses = {w: loss for w, loss, _ in out}
    stats = next(st for _, _, st in out if st)
    assert all(loss < initial_loss / 10 for loss in losses.values()), (initial_loss, losses)
    hist = stats["histogram"]
    assert sum(hist.values()) >= 2 * steps * W - 2 * W      # one record per key per push
    if mode == "ssp":
        # nobody read while more than s clocks ahead of the slowest, so a gradient can
        # miss at most 2s+1 pushes of each of the W-1 others
        assert stats["max_clock_gap"] <= s
        assert max(hist) <= (W - 1) * (2 * s + 1), hist
    else:
        assert max(hist) >= 1, hist                         # ASP does apply stale gradients
