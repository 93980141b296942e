"""Mixed precision (--precision, strategies/runtime/precision.py): the loss scaler, the ZeRO
memory formula, the refused combinations (tier a), and real runs (tier c).

Tolerance of bf16 against fp32: bf16 keeps 8 bits of mantissa, so each matmul's
inputs are rounded by up to 2^-9 relative; the losses after N = 20 steps agree
within 2 % relative (measured: 0.13 % for the MLP, 0.05 % for the GPT here), while
a run that does not train (a skipped update, a gradient not unscaled) stays at
its first loss, a 5-20 % difference at this N.

Memory: the measured params + grads + optimizer bytes of ZeRO stages 0-3 under
bf16 Adam against memory.zero_memory (2Ψ + 2Ψ + 12Ψ, sharded), within 10 % as
asked (measured: within 0.1 %; Adam's step counters are the rest).
"""
import json

import numpy as np
import pytest
import torch

from conftest import check_ok, mpirun
from strategies.config.choices import ConfigError
from strategies.config.settings import TrainConfig
from strategies.runtime.memory import zero_memory
from strategies.runtime.precision import LossScaler, MixedPrecision
from test_parallel_runs import COMMON, GPT, MLP_ADAM, SEVERAL

N_STEPS = 20
LOSS_RTOL = 0.02
MEMORY_RTOL = 0.10


# ------------------------------------------------------------------- tier (a)
def test_loss_scaler_halves_and_skips_on_overflow_and_doubles_after_its_window():
    scaler = LossScaler(scale=8.0, window=3)
    assert scaler.update(overflow=True) is False
    assert (scaler.scale, scaler.overflow_skips) == (4.0, 1)
    assert [scaler.update(False) for _ in range(2)] == [True, True] and scaler.scale == 4.0
    assert scaler.update(False) and scaler.scale == 8.0          # the third clean step
    scaler.update(False)
    scaler.update(True)                                          # an overflow resets the count
    assert (scaler.scale, scaler.clean_steps, scaler.overflow_skips) == (4.0, 0, 2)


def test_fp16_step_skips_an_overflow_and_unscales_otherwise():
    precision = MixedPrecision("fp16", loss_scale=4.0, loss_scale_window=100)
    calls = []
    bad = [torch.tensor([1.0, float("inf")])]
    assert not precision.step(bad, lambda: calls.append(1)) and not calls
    assert precision.record() == {"loss_scale": 2.0, "overflow_skips": 1}
    good = [torch.tensor([2.0, 4.0]), None]
    assert precision.step(good, lambda: calls.append(1)) and calls == [1]
    assert good[0].tolist() == [1.0, 2.0]                         # divided by the scale, 2
    # every rank's vote: a rank whose own shard is finite still skips
    assert not precision.step([torch.ones(2)], lambda: calls.append(1), agree=lambda o: True)


def test_bf16_and_fp32_need_no_scale():
    for name in ("fp32", "bf16"):
        precision = MixedPrecision(name)
        grads = [torch.tensor([3.0])]
        assert precision.step(grads, lambda: None) and grads[0].item() == 3.0
        assert precision.record() == {}
    assert MixedPrecision("bf16").mixed and not MixedPrecision("fp32").mixed


def test_zero_memory_formula_fp32_and_mixed():
    psi, n = 1_000_000, 4
    total = lambda s, *a: sum(zero_memory(psi, n, s, *a).values())  # noqa: E731
    assert [total(s) for s in range(4)] == pytest.approx([16e6, 10e6, 7e6, 4e6])      # fp32
    assert [total(s, "bf16") for s in range(4)] == pytest.approx(
        [16e6, 4e6 + 3e6, 2e6 + 3.5e6, 4e6])                     # the paper's Figure 1
    assert zero_memory(psi, n, 0, "fp16") == {"params": 2e6, "grads": 2e6, "optimizer": 12e6}
    # SGD with momentum: K = 4 (fp32) or 8 (master + buffer); plain SGD: 0 or 4
    assert zero_memory(psi, 1, 0, "fp32", "momentum")["optimizer"] == 4e6
    assert zero_memory(psi, 1, 0, "bf16", "sgd")["optimizer"] == 4e6
    # fp8: bf16's 16-bit buffers and fp32 masters (its 8-bit copies are activations)
    assert [zero_memory(psi, n, s, "fp8") for s in range(4)] == \
        [zero_memory(psi, n, s, "bf16") for s in range(4)]
    with pytest.raises(ValueError, match="fp32, bf16, fp16, fp8"):
        zero_memory(psi, n, 0, "fp4")


