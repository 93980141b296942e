"""One rank's file: what it holds, its sha256, how it is written and read back.

A file knows itself: it carries the run's id and layout (layout.py), the step, the
writing rank's coordinates and a sha256 of its contents (every tensor's bytes, dtype
and shape and every other value, walked in one fixed order: `digest`), beside the
state itself: the sync's part, the model, the optimizer, the precision's.  Its
tensors are saved from host memory (on_host), so a GPU run's file loads on any
machine.

A file is written to a temporary file in the same folder, flushed to disk, then
renamed over its name: rename is atomic, so a crash leaves the previous file or the
new one, never half a file; a temporary file a killed writer left is removed by
the rank that writes that name next (and on --resume).  Every rank reads its file
itself, so several hosts need a shared file system for --resume.
"""
import hashlib
import os

import torch

from ...config.choices import ConfigError
from .layout import coordinates, layout_of, without_casts
from .paths import file_name, path_of, set_folder, set_steps

FORMAT = 4                      # 4: the file's identity and digest


def digest(value):
    """sha256 of a checkpoint's contents: every tensor's dtype, shape and bytes and
    every other value, under its path, walked in a fixed order (dict keys sorted), so
    that the same state gives the same digest after torch.save and torch.load."""
    h = hashlib.sha256()
    _feed(h, "", value)
    return h.hexdigest()


def _feed(h, path, value):
    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        h.update(f"{path}:{t.dtype}{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(f"{path}:dict{len(value)}\n".encode())
        for key in sorted(value, key=repr):
            _feed(h, f"{path}/{key!r}", value[key])
    elif isinstance(value, (list, tuple)):          # a tuple may come back a list
        h.update(f"{path}:seq{len(value)}\n".encode())
        for i, item in enumerate(value):
            _feed(h, f"{path}[{i}]", item)
    else:
        h.update(f"{path}={value!r}\n".encode())


def on_host(value):
    """value with each tensor in it as a host tensor (a copy of a device one): the model,
    the optimizer's state, ZeRO's shards and masters of a GPU run are saved from host
    memory and load on any machine; load_state_dict puts them back on the device."""
    return on_device(value, torch.device("cpu"))


def on_device(value, device):
    """value with each tensor in it on `device` (a copy where it is elsewhere): on_host,
    and its way back for state that is not copied into tensors of its own on loading
    (a compressor's residuals, which its buckets' gradients on the device add into)."""
    if torch.is_tensor(value):
        return value.detach().to(device)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    return value


def write_file(cfg, ctx, step, engine, run_id, sync_state):
    """This rank's file of step `step`; returns its manifest entry."""
    os.makedirs(cfg.checkpoint_dir, mode=0o700, exist_ok=True)   # the run's state: its owner's
    final = path_of(cfg, ctx.rank, step)
    os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
    remove_stale_temporaries(cfg, file_name(cfg, ctx.rank))
    precision = engine.precision.state_dict() if engine.precision else {}
    place = coordinates(cfg, ctx)
    payload = {"format": FORMAT, "step": step, "run_id": run_id, "place": place,
               "sync": sync_state,
               "model_kind": cfg.model, "signature": engine.signature, "dp_size": ctx.dp_size,
               "cp_size": cfg.cp, "world_size": ctx.world_size, "config": cfg.as_dict(),
               "layout": layout_of(cfg), "precision": precision,
               "model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict()}
    payload = on_host(payload)
    payload["digest"] = digest(payload)
    write_atomically(final, lambda f: torch.save(payload, f))
    return {"file": os.path.basename(final), "place": place, "digest": payload["digest"]}


def write_atomically(final, write):
    """write(f) into a temporary file beside `final` (0600), flushed, renamed over it."""
    tmp = f"{final}.tmp.{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    folder = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
    try:                                   # the rename itself on disk
        os.fsync(folder)
    finally:
        os.close(folder)


def remove_stale_temporaries(cfg, name):
    """Remove NAME.tmp.PID files in the checkpoint folder and its set folders that
    another process left (a writer killed mid-write): only this rank writes NAME."""
    folders = [cfg.checkpoint_dir] + [set_folder(cfg, s) for s in set_steps(cfg)]
    mine = f"{name}.tmp.{os.getpid()}"
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for left in names:
            if left.startswith(f"{name}.tmp.") and left != mine:
                try:
                    os.remove(os.path.join(folder, left))
                except OSError:
                    pass


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
    stored = state.pop("digest", None)
    if stored != digest(state):
        raise ConfigError(f"--resume: {path} is damaged: the sha256 of its contents is not "
                          f"the one it was written with ({str(stored)[:12]}...)", field="resume")
    state["digest"] = stored
    if isinstance(state.get("layout"), dict):
        state["layout"] = without_casts(state["layout"])
    return state
