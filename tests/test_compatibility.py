"""The compatibility table: generated from TrainConfig, kept current in docs/training.md.

Every pair of techniques (strategies/compatibility.py) is tried on TrainConfig; a
refusal must say why (the ConfigError's words name the flags and a reason), and the
table in docs/training.md must be the one the code gives today, so that the docs and
the code cannot disagree about what is refused.
"""
from strategies.compatibility import TECHNIQUES, documented, markdown, merged, refusal, table
from strategies.config.settings import TrainConfig


def test_docs_hold_todays_table():
    assert documented() == markdown(), \
        "docs/training.md is stale: run `python -m strategies.compatibility --write`"


def test_every_refusal_names_its_flags_and_says_why():
    for a, b, _, why in table():
        assert why.startswith("--") or " --" in why, (a, b, why)
        assert any(w in why for w in (":", "needs", ";")), (a, b, why)


def test_what_used_to_live_in_one_engine_now_composes():
    """The combinations the one worker brought together are accepted."""
    accepted = [
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
    ]
    for fields in accepted:
        TrainConfig(**fields)


def test_a_pair_is_judged_on_every_model():
    names = [n for n, _ in TECHNIQUES]
    assert len(names) == len(set(names))
    assert merged("gpt", {"sync": "ps"}, {"sync": "torch"}) is None     # two syncs: no pair
    # recompute on a pipeline: the GPT's blocks and the MLP's layers (it once took GPT
    # blocks only, and the pair was refused on the mlp)
    assert refusal(merged("mlp", {"recompute": True}, {"pp": 2, "micro_batches": 2})) is None
    assert refusal(merged("gpt", {"recompute": True}, {"pp": 2, "micro_batches": 2})) is None
    assert refusal(merged("mlp", {"tp": 2}, {"sync": "ps"})) is None      # tp sets the gpt
