"""Checkpoints: every K steps and at the end; --resume continues the same trajectory.

    save(cfg, ctx, step, engine, run_id)       # the first replica writes, or every rank
    state = read(cfg, ctx, model)              # every rank, before training; ConfigError
    step = restore(state, engine)              # if it belongs to another model or world

What makes a resumed run reproduce the uninterrupted one: the parameters, the
optimizer state (momentum, Adam moments and step count), fp16's loss scale and
the step number.  The sync adds its own part (sync.state_dict): with --sync ps
the parameters and optimizer state live on the servers, which write their own
shards (psrv), and the part says at which step they are, for the check on
resuming; ZeRO adds its parameter shards and fp32 masters; a lossy --compress
(topk, powersgd, fp8) adds its compressor's state, this rank's error-feedback
residuals and PowerSGD's warm-start Q (compression/casts.py's state_dict), in the
all-reduce syncs and in the pushes of ps and hybrid alike.  The data needs no
state: step s's batch is a function of (seed, s) (data.py), and nothing else is
random during training (no dropout).  The run id goes on too, so that the
resumed run's records in --jsonl belong to the run they continue.

Two layouts of the files:

    checkpoint.pt      plain data parallelism: every replica holds the same state,
                       so the first (dp rank 0, cp rank 0) writes it and every rank
                       reads it
    step-<S>/rank-R.pt   a split model (--dp/--pp/--tp/--zero, --ep), or a lossy
    step-<S>/manifest.json   --compress: each rank holds a different share (a stage, a
                       tp piece, a ZeRO shard, its experts, its own residuals), so
                       each writes and reads its own; the set of step S is a folder,
                       and its manifest, written last, names every file

Context parallelism (--cp) changes neither layout.  The ranks of a context group hold
the same parameters, but not always the same state: ZeRO and the experts' replicas
shard over all dp x cp replicas, so two ranks of one group hold different shards.
So in a split run every rank writes its own file, as any rank of the grid does, and
its coordinates name its cp rank (and its ZeRO shard its place among the dp x cp
replicas); where the state is whole, the first replica writes checkpoint.pt alone.
Writing one file per context group and having the others read it would save disk
only where nothing is sharded, at the price of a second rule for who reads what.

A file is written to a temporary file in the same folder, flushed to disk, then
renamed over its name: rename is atomic, so a crash leaves the previous file or the
new one, never half a file; a temporary file a killed writer left is removed by
the rank that writes that name next (and on --resume).  Every rank reads its file
itself, so several hosts need a shared file system for --resume.  No rank goes on
past a checkpoint before all its files are written (save ends in a barrier,
bounded by --timeout like every wait of the run: waits.py).

A file knows itself: it carries the run's id and layout (the degrees, the blocks
of each pipeline stage: a stage's file numbers its layers from its own first, so a
run cut 3, 2, 2 must not read a set cut 2, 3, 2; and a lossy --compress: topk's residuals
are no warm start of PowerSGD, and a run with another compression would not be the
run that never stopped), the step, the writing
rank's coordinates (rank, dp, pp, tp, cp, expert group and ep rank, ZeRO shard) and a
sha256 of its contents (every tensor's bytes, dtype and shape and every other
value, walked in one fixed order: `digest`).  A split run's set is complete once
rank 0 has written the manifest (the run, the layout, the step, each file's rank,
coordinates and digest), after every rank wrote its file; the previous complete
set stays until then, and is removed after (a folder holds the set just written
and the complete set before it, of the same run).  --resume checks, on every rank,
before training: its file's digest against its contents (a flipped byte), its
rank, coordinates, step and run against the manifest (a swapped, copied, torn or
foreign file), the digest against the manifest's (a file of another set); any
mismatch is one line naming the file, on every rank, exit 2.  So is another layout
(another lossy --compress too), named on both sides, in either layout of the files.

Which set --resume takes (a split run): the newest folder with a manifest.  A
folder without one is a set whose writing was stopped (a kill between the ranks'
files and the manifest): it is never read, and where one is newer than the set
taken every rank says so in one line.  A set with a manifest but a damaged file is
refused, never skipped silently: the line names the file and the older complete
set, which --resume takes once the damaged folder is moved aside.

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
import hashlib
import json
import os
import shutil
import sys

import torch

from ..config.choices import ConfigError
from ..config.compress_spec import parse_compress
from ..model.models import signature
from . import waits

FILE = "checkpoint.pt"
PS_FOLDER = "ps"                # under --checkpoint-dir: the servers' shards
FORMAT = 4                      # 4: the file's identity and digest
MANIFEST = "manifest.json"      # in a split run's set folder, written last
SET_PREFIX = "step-"            # a split run's set of step S: DIR/step-<S>/
# what a run must share with the run it resumes: each rank's file holds its share
# (pp_layers: the blocks of each stage, which the trainer writes into its config;
# compress: a lossy compressor's state is each rank's own, of that compression; the
# casts keep none, layout_of leaves them out)
LAYOUT = ("dp", "pp", "tp", "ep", "zero", "virtual_stages", "sequence_parallel", "pp_layers",
          "cp", "compress")
# left out of a layout where they hold their default, so that a set written before
# they existed keeps its layout
UNSET = {"cp": 1, "compress": "none"}


def sharded(cfg):
    """Whether each rank holds a share of the state of its own (module docstring): a
    split model, or a lossy --compress, whose residuals are each rank's own."""
    return cfg.on_grid or cfg.ep > 1 or parse_compress(cfg.compress).lossy


