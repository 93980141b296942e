"""The compatibility page: generated from the validator, kept current, and sampled for real.

Every launch x model x technique and pair (strategies/compatibility.py) is judged by
TrainConfig and the launcher's check; a refusal must say why (the ConfigError's words
name the flags and a reason); docs/compatibility.md must be the page the code gives
today; and a sample of what the validator takes runs under mpiexec, so that "taken"
means "trains", not only "passes the validator".
"""
import random

import numpy as np
import pytest

from conftest import check_ok, mpirun
from strategies.compatibility import (FIELDS, LAUNCHES, MODELS, TORCHRUN, accepted,
                                      documented, markdown, refusal, table)
from strategies.config.settings import TrainConfig


def test_docs_hold_todays_table():
    assert documented() == markdown(), \
        "docs/compatibility.md is stale: run `python -m strategies.compatibility --write`"


def test_every_refusal_names_its_flags_and_says_why():
    for launches, a, b, models, why in table():
        assert why.startswith("--") or " --" in why, (a, b, why)
        assert any(w in why for w in (":", "needs", ";")), (a, b, why)


def test_every_launch_and_model_is_judged():
    judged = {(launch, model) for launch, model, *_ in accepted()}
    assert judged == {(launch, model) for launch in LAUNCHES for model in MODELS}


def test_what_used_to_live_in_one_engine_now_composes():
    """The combinations the one worker brought together are accepted."""
    accepted_fields = [
        dict(sync="ring", pp=2, micro_batches=2, checkpoint_dir="ckpt"),
        dict(sync="ring", zero=2, compress="topk:0.01"),
        dict(sync="ring", model="gpt", tp=2, recompute=True),
        dict(sync="ring", zero=1, straggler="0:0.1"),
        dict(sync="ring", pp=2, grad_accum=2),
        dict(sync="ring", model="moe", ep=2, zero=1, checkpoint_dir="ckpt"),
        dict(sync="ps", precision="bf16"),
        dict(sync="ring", zero=1, precision="fp16", checkpoint_dir="ckpt"),
        # a GPU: every layout of the grid and the experts (host staging, gradient_sync.py)
        dict(sync="ring", dp=2, pp=2, micro_batches=2, zero=1, device="cuda"),
        dict(sync="ring", model="gpt", tp=2, sequence_parallel=True, zero=2, device="cuda"),
        dict(sync="ring", model="moe", ep=2, zero=1, device="cuda"),
        # the parameter servers under the splits, a 16-bit wire and fp16's skips
        dict(sync="ps", model="gpt", dp=2, pp=2, micro_batches=2, precision="fp16"),
        dict(sync="hybrid", model="gpt", tp=2, compress="bf16"),
        dict(sync="ps", compress="topk:0.01"), dict(sync="hybrid", compress="powersgd:2"),
        dict(sync="ps", model="gpt", dp=2, pp=2, micro_batches=2, compress="fp8"),
        dict(sync="hybrid", model="moe", ep=2, ranks_per_node=2),
    ]
    for fields in accepted_fields:
        TrainConfig(**fields)


def test_a_pair_is_judged_on_every_model():
    # recompute on a pipeline: the GPT's blocks and the MLP's layers (it once took GPT
    # blocks only, and the pair was refused on the mlp)
    assert refusal("ring", "mlp", "--recompute", "--pp 2") is None
    assert refusal("ring", "gpt", "--recompute", "--pp 2") is None
    assert refusal("ring", "mlp", "--tp 2")                 # tp splits the GPT only
    assert refusal("ps", "gpt", "--tp 2") is None


# ---------------------------------------------------------- a sample, for real
GPT = ["--layers", "4", "--d-model", "16", "--heads", "2", "--vocab", "12", "--seq-len", "8"]
MLP = ["--width", "16", "--depth", "4", "--in-dim", "8", "--classes", "4"]
MOE = GPT + ["--experts", "4"]
SIZES = {"gpt": GPT, "mlp": MLP, "moe": MOE}


def command(launch, model, names, tmp_path):
    """(ranks, argv) for one accepted combination: 2 data-parallel replicas (1 under
    local) times its pp and tp, one server more under ps and hybrid."""
    fields = {k: v for name in names if name for k, v in FIELDS[name].items()}
    argv = ["-m", "strategies.train", "--sync", launch, "--model", model, *SIZES[model],
            "--global-batch", "8", "--dataset-size", "64", "--steps", "2", "--threads", "1",
            "--no-progress", "--jsonl", str(tmp_path / "run.jsonl")]
    dp = 1 if launch == "local" else 2
    for key, value in fields.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif key == "checkpoint_dir":
            argv += [flag, str(tmp_path / "ckpt")]
        else:
            argv += [flag, str(value)]
    if launch in ("ps", "hybrid"):
        argv += ["--servers", "1"]
    ranks = dp * fields.get("pp", 1) * fields.get("tp", 1)
    return ranks + (launch in ("ps", "hybrid")), argv


def sample(k, seed=3):
    """k accepted combinations that this machine can run: no GPU, MPI launches."""
    runnable = [row for row in accepted()
                if row[0] != TORCHRUN and "--device cuda" not in row[2:]]
    return random.Random(seed).sample(runnable, k)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("combination", sample(3), ids=lambda row: "-".join(
    x.replace("--", "").replace(" ", "") for x in row if x))
def test_a_sample_of_what_is_taken_trains(tmp_path, combination):
    import json
    launch, model, *names = combination
    ranks, argv = command(launch, model, names, tmp_path)
    check_ok(mpirun(ranks, argv, timeout=240))
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "run.jsonl")
              if '"kind": "step"' in line]
    assert losses and np.isfinite([x for x in losses if x is not None]).all()