@pytest.mark.parametrize("flags, message", [
    ({"precision": "fp4"}, "--precision 'fp4' is not one of fp32, bf16, fp16, fp8"),
    ({"precision": "fp16", "loss_scale": 0.0}, "--loss-scale must be > 0"),
])
def test_unsupported_combinations_are_named(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig(**flags)


def test_the_parameter_servers_take_both_precisions():
    """fp16 under ps and hybrid: the workers vote on an overflow before they push (it was
    refused, when the servers had no way to skip a step; tests/test_ps_wire.py runs it)."""
    for sync in ("ps", "hybrid"):
        for precision in ("bf16", "fp16"):
            assert TrainConfig(precision=precision, sync=sync).precision == precision


def test_expert_parallelism_takes_both_precisions():
    for precision in ("bf16", "fp16"):
        assert TrainConfig(precision=precision, sync="ring", model="moe", ep=2).ep == 2


# ------------------------------------------------------------------- tier (c)
MLP = MLP_ADAM
SMALL_GPT = GPT[:-4] + ["--optimizer", "adam", "--lr", "0.01"]


def launch(tmp_path, nprocs, runs, timeout=240, script=SEVERAL):
    """{name: step records} of each (name, flags), trained in turn in one launch."""
    argvs = [COMMON[2:] + ["--steps", str(N_STEPS)] + flags +
             ["--jsonl", str(tmp_path / f"{name}.jsonl")] for name, flags in runs]
    check_ok(mpirun(nprocs, script + [json.dumps(argvs)], timeout=timeout))
    return {name: [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
            for name, _ in runs}


def final_loss(records):
    return [r for r in records if r["kind"] == "summary"][0]["final_loss"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_trains_like_fp32_and_fp16_counts_its_skips(tmp_path):
    """One process: the MLP and the GPT, fp32 against bf16 after N steps; fp16 with an
    initial scale of 1e9 overflows (fp16 ends at 65504), halves until it does not,
    and every record counts the skips so far."""
    runs = launch(tmp_path, 1, [
        (f"{model}_{p}", flags + ["--sync", "local", "--precision", p])
        for model, flags in (("mlp", MLP), ("gpt", SMALL_GPT)) for p in ("fp32", "bf16")] +
        [("fp16", MLP + ["--sync", "local", "--precision", "fp16", "--loss-scale", "1e9",
                         "--loss-scale-window", "5"])])
    for model in ("mlp", "gpt"):
        fp32, bf16 = final_loss(runs[f"{model}_fp32"]), final_loss(runs[f"{model}_bf16"])
        first = runs[f"{model}_fp32"][1]["loss"]
        assert fp32 < 0.95 * first, (model, first, fp32)           # it trained at all
        assert bf16 == pytest.approx(fp32, rel=LOSS_RTOL), model
    steps = [r for r in runs["fp16"] if r["kind"] == "step"]
    skips = [r["overflow_skips"] for r in steps]
    assert skips[0] == 1 and skips == sorted(skips) and 0 < skips[-1] < N_STEPS
    assert steps[-1]["loss_scale"] < 1e9
    assert [r for r in runs["fp16"] if r["kind"] == "summary"][0]["overflow_skips"] == skips[-1]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_bf16_ring_and_zero_memory_per_rank_match_the_formula(tmp_path):
    """P = 2: the ring's bf16 run within the tolerance of one fp32 process's; ZeRO stages
    0-3 under bf16 Adam hold the formula's bytes per rank (16-bit params and grads, fp32
    master weights with the optimizer's state); fp16 ZeRO-2 trains like bf16."""
    runs = launch(tmp_path, 2, [
        ("ring_bf16", MLP + ["--sync", "ring", "--precision", "bf16"]),
        ("ring_fp32", MLP + ["--sync", "ring"])] +
        [(f"zero{s}", MLP + ["--sync", "ring", "--zero", str(s), "--dp", "2",
                             "--precision", "bf16", "--steps", "3"]) for s in range(4)] +
        [("zero2_fp16", MLP + ["--sync", "ring", "--zero", "2", "--dp", "2",
                               "--precision", "fp16", "--steps", "3"])] +
        [(f"pp_{p}", SMALL_GPT + ["--sync", "ring", "--pp", "2", "--micro-batches", "2",
                                  "--precision", p]) for p in ("fp32", "bf16")] +
        [(f"tp_{p}", SMALL_GPT + ["--sync", "ring", "--tp", "2", "--sequence-parallel",
                                  "--precision", p]) for p in ("fp32", "bf16")] +
        [("pp_fp16", SMALL_GPT + ["--sync", "ring", "--pp", "2", "--micro-batches", "2",
                                  "--precision", "fp16", "--loss-scale", "1e9",
                                  "--loss-scale-window", "5"])])
    assert final_loss(runs["ring_bf16"]) == pytest.approx(final_loss(runs["ring_fp32"]),
                                                          rel=LOSS_RTOL)
    first = [r for r in runs["zero0"] if r["kind"] == "step"][0]["memory"]
    psi = first["params"] / 2                                     # 16-bit parameters
    for s in range(4):
        want = zero_memory(psi, 2, s, "bf16", "adam")
        for r in (r for r in runs[f"zero{s}"] if r["kind"] == "step"):
            mem = r["memory"]
            for part in want:
                assert mem[part] == pytest.approx(want[part], rel=MEMORY_RTOL), (s, part)
    bf16_loss, fp16_loss = final_loss(runs["zero2"]), final_loss(runs["zero2_fp16"])
    assert np.isfinite(fp16_loss) and fp16_loss == pytest.approx(bf16_loss, rel=LOSS_RTOL)
    # a pipeline of 2 stages, and tp 2 with sequence parallelism, in bf16: 16-bit compute,
    # fp32 across ranks (activations, their gradients and the tp axis's sums)
    for split in ("pp", "tp"):
        assert final_loss(runs[f"{split}_bf16"]) == pytest.approx(
            final_loss(runs[f"{split}_fp32"]), rel=LOSS_RTOL), split
    # fp16 on two stages: each sees its own gradients' overflows, all skip the same steps
    skips = {}
    for r in (r for r in runs["pp_fp16"] if r["kind"] == "step"):
        skips.setdefault(r["step"], set()).add(r["overflow_skips"])
    assert all(len(seen) == 1 for seen in skips.values()), skips
    assert 0 < max(max(seen) for seen in skips.values()) < N_STEPS


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_reduce_precision_fp32_widens_the_grids_16_bit_buckets(tmp_path):
    """P = 2, dp 2 with ZeRO-1 under bf16: --reduce-precision param reduces the 16-bit
    buckets as they are, fp32 widens them, so its gradient bytes are twice param's
    (the records' wire_bytes, every step and rank); both train within LOSS_RTOL of the
    fp32 run after N steps.  A whole model's buckets are fp32 already: fp32 changes
    nothing there (its bytes equal param's)."""
    grid = MLP + ["--sync", "ring", "--zero", "1", "--dp", "2", "--precision", "bf16"]
    whole = MLP + ["--sync", "ring", "--precision", "bf16"]
    runs = launch(tmp_path, 2, [
        ("fp32", MLP + ["--sync", "ring", "--zero", "1", "--dp", "2"]),
        ("param", grid), ("wide", grid + ["--reduce-precision", "fp32"]),
        ("whole_param", whole), ("whole_wide", whole + ["--reduce-precision", "fp32"])])

    def wire(name):
        return [r["wire_bytes"] for r in runs[name] if r["kind"] == "step"]
    assert wire("wide") == [2 * b for b in wire("param")]
    assert wire("whole_wide") == wire("whole_param")
    for name in ("param", "wide"):
        assert final_loss(runs[name]) == pytest.approx(final_loss(runs["fp32"]), rel=LOSS_RTOL)
    config = [r for r in runs["wide"] if r["kind"] == "config"][0]
    assert config["reduce_precision"] == "fp32"


# a tiny mixture of experts, its 4 experts split over 2 ranks (expert_parallel.py)
EP_MOE = ["--model", "moe", "--layers", "2", "--d-model", "16", "--heads", "2", "--vocab", "12",
          "--seq-len", "8", "--dataset-size", "120", "--global-batch", "8", "--experts", "4",
          "--top-k", "2", "--capacity-factor", "1.0", "--optimizer", "adam", "--lr", "0.01",
          "--sync", "ring", "--ep", "2"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_parallel_bf16_trains_like_fp32_and_fp16_ranks_skip_together(tmp_path):
    """--ep 2: the tokens cross the all-to-alls in fp32 and are computed on in 16 bit;
    bf16 ends within LOSS_RTOL of fp32 after N steps (measured: 0.19 %).  fp16 at a
    scale of 1e6 overflows; each rank holds other experts' gradients, yet one vote
    over the launch makes both ranks skip the same steps with the same scale."""
    runs = launch(tmp_path, 2, [(f"ep_{p}", EP_MOE + ["--precision", p])
                                for p in ("fp32", "bf16")] +
                  [("ep_fp16", EP_MOE + ["--precision", "fp16", "--loss-scale", "1e6",
                                         "--loss-scale-window", "5"])])
    fp32, bf16 = final_loss(runs["ep_fp32"]), final_loss(runs["ep_bf16"])
    first = [r for r in runs["ep_fp32"] if r["kind"] == "step"][0]["loss"]
    assert fp32 < 0.95 * first, (first, fp32)                     # it trained at all
    assert bf16 == pytest.approx(fp32, rel=LOSS_RTOL)
    steps = [r for r in runs["ep_fp16"] if r["kind"] == "step"]
    for step in range(N_STEPS):
        mine = [r for r in steps if r["step"] == step]
        assert len(mine) == 2 and len({(r["overflow_skips"], r["loss_scale"])
                                       for r in mine}) == 1, mine
    assert 0 < steps[-1]["overflow_skips"] < N_STEPS
    assert np.isfinite(final_loss(runs["ep_fp16"]))


# SEVERAL, with rank 1's first expert gradient set to inf after step POISONED's sync
# (the experts are ZeRO layers of their own, expert_parallel.units_of)
POISONED = 3
POISON = [SEVERAL[0], SEVERAL[1].replace(
    "from strategies.train import main\n",
    "from strategies.train import main\n"
    "import strategies.sync.zero as zero\n"
    "synchronize = zero.ZeRO.synchronize\n"
    "def poisoned(self, step):\n"
    "    synchronize(self, step)\n"
    f"    if self.coll.rank == 1 and step == {POISONED}:\n"
    "        next(u for u in self.units if '.experts.' in u.name).gradient().fill_(float('inf'))\n"
    "zero.ZeRO.synchronize = poisoned\n")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_expert_parallel_fp16_vote_spans_ranks_holding_other_experts(tmp_path):
    """An overflow only one rank can see (its own experts' gradients, which no
    all-reduce shares with the other rank of the expert group): both ranks skip that
    step, and only it, at a scale that does not overflow on its own."""
    assert "poisoned" in POISON[1]                   # the replace found its place
    runs = launch(tmp_path, 2, [("ep_fp16", EP_MOE + ["--precision", "fp16", "--loss-scale",
                                                      "1024", "--steps", "6"])], script=POISON)
    steps = [r for r in runs["ep_fp16"] if r["kind"] == "step"]
    for rank in range(2):
        skips = [r["overflow_skips"] for r in steps if r["rank"] == rank]
        assert skips == [0] * POISONED + [1] * (6 - POISONED), (rank, skips)


def test_zero_memory_figure_draws_fp32_beside_mixed_precision(tmp_path):
    """The report's figure (d): one bar per (precision, stage), fp32 first."""
    from experiments import training_plots
    cfg = {"model": "mlp", "width": 8, "depth": 1, "global_batch": 8, "world_size": 2,
           "sync": "ring", "dp": 2, "optimizer": "adam"}
    records = [{"command": "strategies.train", "kind": "step", "point": f"{p}{z}", "step": 0,
                "rank": 0, "config": {**cfg, "zero": z, "precision": p},
                "memory": {**zero_memory(1000, 2, z, p), "activations_peak": 100}}
               for p in ("fp32", "bf16") for z in (0, 3)]
    assert training_plots.zero_memory(records, str(tmp_path))
    (panel,) = json.load(open(tmp_path / "zero_memory.json"))
    params = next(b for b in panel["bars"] if b["label"] == "params")
    assert params["x"] == ["ZeRO-0", "ZeRO-3", "ZeRO-0 bf16", "ZeRO-3 bf16"]
    assert params["height"][2] * 2**20 == pytest.approx(2000)      # 2 bytes a parameter


@pytest.mark.slow
def test_distributed_optimizer_bf16_and_fp16_in_a_loop_of_ones_own():
    """The user's seam: autocast, backward and step of DistributedOptimizer(precision=...);
    bf16 and fp16 end within LOSS_RTOL of fp32, and fp16 at a scale that overflows
    skips and counts its first steps."""
    import strategies

    def train(precision, **scale):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
        with strategies.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             model, sync="local", precision=precision,
                                             **scale) as opt:
            for _ in range(N_STEPS):
                opt.zero_grad()
                with opt.autocast():
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.backward(loss)
                opt.step()
            return loss.item(), opt.overflow_skips, opt.loss_scale

    fp32, bf16, fp16 = train("fp32"), train("bf16"), train("fp16")
    assert bf16[0] == pytest.approx(fp32[0], rel=LOSS_RTOL) and bf16[1:] == (0, None)
    assert fp16[0] == pytest.approx(fp32[0], rel=LOSS_RTOL) and fp16[1:] == (0, 2.0**16)
    overflowing = train("fp16", loss_scale=1e9, loss_scale_window=1000)
    assert 0 < overflowing[1] < N_STEPS and overflowing[2] < 1e9
    model = torch.nn.Linear(2, 2)      # a refusal of the API names its keywords
    with pytest.raises(ConfigError, match="compress='topk:0.01' with sync='local'"):
        strategies.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                        sync="local", precision="fp16", compress="topk:0.01")


def test_distributed_optimizer_state_dict_carries_fp16s_loss_scale():
    """A loop resumed from opt.state_dict() goes on with the scale it had: 5 clean steps
    at window 2 double 2^16 twice, and a fresh optimizer loaded from the state holds
    2^18 and its counters, not its own 2^16."""
    import strategies

    def optimizer():
        model = torch.nn.Linear(4, 2)
        return model, strategies.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, sync="local",
            precision="fp16", loss_scale_window=2)

    model, opt = optimizer()
    for _ in range(5):
        opt.zero_grad()
        opt.backward(model(torch.ones(3, 4)).sum())
        opt.step()
    saved = opt.state_dict()
    assert saved["loss_scale"] == {"scale": 2.0**18, "clean_steps": 1, "overflow_skips": 0}
    _, fresh = optimizer()
    fresh.load_state_dict(saved)
    assert fresh.loss_scale == 2.0**18 and fresh.precision.state_dict() == saved["loss_scale"]
    assert fresh.optimizer.state_dict()["param_groups"] == opt.optimizer.state_dict()[
        "param_groups"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fp16_zero_ranks_agree_to_skip(tmp_path):
    """ZeRO-2, P = 2, fp16 at a scale that overflows: each rank checks only its shard,
    yet both skip the same steps (one all-reduce(max) of a flag) and end equal."""
    runs = launch(tmp_path, 2, [("zero2", MLP + ["--sync", "ring", "--zero", "2", "--dp", "2",
                                                  "--precision", "fp16", "--loss-scale", "1e6",
                                                  "--loss-scale-window", "5", "--steps", "8"])])
    steps = [r for r in runs["zero2"] if r["kind"] == "step"]
    for step in range(8):
        mine = [r for r in steps if r["step"] == step]
        assert len(mine) == 2 and len({(r["overflow_skips"], r["loss_scale"]) for r in mine}) == 1
    assert 0 < steps[-1]["overflow_skips"] < 8
