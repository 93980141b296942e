"""Tier (a): one configuration, validated in one module (strategies/config/).

The sections (sections.py) are the one home of each setting: TrainConfig is their
fields flat, DistributedOptimizer's keywords are two of them, and the cross-rank check
compares them.  Every rule is in validate.py once: the same bad setting given to the
trainer's flags, to the optimizer's keywords and to a sweep point gets the same
message (a flag or a keyword named) and the same field.
"""
import dataclasses
import inspect
import re

import pytest
import torch

import strategies
from experiments.sweepfile import check_point
from strategies.config.choices import ConfigError
from strategies.config.mesh import Mesh
from strategies.config.optimizer_checks import KEYWORD_SECTIONS, check_same_everywhere
from strategies.config.sections import (SECTIONS, OptimizerOptions, PrecisionOptions,
                                        SyncOptions)
from strategies.config.settings import TrainConfig, parse_args, parser
from strategies.config.validate import check_sync_world, check_world


def section_fields():
    return [f for section in SECTIONS for f in dataclasses.fields(section)]


# ------------------------------------------------------------------ the sections and the flat config
def test_train_config_is_the_sections_fields_flat():
    flat = dataclasses.fields(TrainConfig)
    assert [f.name for f in flat] == [f.name for f in section_fields()]
    for mine, theirs in zip(flat, section_fields()):
        assert (mine.type, mine.default) == (theirs.type, theirs.default), mine.name
    owners = {f.name: f.metadata["section"] for f in flat}
    for section in SECTIONS:
        assert all(owners[f.name] is section for f in dataclasses.fields(section))


def test_a_config_gives_its_sections_and_is_made_of_them():
    cfg = TrainConfig(sync="ring", compress="topk:0.01", precision="bf16", pp=2,
                      micro_batches=2, lr=0.1)
    sync = cfg.section(SyncOptions)
    assert (sync.sync, sync.compress) == ("ring", "topk:0.01")
    assert cfg.section(PrecisionOptions) == PrecisionOptions(precision="bf16")
    assert TrainConfig.of(*(cfg.section(s) for s in SECTIONS)) == cfg
    assert strategies.SyncOptions is SyncOptions


