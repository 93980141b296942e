"""strategies.DistributedOptimizer: a user's own model and loop, under mpiexec and torchrun.

Equivalence is the integration test (tests/mpi/distributed_optimizer.py): a
conv + layer norm + linear model of the script's own, started from another
random init (parameters and buffers) on every rank, trained 4 SGD steps with
momentum at P=3 on each rank's shard of a global batch of 12, must end where
one process training on the whole batch ends, for every all-reduce sync (and
ps / hybrid with rank 2 serving).  Every rank also checks its shard's loss at
every step.

Tolerance: rtol = 1e-5, atol = 1e-6, as in test_train_runs.py and for the same
reason: only the order of float32 additions differs (P partial means summed
in ring, tree or pairwise order), a few ulps per step; measured at most
6.5e-8 here, while a missing shard, a sum not averaged, a bucket out of place
or a rank left on its own init is off by far more.  Compression rounds the
sums to 16 bits (strategies/compression/casts.py): fp16 (11 significant bits) measured 2.2e-4,
checked at atol 2e-3; bf16 (8 bits) measured 1.4e-3, checked at atol 2e-2.
"""
import re

import pytest
import torch

from conftest import BIN, check_ok, each_bucket, mpi_env, mpirun, run
from strategies.sync.buckets import GradBuckets
from strategies.compression.casts import make_compressor
from strategies.config.settings import ALLREDUCE_SYNCS, ConfigError
from strategies.config.optimizer_checks import server_settings, transport_for
from strategies.config.sections import SyncOptions

SCRIPT = "tests/mpi/distributed_optimizer.py"


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_every_sync_reproduces_one_process():
    result = check_ok(mpirun(3, [SCRIPT, "equivalence"], timeout=380))
    labels = list(ALLREDUCE_SYNCS) + ["ring no-overlap", "tree one-bucket", "ring clip",
                                      "ring fp16", "ring bf16"]
    assert "auto" in labels          # allreduce.create("auto") exists: it is covered too
    for rank in range(3):
        for label in labels:
            assert f"rank {rank} {label}: ok" in result.stdout, (label, result.stdout)
        for name in ("ps", "hybrid"):
            want = "served" if rank == 2 else "ok"
            assert f"rank {rank} {name}: {want}" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_an_fp16_overflow_leaves_a_lossy_compressor_as_if_the_step_never_happened():
    """tests/mpi/distributed_optimizer.py's fp16_skip (its docstring): topk, powersgd and
    fp8 over a 3-rank ring, topk under ps, each run with step 3 skipped equal (rtol 1e-6)
    to the run without step 3; and under ps the optimizer's state_dict carries the
    workers' push compressor's residuals."""
    result = check_ok(mpirun(3, [SCRIPT, "fp16_skip"], timeout=180))
    for rank in range(3):
        for compress in ("topk:0.2", "powersgd:1", "fp8"):
            assert f"rank {rank} fp16 skip ring {compress}: ok" in result.stdout, result.stdout
    for rank in range(2):
        assert f"rank {rank} fp16 skip ps topk:0.2: ok" in result.stdout, result.stdout
        assert f"rank {rank} ps topk state: ok" in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_sub_communicators_train_apart():
    """P=3 split into {0, 1} and {2}: each group reproduces one process from its own
    first rank's weights (ring and torch); an LR schedule drives the wrapped optimizer;
    a loop resumed from the optimizer's state_dict under top-k and PowerSGD ends bit for
    bit where the uninterrupted loop does (the compressor's residuals are in it)."""
    result = check_ok(mpirun(3, [SCRIPT, "subcomm"], timeout=280))
    for rank, size in ((0, 2), (1, 2), (2, 1)):
        for name in ("ring", "torch"):
            assert f"rank {rank} subcomm {name} group of {size}: ok" in result.stdout, \
                result.stdout
        assert f"rank {rank} schedule: ok" in result.stdout
        for compress in ("topk:0.1", "powersgd:1"):   # bit for bit (torch.equal)
            assert f"rank {rank} resume {compress}: ok" in result.stdout, result.stdout


