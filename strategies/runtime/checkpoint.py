"""Checkpoints: every K steps and at the end; --resume continues the same trajectory.

    save(cfg, ctx, step, engine, run_id)       # data-parallel rank 0 writes, or every rank
    state = read(cfg, ctx, model)              # every rank, before training; ConfigError
    step = restore(state, engine)              # if it belongs to another model or world

What makes a resumed run reproduce the uninterrupted one: the parameters, the
optimizer state (momentum, Adam moments and step count), fp16's loss scale and
the step number.  The sync adds its own part (sync.state_dict): with --sync ps
the parameters and optimizer state live on the servers, which write their own
shards (psrv), and the part says at which step they are, for the check on
resuming; ZeRO adds its parameter shards and fp32 masters.  The data needs no
state: step s's batch is a function of (seed, s) (data.py), and nothing else is
random during training (no dropout).  The run id goes on too, so that the
resumed run's records in --jsonl belong to the run they continue.

Two layouts of the files:

    checkpoint.pt      plain data parallelism: every replica holds the same state,
                       so data-parallel rank 0 writes it and every rank reads it
    rank-R.pt          a split model (--dp/--pp/--tp/--zero, --ep): each rank holds
                       a different share (a stage, a tp piece, a ZeRO shard, its
                       experts), so each writes and reads its own.  A resume needs
                       the same layout; the files are checked to be of one step

A checkpoint is written to a temporary file in the same directory, flushed to
disk, then renamed over its name: rename is atomic, so a crash leaves the
previous checkpoint or the new one, never half a file.  Every rank reads the
file itself, so several hosts need a shared file system for --resume.  No rank
goes on past a checkpoint before all its files are written (save ends in a barrier).

With --sync ps or hybrid a checkpoint is a SET of one step s: the servers' shards
DIR/ps/shardI-of-N-steps.npz and the workers' checkpoint.pt.  Every worker is at s
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

from ..config.choices import ConfigError
from ..model.models import signature

FILE = "checkpoint.pt"
PS_FOLDER = "ps"                # under --checkpoint-dir: the servers' shards
FORMAT = 3
# what a split run must share with the run it resumes: each rank's file holds its share
LAYOUT = ("dp", "pp", "tp", "ep", "zero", "virtual_stages", "sequence_parallel")


def sharded(cfg):
    """Whether each rank holds a share of the state of its own (module docstring)."""
    return cfg.on_grid or cfg.ep > 1


def path_of(cfg, rank=0):
    name = f"rank-{rank}.pt" if sharded(cfg) else FILE
    return os.path.join(cfg.checkpoint_dir, name)


def ps_folder(cfg):
    return os.path.join(cfg.checkpoint_dir, PS_FOLDER)


def save(cfg, ctx, step, engine, run_id):
    """`step` is the number of steps done: a resumed run starts at it.  Every worker
    calls it at `step` (ps: the servers save their part of step `step` first)."""
    sync_state = engine.sync.state_dict()  # every rank: a sync's state_dict may be collective
    if ctx.dp_rank == 0 or sharded(cfg):   # every data-parallel replica holds the same state
        _write(cfg, ctx, step, engine, run_id, sync_state)
    # the set is complete before any rank goes on: none pushes step `step` to the
    # servers before they saved it, none exits while another still writes
    ctx.workers.barrier()


def _write(cfg, ctx, step, engine, run_id, sync_state):
    os.makedirs(cfg.checkpoint_dir, mode=0o700, exist_ok=True)   # the run's state: its owner's
    precision = engine.precision.state_dict() if engine.precision else {}
    payload = {"format": FORMAT, "step": step, "run_id": run_id, "sync": sync_state,
               "model_kind": cfg.model, "signature": engine.signature, "dp_size": ctx.dp_size,
               "world_size": ctx.world_size, "config": cfg.as_dict(),
               "layout": {k: getattr(cfg, k) for k in LAYOUT}, "precision": precision,
               "model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict()}
    payload = on_host(payload)
    final = path_of(cfg, ctx.rank)
    tmp = f"{final}.tmp.{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def on_host(value):
    """value with each tensor in it as a host tensor (a copy of a device one): the model,
    the optimizer's state, ZeRO's shards and masters of a GPU run are saved from host
    memory and load on any machine; load_state_dict puts them back on the device."""
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_host(v) for v in value)
    return value


def load(path):
    """A checkpoint file's state, or ConfigError saying why it cannot be one."""
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: no checkpoint at {path}", field="resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"--resume: cannot read {path} ({e})", field="resume") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"--resume: {path} is not a topolab checkpoint (format {FORMAT})",
                          field="resume")
    return state


def ps_set_to_resume(cfg):
    """--resume under --sync ps/hybrid: (step, note) of the newest complete set, where
    the note ("" if none) says which newer parts there are; ConfigError if no set is
    complete.  The workers' checkpoint.pt names the only step that can be."""
    from psrv.checkpoints import saved_steps        # here: psrv needs ZeroMQ
    path = path_of(cfg)
    shards = saved_steps(ps_folder(cfg), cfg.servers)
    found = "; ".join(f"shard {i}: {', '.join(map(str, s)) or 'none'}"
                      for i, s in shards.items())
    try:
        step = load(path)["step"]
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


def read(cfg, ctx, model):
    """The checkpoint to resume from, checked against this run (before training)."""
    path = path_of(cfg, ctx.rank)
    state = load(path)
    mine = [(n, tuple(s)) for n, s in signature(model)]
    theirs = [(n, tuple(s)) for n, s in state["signature"]]
    if state["model_kind"] != cfg.model or mine != theirs:
        diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
        raise ConfigError(
            f"--resume: {path} holds another model ({state['model_kind']}, "
            f"{len(theirs)} tensors) than this run ({cfg.model}, {len(mine)} tensors)"
            + (f"; first difference: checkpoint {diff[1]} vs run {diff[0]}" if diff else ""),
                          field="resume")
    if state["dp_size"] != ctx.dp_size or state["world_size"] != ctx.world_size:
        raise ConfigError(
            f"--resume: {path} was written by world {state['world_size']} = "
            f"dp({state['dp_size']}), this run is world {ctx.world_size} = dp({ctx.dp_size})",
                          field="resume")
    layout = {k: getattr(cfg, k) for k in LAYOUT}
    if sharded(cfg) and state["layout"] != layout:
        theirs = ", ".join(f"{k} {v}" for k, v in state["layout"].items() if layout[k] != v)
        ours = ", ".join(f"{k} {v}" for k, v in layout.items() if state["layout"][k] != v)
        raise ConfigError(f"--resume: {path} holds one rank's share of a run of {theirs}; "
                          f"this run is {ours} (a split run resumes in its own layout)",
                          field="resume")
    if state["step"] > cfg.steps:
        raise ConfigError(f"--resume: the checkpoint is at step {state['step']}, "
                          f"beyond --steps {cfg.steps}", field="resume")
    return state


def restore(state, engine, control):
    """Load a checked state after sync.setup; returns the step to continue from.  The
    sync checks its own part (ps: that the servers resumed at the same step); a split
    run's files must all be of one step (collective over `control`, the workers)."""
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