def test_the_help_is_the_sections_comments(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")          # one line per flag: no word is broken
    text = " ".join(parser().format_help().split())
    for f in dataclasses.fields(TrainConfig):
        assert " ".join(f.metadata["help"].split()) in text, f.name
    assert parse_args(["--sync", "ring", "--no-overlap"]).overlap is False


# ------------------------------------------------------------------ the optimizer's keywords
def tiny():
    model = torch.nn.Linear(3, 2)
    return torch.optim.SGD(model.parameters(), lr=0.1), model


def test_the_optimizers_keywords_are_the_sections_fields():
    signature = inspect.signature(strategies.DistributedOptimizer.__init__)
    assert [p.kind for p in signature.parameters.values()][-1] is inspect.Parameter.VAR_KEYWORD
    keywords = [f.name for s in KEYWORD_SECTIONS for f in dataclasses.fields(s)
                if f.name != "sync"]
    assert KEYWORD_SECTIONS == (SyncOptions, PrecisionOptions)
    doc = strategies.DistributedOptimizer.__init__.__doc__
    for name in keywords:                        # help() lists each, with its meaning
        assert f"    {name}=" in doc, name
    sgd, model = tiny()
    with pytest.raises(TypeError, match=re.escape("unknown keyword 'bucket'; its settings "
                                                  "are consistency, staleness")) as e:
        strategies.DistributedOptimizer(sgd, model, sync="local", bucket=1.0)
    assert all(name in str(e.value) for name in keywords)
    opt = strategies.DistributedOptimizer(sgd, model, sync="local", bucket_mb=1.0,
                                          precision="bf16", loss_scale_window=7)
    with opt:
        assert opt.options == SyncOptions(sync="local", bucket_mb=1.0)
        assert opt.sections[1] == PrecisionOptions(precision="bf16", loss_scale_window=7)
        assert (opt.config.bucket_mb, opt.config.precision) == (1.0, "bf16")


def test_momentum_correction_moves_the_sgd_momentum_into_the_compressor():
    from mpi4py import MPI
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with strategies.DistributedOptimizer(sgd, model, sync="ring", comm=MPI.COMM_SELF,
                                         compress="topk:0.5", momentum_correction=True) as opt:
        assert sgd.param_groups[0]["momentum"] == 0.0
        assert opt.config.compressor_momentum == 0.9


# ------------------------------------------------------------------ each rule once
def through_flags(flags):
    with pytest.raises(ConfigError) as e:
        parse_args(flags)
    return str(e.value), e.value.field


def through_keywords(sync, **keywords):
    sgd, model = tiny()
    with pytest.raises(ConfigError) as e:
        strategies.DistributedOptimizer(sgd, model, sync=sync, **keywords)
    return str(e.value), e.value.field


def through_sweep(point):
    return check_point("strategies.train", {"world_size": 2, **point})[::-1]


def words(message):
    """A message without the way it names a setting: `--sync ps` and `sync='ps'`,
    `--bucket-mb` and `bucket_mb` read alike."""
    return re.sub(r"[-_'= ]", "", message)


@pytest.mark.parametrize("keywords", [
    dict(sync="local", compress="powersgd:2"),       # (every compression under ps is taken now)
    dict(sync="ring", compress="topk:0.01", momentum_correction=True),
    dict(sync="ring", bucket_mb=0.0),
    dict(sync="ps", staleness=2),
    dict(sync="mpi", link_gbps=1.0),
    dict(sync="ring", precision="fp16", loss_scale_window=0),
])
def test_one_rule_one_message_from_every_front_end(keywords):
    """The trainer's flags, the optimizer's keywords and a sweep point reach the same rule."""
    flags = []
    for key, value in keywords.items():
        flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    message, field = through_flags(flags)
    assert through_sweep(keywords) == (message, field)
    sync = keywords.pop("sync")
    api_message, api_field = through_keywords(sync, **keywords)
    assert api_field == field
    assert api_message != message and words(api_message) == words(message), api_message


def test_sync_local_on_several_ranks_is_one_rule():
    message, field = "--sync local runs on one process, not 2", "world_size"
    with pytest.raises(ConfigError, match=message) as e:
        check_world(TrainConfig(sync="local"), 2)
    assert e.value.field == field
    assert through_sweep({"sync": "local"}) == (message, field)
    with pytest.raises(ConfigError, match="sync='local' runs on one process, not 2") as e:
        check_sync_world(SyncOptions(sync="local"), 2, cli=False)
    assert e.value.field == field


def test_the_mesh_and_the_flags_share_the_degree_rule():
    for kw in (dict(pp=0), dict(tp=0), dict(ep=0), dict(dp=-1)):
        with pytest.raises(ConfigError) as flags:
            TrainConfig(**kw)
        with pytest.raises(ConfigError) as mesh:
            Mesh(4, **kw)
        assert (str(flags.value), flags.value.field) == (str(mesh.value), mesh.value.field)


# ------------------------------------------------------------------ the world
@pytest.mark.parametrize("kw, world, field, message", [
    (dict(sync="ring", global_batch=10), 3, "world_size", "10 % dp(3) = 1"),
    (dict(sync="ps", servers=2), 2, "world_size", "no worker left"),
    (dict(sync="ring", straggler="3:0.1"), 2, "straggler", "--straggler rank 3 is not a rank"),
    (dict(sync="ring", dp=2, pp=2), 6, "world_size", "dp(2) x pp(2) x tp(1) = 4 != world size 6"),
    (dict(sync="ring", model="gpt", layers=3, pp=4), 4, "layers", "--layers 3 is fewer than pp(4)"),
    (dict(sync="ring", model="moe", ep=2, global_batch=48), 3, "ep",
     "is not a multiple of ep(2)"),
    (dict(sync="ring", model="moe", moe_group=3), 2, "moe_group", "--moe-group 3 does not"),
    (dict(sync="ring", pp=2, micro_batches=2, schedule="interleaved", virtual_stages=2,
          layers=2, model="gpt"), 2, "schedule", "is not divisible by pp(2) x virtual"),
])
def test_the_world_problems_are_check_worlds(kw, world, field, message):
    cfg = TrainConfig(**kw)                     # the flags alone are fine
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        check_world(cfg, world)
    assert e.value.field == field
    assert through_sweep({**kw, "world_size": world})[1] == field


# ------------------------------------------------------------------ the cross-rank check
def test_the_cross_rank_check_compares_every_field_of_the_sections():
    params = [torch.nn.Parameter(torch.zeros(3))]
    sections = (SyncOptions(sync="ring"), PrecisionOptions(), OptimizerOptions())

    def summary(sections):
        seen = []
        check_same_everywhere(lambda mine: seen.append(mine) or [mine], params, sections)
        return seen[0]

    mine = summary(sections)
    changed = [(SyncOptions(sync="ring", link_gbps=1.0), sections[1], sections[2]),
               (sections[0], PrecisionOptions(loss_scale_window=5), sections[2]),
               (sections[0], sections[1], OptimizerOptions(lr=0.5))]
    for other in changed:
        theirs = summary(other)
        assert theirs[:3] == mine[:3] and theirs[3] != mine[3]
        with pytest.raises(ConfigError, match="rank 1 of the communicator has another "
                                              "settings") as e:
            check_same_everywhere(lambda m: [m, theirs], params, sections)
        for s in sections:
            assert all(f.name in str(e.value) for f in dataclasses.fields(s))