def file_name(cfg, rank=0):
    return f"rank-{rank}.pt" if sharded(cfg) else FILE


def set_folder(cfg, step):
    """A split run's set of step `step`."""
    return os.path.join(cfg.checkpoint_dir, f"{SET_PREFIX}{step}")


def path_of(cfg, rank=0, step=None):
    """checkpoint.pt, or rank R's file of the set of step `step` (a split run)."""
    if sharded(cfg):
        return os.path.join(set_folder(cfg, step), file_name(cfg, rank))
    return os.path.join(cfg.checkpoint_dir, FILE)


def coordinates(cfg, ctx):
    """This rank's place in the run: what its file must say to be its file."""
    place = {"rank": ctx.rank}
    mesh = ctx.mesh
    if mesh is not None:
        place.update(dp=mesh.dp_rank, pp=mesh.pp_rank, tp=mesh.tp_rank)
        if cfg.cp > 1:
            place["cp"] = mesh.cp_rank
        if cfg.ep > 1:
            place.update(expert_group=mesh.expert_group, ep=mesh.ep_rank)
        if cfg.zero:
            place["zero_shard"] = mesh.dp_cp.rank    # ZeRO shards over the dp x cp replicas
    return place


def writes_whole(ctx):
    """Whether this rank writes checkpoint.pt, the whole state that every replica
    holds: the first replica (dp rank 0, cp rank 0), so that no two ranks write it."""
    return ctx.dp_rank == 0 and (ctx.mesh is None or ctx.mesh.cp_rank == 0)


def describe_place(place):
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in place.items())


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


def ps_folder(cfg):
    return os.path.join(cfg.checkpoint_dir, PS_FOLDER)


def save(cfg, ctx, step, engine, run_id):
    """`step` is the number of steps done: a resumed run starts at it.  Every worker
    calls it at `step` (ps: the servers save their part of step `step` first)."""
    sync_state = engine.sync.state_dict()  # every rank: a sync's state_dict may be collective
    entry = None
    if writes_whole(ctx) or sharded(cfg):  # every replica holds the same state
        entry = _write(cfg, ctx, step, engine, run_id, sync_state)
    if sharded(cfg):                       # the manifest, last: the set is complete
        entries = waits.allgather(ctx.workers, entry, f"the checkpoint of step {step}")
        if ctx.workers.rank == 0:
            write_manifest(cfg, step, run_id, ctx.world_size, entries)
            prune(cfg, step, run_id)
    # the set is complete before any rank goes on: none pushes step `step` to the
    # servers before they saved it, none exits while another still writes
    waits.barrier(ctx.workers, f"the barrier after the checkpoint of step {step}")


