"""Tier (a): the training worker's pure parts, no processes.

Config validation and CLI mapping, batch sharding, bucket planning,
compression, and GradBuckets in one process with a stand-in collective
(the real collectives are exercised by test_train_runs.py under mpiexec).
"""
import numpy as np
import pytest
import torch
from conftest import each_bucket

from strategies.sync.buckets import GradBuckets, plan_buckets
from strategies.compression.casts import make_compressor
from strategies.config.settings import ConfigError, TrainConfig, check_world, parse_args
from strategies.runtime.context import RunContext, nccl_gpu_conflict
from strategies.model.data import load_data
from strategies.model.models import build_model


@pytest.mark.timeout(30)
def test_cli_maps_flags_onto_the_config():
    cfg = parse_args(["--sync", "ring", "--global-batch", "12", "--no-overlap", "--lr", "0.1",
                      "--bucket-mb", "0.5", "--checkpoint-dir", "/tmp/x", "--resume"])
    assert (cfg.sync, cfg.global_batch, cfg.overlap, cfg.lr, cfg.bucket_mb, cfg.resume) == \
        ("ring", 12, False, 0.1, 0.5, True)
    assert parse_args([]) == TrainConfig()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, message", [
    (["--sync", "rign"], "--sync 'rign' is not one of"),
    (["--model", "cnn"], "--model 'cnn' is not one of"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--model", "gpt", "--d-model", "30", "--heads", "4"], "not divisible by --heads"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--steps", "ten"], "invalid int value"),
    (["--sync", "ps", "--staleness", "2"], "--staleness needs --consistency ssp"),
])
def test_bad_flags_raise_config_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


