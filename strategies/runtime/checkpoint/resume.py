"""--resume: the checkpoint to resume from, checked against this run, restored into
the engine.

`read` (every rank, before training) takes checkpoint.pt or this rank's share of the
newest complete set (sets.py) and refuses, in one line, a checkpoint of another model,
another world, another layout or a step beyond --steps.  `restore` (after sync.setup)
loads the sync's part, the model, the optimizer and the precision's state, and
returns the step to continue from.

With --sync ps or hybrid a checkpoint is a SET of one step s: the servers' shards
DIR/ps/shardI-of-N-steps.npz and the workers' checkpoint.pt (or their set step-<s>,
where each holds a share of its own: a grid, a lossy --compress).  Every worker is at s
(the loop's barrier), worker 0 asks each server for its part of step s (psrv
refuses unless every worker is exactly at s), then writes checkpoint.pt: last, so
that the set is complete once it is there.  A server keeps its parts of the last
two steps asked for (psrv/checkpoints.py), so whatever stops the run, and whenever,
the set that checkpoint.pt names is on disk.  --resume takes that set; if newer
shards are there (a run stopped between the servers' parts and the workers' file)
every rank says so in one line and resumes the complete set (ps_set_to_resume).
"""
import os

import torch

from ...config.choices import ConfigError
from ...model.models import signature
from .layout import another_layout, differing, layout_of
from .paths import FILE, path_of, ps_folder, set_folder, set_steps, sharded
from .rank_file import load, remove_stale_temporaries
from .sets import read_manifest, read_share, set_to_resume


def read(cfg, ctx, model):
    """The checkpoint to resume from, checked against this run (before training)."""
    if sharded(cfg):
        path, state = read_share(cfg, ctx)
    else:
        remove_stale_temporaries(cfg, FILE)
        path, state = read_whole(cfg)
    mine = [(n, tuple(s)) for n, s in signature(model)]
    theirs = [(n, tuple(s)) for n, s in state["signature"]]
    if state["model_kind"] != cfg.model or mine != theirs:
        diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
        raise ConfigError(
            f"--resume: {path} holds another model ({state['model_kind']}, "
            f"{len(theirs)} tensors) than this run ({cfg.model}, {len(mine)} tensors)"
            + (f"; first difference: checkpoint {diff[1]} vs run {diff[0]}" if diff else ""),
                          field="resume")
    theirs_cp = state.get("cp_size", 1)
    if (state["dp_size"], theirs_cp, state["world_size"]) != \
            (ctx.dp_size, cfg.cp, ctx.world_size):
        raise ConfigError(
            f"--resume: {path} was written by world {state['world_size']} = "
            f"{replicas_of(state['dp_size'], theirs_cp)}, this run is world "
            f"{ctx.world_size} = {replicas_of(ctx.dp_size, cfg.cp)}", field="resume")
    layout = layout_of(cfg)
    if sharded(cfg) and state["layout"] != layout:
        theirs, ours = differing(state["layout"], layout), differing(layout, state["layout"])
        raise ConfigError(f"--resume: {path} holds one rank's share of a run of {theirs}; "
                          f"this run is {ours} (a split run resumes in its own layout)",
                          field="resume")
    if state["layout"] != layout:           # a whole run's: its --compress
        raise another_layout(cfg, path, state["layout"])
    if state["step"] > cfg.steps:
        raise ConfigError(f"--resume: the checkpoint is at step {state['step']}, "
                          f"beyond --steps {cfg.steps}", field="resume")
    return state


def read_whole(cfg):
    """(path, state) of checkpoint.pt, the state a whole run's replicas share; where
    there is none but a split run's set, ConfigError naming how the two runs differ."""
    path = path_of(cfg)
    complete = [s for s, whole in set_steps(cfg).items() if whole]
    if not os.path.isfile(path) and complete:
        raise another_layout(cfg, set_folder(cfg, max(complete)),
                             read_manifest(cfg, max(complete))["layout"])
    return path, load(path)


def replicas_of(dp, cp):
    """"dp(2)", or "dp(1) x cp(2)" where context parallelism cuts the replicas."""
    return f"dp({dp})" + (f" x cp({cp})" if cp > 1 else "")


def ps_set_to_resume(cfg):
    """--resume under --sync ps/hybrid: (step, note) of the newest complete set, where
    the note ("" if none) says which newer parts there are; ConfigError if no set is
    complete.  The workers' checkpoint.pt names the only step that can be."""
    from psrv.checkpoints import saved_steps        # here: psrv needs ZeroMQ
    shards = saved_steps(ps_folder(cfg), cfg.servers)
    found = "; ".join(f"shard {i}: {', '.join(map(str, s)) or 'none'}"
                      for i, s in shards.items())
    try:
        if sharded(cfg):    # the grid's workers: the newest set with a manifest
            step = set_to_resume(cfg)[0]
            path = path_of(cfg, 0, step)
        else:
            path, state = read_whole(cfg)
            step = state["step"]
    except ConfigError as e:
        raise ConfigError(f"{e}; the servers' parts of checkpoint sets in {ps_folder(cfg)} "
                          f"are of steps {found}", field="resume") from None
    if any(step not in s for s in shards.values()):
        raise ConfigError(f"--resume: no complete checkpoint set in {cfg.checkpoint_dir}: "
                          f"{path} is of step {step}, the servers' parts are of steps {found}",
                          field="resume")
    newest = max(max(s) for s in shards.values())
    if newest == step:
        return step, ""
    return step, (f"--resume: the checkpoint set of step {newest} is incomplete (the "
                  f"servers' parts of steps {found}; {FILE}, written last, is of step "
                  f"{step}): resuming from step {step}, the newest complete set")


def restore(state, engine, control):
    """Load a checked state after sync.setup; returns the step to continue from.  The
    sync checks its own part (ps: that the servers resumed at the same step); a split
    run's files must all be of one step (read_share checked them against the manifest;
    this is the same check over `control`, the workers)."""
    steps = control.allgather(state["step"])
    if len(set(steps)) > 1:
        raise ConfigError(f"--resume: the ranks' checkpoint files are of different steps "
                          f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}); "
                          f"a run was stopped while writing them", field="resume")
    engine.sync.load_state_dict(state["sync"])
    with torch.no_grad():
        engine.model.load_state_dict(state["model"])
    engine.optimizer.load_state_dict(state["optimizer"])
    if engine.precision:
        engine.precision.load_state_dict(state["precision"])
    return state["step"]
