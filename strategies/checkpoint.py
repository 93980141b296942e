"""Checkpoints: every K steps and at the end; --resume continues the same trajectory.

    save(cfg, ctx, step, model, optimizer, sync, run_id)   # data-parallel rank 0 writes
    state = read(cfg, ctx, model)              # every rank, before training; ConfigError
    step = restore(state, model, optimizer, sync)   # if it belongs to another model or world

What makes a resumed run reproduce the uninterrupted one: the parameters, the
optimizer state (momentum, Adam moments and step count) and the step number.
The sync adds its own part (sync.state_dict): with --sync ps the parameters
and optimizer state live on the servers, which write their own shards (psrv),
and the part says at which step they are, for the check on resuming.  The
data needs no state: step s's batch is a function of (seed, s) (data.py), and
nothing else is random during training (no dropout).  The run id goes on too,
so that the resumed run's records in --jsonl belong to the run they continue.

A checkpoint is written to a temporary file in the same directory, flushed to
disk, then renamed over `checkpoint.pt`: rename is atomic, so a crash leaves
the previous checkpoint or the new one, never half a file.  Every rank reads
the file itself, so several hosts need a shared file system for --resume.
"""
import os

import torch

from .choices import ConfigError
from .models import signature

FILE = "checkpoint.pt"
FORMAT = 2


def path_of(cfg):
    return os.path.join(cfg.checkpoint_dir, FILE)


def save(cfg, ctx, step, model, optimizer, sync, run_id):
    """`step` is the number of steps done: a resumed run starts at it."""
    sync_state = sync.state_dict()  # every rank: a sync's state_dict may be collective
    if ctx.dp_rank != 0:
        return                      # every data-parallel replica holds the same state
    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
    payload = {"format": FORMAT, "step": step, "run_id": run_id, "sync": sync_state,
               "model_kind": cfg.model,
               "signature": signature(model), "dp_size": ctx.dp_size,
               "world_size": ctx.world_size, "config": cfg.as_dict(),
               "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
               "optimizer": optimizer.state_dict()}
    final = path_of(cfg)
    tmp = f"{final}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def read(cfg, ctx, model):
    """The checkpoint to resume from, checked against this run (before training)."""
    path = path_of(cfg)
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"--resume: cannot read {path} ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"--resume: {path} is not a topolab checkpoint (format {FORMAT})")
    mine = [(n, tuple(s)) for n, s in signature(model)]
    theirs = [(n, tuple(s)) for n, s in state["signature"]]
    if state["model_kind"] != cfg.model or mine != theirs:
        diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
        raise ConfigError(
            f"--resume: {path} holds another model ({state['model_kind']}, "
            f"{len(theirs)} tensors) than this run ({cfg.model}, {len(mine)} tensors)"
            + (f"; first difference: checkpoint {diff[1]} vs run {diff[0]}" if diff else ""))
    if state["dp_size"] != ctx.dp_size or state["world_size"] != ctx.world_size:
        raise ConfigError(
            f"--resume: {path} was written by world {state['world_size']} = "
            f"dp({state['dp_size']}), this run is world {ctx.world_size} = dp({ctx.dp_size})")
    if state["step"] > cfg.steps:
        raise ConfigError(f"--resume: the checkpoint is at step {state['step']}, "
                          f"beyond --steps {cfg.steps}")
    return state


def restore(state, model, optimizer, sync):
    """Load a checked state after sync.setup; returns the step to continue from.  The
    sync checks its own part (ps: that the servers resumed at the same step)."""
    sync.load_state_dict(state["sync"])
    with torch.no_grad():
        model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]
