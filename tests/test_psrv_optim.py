"""Tier (a): the servers' numpy optimizers follow torch.optim step for step."""
import numpy as np
import pytest
import torch

from psrv import OptimizerConfig
from psrv import optim


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
    OptimizerConfig("adam", lr=1e-2),
    OptimizerConfig("adam", lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
], ids=["sgd", "sgd-momentum-wd", "adam", "adam-wd"])
def test_numpy_update_matches_torch(cfg):
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(1000).astype(np.float32)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(6)]
    tp = torch.nn.Parameter(torch.tensor(p0))
    if cfg.name == "sgd":
        topt = torch.optim.SGD([tp], lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        topt = torch.optim.Adam([tp], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
    p, state = p0.copy(), optim.new_state(cfg, 1000)
    for t, g in enumerate(grads, 1):
        tp.grad = torch.tensor(g)
        topt.step()
        # in two chunks, as the server applies frame by frame
        for sl in (slice(0, 300), slice(300, 1000)):
            optim.apply(cfg, t, p[sl], g[sl], {k: v[sl] for k, v in state.items()})
    # torch fuses a + alpha*b into one rounding, numpy rounds twice: a few ulp apart
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-6)
