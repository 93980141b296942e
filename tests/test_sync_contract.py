"""Tier (b): every sync keeps the contract of sync.GradientSync, in one process.

The contract: `synchronize` combines gradients and leaves the parameters alone;
`step` is the one call that changes them.  Each sync below trains one step of
a small MLP as the only worker (P = 1, so the combined gradient is its own) and
is compared with torch's SGD on a copy of the same model.  The parameter-server
syncs talk to a real psrv server on this host (start_local_servers).

Tolerance: rtol = 1e-6, atol = 1e-7.  With one worker nothing is reordered:
the all-reduce over one rank returns the gradient as it is, and the servers
apply torch-identical SGD (psrv/optim.py) in float32, so a difference beyond a
few ulps would be a real error (a step skipped, a gradient from another step).
"""
import copy
import socket

import pytest
import torch

import psrv.launch
from strategies.config.mesh import Mesh
from strategies.config.settings import TrainConfig
from strategies.sync.data_parallel import data_parallel, parameter_units
from strategies.sync.gradient_sync import GradientSync, LocalSync, collective_for

RTOL, ATOL = 1e-6, 1e-7
LR, MOMENTUM = 0.1, 0.9


def model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 24 - 0.5
    return model, x, torch.tensor([0, 2, 1, 2])


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def one_worker_mesh():
    from mpi4py import MPI
    return Mesh(1).split(MPI.COMM_SELF)


def assert_contract(make_sync, steps=2):
    """`steps` steps through the contract against torch's own SGD on a copy; the sync is
    make_sync(units) of the model's parameter units (data_parallel's)."""
    model, x, y = model_and_batch()
    reference = copy.deepcopy(model)
    sync = make_sync(parameter_units(model))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    sync.setup(model)
    optimizer = sync.make_optimizer(model)
    try:
        assert sync.start_step == 0
        for step in range(steps):
            ref_opt.zero_grad()
            loss_of(reference, x, y).backward()
            ref_opt.step()
            sync.before_backward()
            loss_of(model, x, y).backward()
            before = [p.detach().clone() for p in model.parameters()]
            sync.synchronize(step)
            for b, p in zip(before, model.parameters()):      # synchronize: no update
                assert torch.equal(b, p.detach())
            sync.step(optimizer)
            for p, r in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.detach(), r.detach(), rtol=RTOL, atol=ATOL)
        assert sync.state_dict() in ({}, {"servers_step": steps})   # ps: the servers save
    finally:
        sync.close()


OPTIONS = TrainConfig(sync="ring", lr=LR, momentum=MOMENTUM, bucket_mb=0.0001)


@pytest.mark.timeout(60)
def test_base_class_defaults_are_one_process_alone():
    sync = GradientSync(OPTIONS, None, torch.device("cpu"))
    assert (sync.start_step, sync.staleness, sync.bytes_sent) == (0, None, 0)
    assert sync.state_dict() == {} and sync.load_state_dict({}) is None
    assert_contract(lambda units: LocalSync(OPTIONS, None, torch.device("cpu")))


@pytest.mark.timeout(60)
def test_all_reduce_sync_updates_in_step_only():
    comms = one_worker_mesh()
    coll = collective_for("ring", OPTIONS, comms.dp)
    assert_contract(lambda units: data_parallel(units, comms, OPTIONS, device=torch.device("cpu"),
                                                coll=coll))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["ps", "hybrid"])
def test_parameter_server_syncs_update_in_step_only(kind, tmp_path):
    options = TrainConfig(sync=kind, lr=LR, momentum=MOMENTUM, ranks_per_node=1)
    with psrv.launch.start_local_servers(1, worker_timeout=30,
                                         checkpoint_dir=str(tmp_path)) as servers:
        role = psrv.launch.Role(False, servers.endpoints, 1, worker_id=0)
        comms, made = one_worker_mesh(), []

        def make_sync(units):
            made.append(data_parallel(units, comms, options, device=torch.device("cpu"),
                                      role=role, host=socket.gethostname()))
            return made[0]
        assert_contract(make_sync)
        sync = made[0]
        with pytest.raises(RuntimeError, match="the servers resumed at step 0, the worker "
                                               "checkpoint is at step 3"):
            sync.load_state_dict({"servers_step": 3})
