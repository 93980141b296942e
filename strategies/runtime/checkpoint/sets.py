"""A checkpoint of one step: every rank's file, then a split run's manifest, last.

No rank goes on past a checkpoint before all its files are written (save ends in a
barrier, bounded by --timeout like every wait of the run: waits.py).

A split run's set is complete once rank 0 has written the manifest (the run, the
layout, the step, each file's rank, coordinates and digest), after every rank wrote
its file; the previous complete set stays until then, and is removed after (a folder
holds the set just written and the complete set before it, of the same run).
--resume checks, on every rank, before training: its file's digest against its
contents (a flipped byte), its rank, coordinates, step and run against the manifest
(a swapped, copied, torn or foreign file), the digest against the manifest's (a file
of another set); any mismatch is one line naming the file, on every rank, exit 2.
So is another layout (another lossy --compress too), named on both sides, in either
layout of the files.

Which set --resume takes (a split run): the newest folder with a manifest.  A
folder without one is a set whose writing was stopped (a kill between the ranks'
files and the manifest): it is never read, and where one is newer than the set
taken every rank says so in one line.  A set with a manifest but a damaged file is
refused, never skipped silently: the line names the file and the older complete
set, which --resume takes once the damaged folder is moved aside.
"""
import json
import os
import shutil
import sys

from ...config.choices import ConfigError
from .. import waits
from .layout import another_layout, coordinates, describe_place, differing, layout_of, \
    without_casts
from .paths import FILE, MANIFEST, SET_PREFIX, path_of, set_folder, set_steps, sharded, \
    writes_whole
from .rank_file import FORMAT, digest, load, remove_stale_temporaries, write_atomically, \
    write_file


def save(cfg, ctx, step, engine, run_id):
    """`step` is the number of steps done: a resumed run starts at it.  Every worker
    calls it at `step` (ps: the servers save their part of step `step` first)."""
    sync_state = engine.sync.state_dict()  # every rank: a sync's state_dict may be collective
    entry = None
    if writes_whole(ctx) or sharded(cfg):  # every replica holds the same state
        entry = write_file(cfg, ctx, step, engine, run_id, sync_state)
    if sharded(cfg):                       # the manifest, last: the set is complete
        entries = waits.allgather(ctx.workers, entry, f"the checkpoint of step {step}")
        if ctx.workers.rank == 0:
            write_manifest(cfg, step, run_id, ctx.world_size, entries)
            prune(cfg, step, run_id)
    # the set is complete before any rank goes on: none pushes step `step` to the
    # servers before they saved it, none exits while another still writes
    waits.barrier(ctx.workers, f"the barrier after the checkpoint of step {step}")


def write_manifest(cfg, step, run_id, world_size, entries):
    """Rank 0, once every rank's file of step `step` is on disk: the set's manifest."""
    manifest = {"format": FORMAT, "step": step, "run_id": run_id, "world_size": world_size,
                "layout": layout_of(cfg), "files": entries}
    manifest["digest"] = digest(manifest)
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    path = os.path.join(set_folder(cfg, step), MANIFEST)
    remove_stale_temporaries(cfg, MANIFEST)
    write_atomically(path, lambda f: f.write(text))


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