def layout_of(cfg):
    """The settings a run's shares depend on; cp only where it is set (UNSET), compress
    only where it is lossy (the test sharded() makes): a cast (fp16, bf16) keeps no
    state, so a run may resume under another cast or none, and a layout without the key
    is a run without a lossy compressor, written before or after the key existed."""
    layout = {k: getattr(cfg, k) for k in LAYOUT if getattr(cfg, k) != UNSET.get(k, ())}
    return without_casts(layout)


def without_casts(layout):
    """`layout` without a compress that keeps no state (a cast): what layout_of writes,
    and how a stored layout is read, whoever wrote it (a set may name its cast)."""
    if "compress" in layout and not parse_compress(layout["compress"]).lossy:
        layout = {k: v for k, v in layout.items() if k != "compress"}
    return layout


def differing(layout, other):
    """`layout`'s settings that `other` does not share, in LAYOUT's order, for a message:
    "pp 1, tp 2" (an unset one, such as a whole model's pp_layers, left out; cp and
    compress named by their default where `other` sets them)."""
    def value(of, k):
        return of.get(k, UNSET.get(k))
    return ", ".join(f"{k} {value(layout, k)}" for k in LAYOUT
                     if value(layout, k) not in (value(other, k), None, ""))


def _write(cfg, ctx, step, engine, run_id, sync_state):
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


def write_manifest(cfg, step, run_id, world_size, entries):
    """Rank 0, once every rank's file of step `step` is on disk: the set's manifest."""
    manifest = {"format": FORMAT, "step": step, "run_id": run_id, "world_size": world_size,
                "layout": layout_of(cfg), "files": entries}
    manifest["digest"] = digest(manifest)
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    path = os.path.join(set_folder(cfg, step), MANIFEST)
    remove_stale_temporaries(cfg, MANIFEST)
    write_atomically(path, lambda f: f.write(text))


def set_steps(cfg):
    """{step: whether its folder has a manifest} of the split run's sets on disk."""
    found = {}
    for name in os.listdir(cfg.checkpoint_dir) if os.path.isdir(cfg.checkpoint_dir) else ():
        tail = name[len(SET_PREFIX):]
        if name.startswith(SET_PREFIX) and tail.isdigit():
            found[int(tail)] = os.path.isfile(
                os.path.join(cfg.checkpoint_dir, name, MANIFEST))
    return found


def prune(cfg, step, run_id):
    """Rank 0, after the manifest of step `step`: keep that set and the complete set
    before it of the same run; remove every other set folder (an older set, one never
    finished, one of a run this one replaced or went back from)."""
    sets = set_steps(cfg)
    older = [s for s, whole in sets.items() if whole and s < step and
             _manifest_run(cfg, s) == run_id]
    keep = {step, max(older)} if older else {step}
    for s in sets:
        if s not in keep:
            shutil.rmtree(set_folder(cfg, s), ignore_errors=True)


def _manifest_run(cfg, step):
    try:
        with open(os.path.join(set_folder(cfg, step), MANIFEST)) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


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


def another_layout(cfg, where, layout):
    """The ConfigError of --resume from `where` (a file or a set), written by a run of
    `layout`, which is not this run's: one line naming what differs on both sides.  A
    split set and checkpoint.pt differ in their layout too (a lossy --compress, or a
    split model, writes a file a rank; sharded)."""
    ours = layout_of(cfg)
    return ConfigError(f"--resume: {where} was written by a run of "
                       f"{differing(layout, ours) or 'the same layout'}; this run is "
                       f"{differing(ours, layout) or 'the same layout'} (a run resumes in its "
                       f"own layout)", field="resume")


def replicas_of(dp, cp):
    """"dp(2)", or "dp(1) x cp(2)" where context parallelism cuts the replicas."""
    return f"dp({dp})" + (f" x cp({cp})" if cp > 1 else "")