BAD_ARGUMENTS = {
    "unknown sync": ("ConfigError", "sync='rign' is not one of ring, tree"),
    "foreign parameters": ("ConfigError", "of the optimizer's parameters are not the model's"),
    "not an optimizer": ("TypeError", "optimizer must be a torch.optim.Optimizer"),
    "two devices": ("ConfigError", "parameters are on several devices (cpu, meta)"),
    "float64": ("ConfigError", "the parameters torch.float64"),
    "comm not a communicator": ("TypeError", "comm must be an mpi4py communicator"),
    "comm null": ("ConfigError", "comm is MPI.COMM_NULL"),
    "unknown compression": ("ConfigError", "compress='int8' is not one of none, fp16, bf16"),
    "bucket size": ("ConfigError", "bucket_mb must be > 0"),
    "mpi over torch": ("ConfigError", "sync='mpi' is the mpi library's own all-reduce"),
    "ps without role": ("ConfigError", "needs role=strategies.ps_roles(servers=S)"),
    "ps amsgrad": ("ConfigError", "the servers run adam with amsgrad=False"),
    "models differ": ("ConfigError", "has another model"),
    "second backward": ("RuntimeError", "a second backward before the gradients"),
}


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bad_arguments_fail_on_every_rank():
    result = check_ok(mpirun(3, [SCRIPT, "errors"], timeout=280))
    for rank in range(3):
        got = dict(re.findall(rf"^rank {rank} error (.*?): (.*)$", result.stdout, re.M))
        assert got.keys() == BAD_ARGUMENTS.keys()
        for case, (kind, message) in BAD_ARGUMENTS.items():
            assert got[case].startswith(f"{kind}: ") and message in got[case], (case, got[case])


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_torch_sync_under_torchrun():
    """No MPI at all: sync='torch', and ring over torch.distributed (chosen for it)."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", SCRIPT, "torchrun"]
    result = check_ok(run(cmd, 220, mpi_env(OMP_NUM_THREADS=1)))
    for rank in range(2):
        for name in ("torch", "ring"):
            assert f"rank {rank} torchrun {name}: ok" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_example_runs_and_learns():
    result = check_ok(mpirun(2, ["-m", "strategies.example_user_model", "--steps", "30"],
                             timeout=220))
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], result.stdout     # steps 0, 20, 29
    assert "[ring] 2 ranks, global batch 64: held-out accuracy" in result.stdout


# -------------------------------------------------- no processes: the pieces
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs, message", [
    ({"sync": "rign"}, "sync='rign' is not one of"),
    ({"overlap": "yes"}, "overlap='yes' must be True or False"),
    ({"timeout": 0}, "timeout must be > 0"),
    ({"sync": "mpi", "link_gbps": 1.0}, "link emulation slows the textbook all-reduces"),
    ({"sync": "ps", "staleness": 2}, "staleness needs consistency='ssp'"),
])
def test_sync_options_are_validated(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SyncOptions(**kwargs)


@pytest.mark.timeout(60)
def test_server_settings_describe_the_wrapped_optimizer():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert server_settings(torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)) \
        == {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
    assert server_settings(torch.optim.Adam(params, lr=1e-3))["optimizer"] == "adam"
    with pytest.raises(ConfigError, match="nesterov=False"):
        server_settings(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True))
    with pytest.raises(ConfigError, match="SGD or Adam, not RMSprop"):
        server_settings(torch.optim.RMSprop(params))
    with pytest.raises(ConfigError, match="not 2 parameter groups"):
        server_settings(torch.optim.SGD([{"params": params}, {"params": [
            torch.nn.Parameter(torch.zeros(1))]}], lr=0.1))


@pytest.mark.timeout(60)
def test_torchrun_gets_the_torch_transport(monkeypatch):
    assert transport_for("ring", None) == "mpi"
    assert transport_for("torch", None) == "torch"
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0",
                       "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert transport_for("ring", None) == "torch"
    with pytest.raises(ConfigError, match="under torchrun there is no MPI world"):
        transport_for("mpi", None)


@pytest.mark.timeout(60)
def test_buckets_rearm_whoever_clears_the_gradients():
    """A user loop may call model.zero_grad(), or clear nothing (gradients then add up
    as in one process); a second backward before the step is refused."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    calls = []
    buckets = GradBuckets(list(model.parameters()),
                          each_bucket(lambda flat: calls.append(flat.numel())), cap_bytes=48, compressor=make_compressor("none"), overlap=True)
    try:
        x = torch.ones(3, 4)
        buckets.zero_()
        grads = []
        for clear in (model.zero_grad, lambda: None):
            clear()
            model(x).sum().backward()
            buckets.wait()
            grads.append(model[0].bias.grad.clone())
        assert calls == 2 * [sum(p.numel() for p in b.params) for b in buckets.buckets]
        assert torch.equal(grads[1], 2 * grads[0])      # not cleared: added up
        model(x).sum().backward()
        with pytest.raises(RuntimeError, match="a second backward"):
            model(x).sum().backward()
        buckets.wait()
    finally:
        buckets.close()