@pytest.mark.timeout(30)
def test_dp_size_names_every_factor():
    assert check_world(TrainConfig(sync="ring", global_batch=12), 3) == 3
    assert check_world(TrainConfig(sync="ps", servers=1, global_batch=12), 4) == 3
    with pytest.raises(ConfigError, match=r"10 % dp\(3\) = 1 \(world 3 = dp\(3\)\)"):
        check_world(TrainConfig(sync="ring", global_batch=10), 3)
    with pytest.raises(ConfigError, match=r"world 3 = dp\(2\) \+ servers\(1\)"):
        check_world(TrainConfig(sync="ps", global_batch=9), 3)
    with pytest.raises(ConfigError, match="no worker left"):
        check_world(TrainConfig(sync="ps", servers=2), 2)
    with pytest.raises(ConfigError, match="one process"):
        check_world(TrainConfig(sync="local"), 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_shards_of_all_ranks_make_the_global_batch(model):
    cfg = TrainConfig(model=model, dataset_size=50, global_batch=12, seq_len=8)
    data = load_data(cfg)
    for step in (0, 4, 9):                       # step 4 crosses an epoch boundary (50 / 12)
        whole_x, whole_y = data.batch(step, 0, 1, 12)
        for dp in (2, 3):
            parts = [data.batch(step, r, dp, 12) for r in range(dp)]
            assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
            assert torch.equal(torch.cat([y for _, y in parts]), whole_y)
    # each epoch visits every sample once
    seen = np.concatenate([data.global_indices(s, 10) for s in range(5)])
    assert sorted(seen.tolist()) == list(range(50))


@pytest.mark.timeout(30)
def test_bad_npz_and_text_files(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.arange(10.0), y=np.arange(10))
    with pytest.raises(ConfigError, match="x must be a 2-D real array"):
        load_data(TrainConfig(data=str(bad)))
    np.savez(bad, x=np.zeros((10, 3)), y=np.zeros(9, dtype=np.int64))
    with pytest.raises(ConfigError, match="x has 10 samples but y has 9"):
        load_data(TrainConfig(data=str(bad)))
    np.savez(bad, features=np.zeros((10, 3)))
    with pytest.raises(ConfigError, match="missing x, y"):
        load_data(TrainConfig(data=str(bad)))
    text = tmp_path / "t.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError, match="cannot read it as an .npz"):
        load_data(TrainConfig(data=str(text)))
    with pytest.raises(ConfigError, match="shorter than one sample"):
        load_data(TrainConfig(model="gpt", data=str(text), seq_len=8))
    text.write_text("abcdefghij" * 10)
    data = load_data(TrainConfig(model="gpt", data=str(text), seq_len=9))
    assert data.spec.vocab == 256 and data.x.shape == (10, 9)
    assert bytes(data.x[0].tolist()) == b"abcdefghi" and bytes(data.y[0].tolist()) == b"bcdefghij"


@pytest.mark.timeout(30)
def test_plan_buckets_respects_the_cap():
    params = [torch.zeros(n) for n in (10, 10, 30, 5, 5)]
    groups = plan_buckets(params, cap_bytes=4 * 20)
    assert [[p.numel() for p in g] for g in groups] == [[10, 10], [30], [5, 5]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name, tol", [("none", 0), ("fp16", 1e-3), ("bf16", 1e-2)])
def test_compressor_round_trip(name, tol):
    c = make_compressor(name)
    x = torch.linspace(-2, 2, 101)
    out = torch.empty_like(x)
    wire = c.compress(x, None if name == "none" else torch.empty(101, dtype=c.wire_dtype))
    assert wire.dtype == c.wire_dtype
    c.decompress(wire, out)
    assert torch.allclose(out, x, atol=tol, rtol=0)


def _grads(model, x, y):
    model.zero_grad()
    model.criterion(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False])
def test_grad_buckets_reduce_every_gradient_once_in_order(overlap):
    cfg = TrainConfig(width=16, depth=3)
    data = load_data(cfg)
    model = build_model(cfg, data.spec)
    x, y = data.batch(0, 0, 1, 8)
    expected = _grads(model, x, y)
    calls = []

    def reduce(flat):                       # a stand-in collective: records and doubles
        calls.append(flat.numel())
        flat.mul_(2)

    buckets = GradBuckets(list(model.parameters()), each_bucket(reduce), cap_bytes=4 * 300,
                          compressor=make_compressor("none"), overlap=overlap)
    try:
        for _ in range(2):                  # the second step reuses zeroed buckets
            calls.clear()
            buckets.zero_()
            model.criterion(model(x), y).backward()
            buckets.wait()
            assert calls == [sum(p.numel() for p in b.params) for b in buckets.buckets]
            assert len(calls) > 2
            assert any(len(b.params) > 1 for b in buckets.buckets)
            for p, g in zip(model.parameters(), expected):
                assert torch.equal(p.grad, 2 * g)
    finally:
        buckets.close()


@pytest.mark.timeout(60)
def test_grad_buckets_flush_parameters_without_gradient():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    buckets = GradBuckets(list(model.parameters()), each_bucket(lambda flat: None), cap_bytes=64,
                          compressor=make_compressor("none"), overlap=True)
    try:
        buckets.zero_()
        model["used"](torch.ones(2, 4)).sum().backward()
        buckets.wait()                      # would hang if unused buckets were never sent
        assert torch.equal(model["unused"].weight.grad, torch.zeros(4, 4))
    finally:
        buckets.close()


@pytest.mark.timeout(30)
def test_comm_thread_error_reaches_the_main_thread():
    model = torch.nn.Linear(4, 4)

    def reduce(flat):
        raise RuntimeError("peer vanished")

    buckets = GradBuckets(list(model.parameters()), each_bucket(reduce), cap_bytes=1 << 20,
                          compressor=make_compressor("none"), overlap=True)
    try:
        buckets.zero_()
        model(torch.ones(2, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="peer vanished"):
            buckets.wait()
    finally:
        buckets.close()


# -- NCCL and the GPUs of a host (no GPU here: the decision and the refusal) ----------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("gpus, visible, refused", [
    (2, [None] * 4, "4 ranks on host h0 but 2 GPUs for them (local ranks 0, 2 would share GPU 0)"),
    (1, [None] * 2, "2 ranks on host h0 but 1 GPU for them (local ranks 0, 1 would share GPU 0)"),
    (2, [None] * 2, None),
    (8, [None] * 8, None),
    (1, ["0", "1", "2", "3"], None),           # a GPU bound to each rank (Slurm, say)
    (1, ["0", "0"], "2 ranks on host h0 but 1 GPU for them (local ranks 0, 1 would share GPU 0)"),
    (2, ["0,1", "1,0"], "local ranks 0, 1 would share GPU 0"),   # rank i takes its i-th
    (2, ["GPU-a", "GPU-b", None], None),       # names as CUDA_VISIBLE_DEVICES has them
])
def test_nccl_needs_a_gpu_per_rank_of_a_host(gpus, visible, refused):
    problem = nccl_gpu_conflict("h0", gpus, visible)
    if refused is None:
        assert problem is None
    else:
        assert refused in problem and "use an MPI --sync (ring," in problem


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sync", ["torch", "ring"])
def test_sync_torch_with_more_ranks_than_gpus_is_refused_before_training(monkeypatch, sync):
    # 4 ranks on a host that torch says has 2 GPUs; ring stages through host memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    cfg = parse_args(["--sync", sync, "--device", "cuda"])
    ctx = RunContext(rank=3, world_size=4, local_rank=3, local_size=4, is_server=False,
                     comm=None, control=None, host="h0", host_visible_gpus=[None] * 4)
    if sync == "ring":
        assert ctx.device(cfg) == torch.device("cuda", 1)
        return
    with pytest.raises(ConfigError, match="--sync torch --device cuda: 4 ranks on host h0 "
                                          "but 2 GPUs for them"):
        ctx.device(cfg)


def test_the_bare_loop_and_local_train_the_same_parameters():
    """strategies.bench's floor, a plain PyTorch loop, against the trainer's `--sync
    local` on one process: the same model, data and optimizer, so the same parameters
    after 3 steps (rtol 1e-6: the same float operations, in the same order but for
    where the gradients live)."""
    from strategies.bench import make_method
    cfg = TrainConfig(sync="local", model="mlp", width=16, depth=2, global_batch=8,
                      optimizer="adam", lr=0.01, progress=False)
    ctx = RunContext.create(cfg)
    device, data = ctx.device(cfg), load_data(cfg)
    local, bare = (make_method(m, cfg, ctx, data, device) for m in ("local", "bare"))
    for step in range(3):
        ours, theirs = local.step(step)[0], bare.step(step)[0]
        assert ours == pytest.approx(theirs, rel=1e-6)
    for (name, p), q in zip(local.model.named_parameters(), bare.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