def set_to_resume(cfg):
    """A split run's set for --resume: (step, note), the newest folder with a manifest
    (module docstring), and a note ("" if none) naming the newer unfinished ones."""
    sets = set_steps(cfg)
    complete = sorted(s for s, whole in sets.items() if whole)
    whole = os.path.join(cfg.checkpoint_dir, FILE)
    if not complete and os.path.isfile(whole):       # a whole run's, of another layout
        raise another_layout(cfg, whole, load(whole)["layout"])
    if not complete:
        flat = os.path.isfile(os.path.join(cfg.checkpoint_dir, "rank-0.pt"))
        raise ConfigError(
            f"--resume: no complete checkpoint set in {cfg.checkpoint_dir}" + (
                f": the folders of steps {', '.join(map(str, sorted(sets)))} have no "
                f"{MANIFEST} (their writing was stopped)" if sets else
                ": rank-R.pt files of an older topolab (no manifest)" if flat else
                f": no {SET_PREFIX}S folder"), field="resume")
    step = complete[-1]
    newer = sorted(s for s in sets if s > step)
    note = "" if not newer else (
        f"--resume: the checkpoint set of step {newer[-1]} in {cfg.checkpoint_dir} is "
        f"incomplete (no {MANIFEST}: its writing was stopped): resuming from step {step}, "
        f"the newest complete set")
    return step, note


def read_manifest(cfg, step):
    path = os.path.join(set_folder(cfg, step), MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        stored = manifest.pop("digest")
        whole = stored == digest(manifest) and manifest["step"] == step
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--resume: cannot read {path} ({e})", field="resume") from None
    if not whole:
        raise ConfigError(f"--resume: {path} is damaged: its sha256 is not the one it was "
                          f"written with", field="resume")
    if isinstance(manifest.get("layout"), dict):
        manifest["layout"] = without_casts(manifest["layout"])
    return manifest


def read_share(cfg, ctx):
    """(path, state) of this rank's file of the set to resume, checked against the
    set's manifest and this rank's place; ConfigError naming the file if it is not
    this rank's share of that set."""
    step, note = set_to_resume(cfg)
    if note:                                   # one write, so that ranks do not interleave
        sys.stderr.write(f"strategies.train rank {ctx.rank}: note: {note}\n")
        sys.stderr.flush()
    manifest = read_manifest(cfg, step)
    layout = layout_of(cfg)
    if manifest["layout"] != layout or manifest["world_size"] != ctx.world_size:
        theirs = differing(manifest["layout"], layout)
        ours = differing(layout, manifest["layout"])
        raise ConfigError(f"--resume: {set_folder(cfg, step)} is a set of a run of world "
                          f"{manifest['world_size']}, {theirs or 'the same layout'}; this run "
                          f"is world {ctx.world_size}, {ours or 'the same layout'} (a split "
                          f"run resumes in its own layout)", field="resume")
    path = path_of(cfg, ctx.rank, step)
    name, place = os.path.basename(path), coordinates(cfg, ctx)
    entry = next((e for e in manifest["files"] if e.get("file") == name), None)
    if entry is None:
        raise ConfigError(f"--resume: {os.path.join(set_folder(cfg, step), MANIFEST)} names "
                          f"no {name}", field="resume")
    remove_stale_temporaries(cfg, name)
    state = load(path)                         # its own digest: a flipped byte
    if state.get("run_id") != manifest["run_id"]:
        raise ConfigError(f"--resume: {path} is foreign: it was written by run "
                          f"{state.get('run_id')}, the set of step {step} by run "
                          f"{manifest['run_id']}", field="resume")
    if state.get("step") != step:
        raise ConfigError(f"--resume: {path} is of step {state.get('step')}, its set of "
                          f"step {step} (a set torn or mixed by hand)", field="resume")
    held = state.get("place") or {}
    if held != place or entry.get("place") != place:
        raise ConfigError(f"--resume: {path} holds the share of {describe_place(held)}, not "
                          f"this rank's ({describe_place(place)})", field="resume")
    if state["digest"] != entry.get("digest"):
        raise ConfigError(f"--resume: {path} is not the file the manifest of step {step} "
                          f"names (sha256 {state['digest'][:12]}..., the manifest's "
                          f"{str(entry.get('digest'))[:12]}...)", field="resume")
    return path, state


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
