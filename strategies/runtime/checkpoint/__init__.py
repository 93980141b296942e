"""Checkpoints: every K steps and at the end; --resume continues the same trajectory.

    save(cfg, ctx, step, engine, run_id)       # the first replica writes, or every rank
    state = read(cfg, ctx, model)              # every rank, before training; ConfigError
    step = restore(state, engine, control)     # if it belongs to another model or world

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

Its files, each importing only those above it:

    paths.py      where a run's files live (checkpoint.pt, or a set folder step-<S>/ of
                  rank-R.pt files and a manifest.json, and the servers' shards), and
                  who writes which
    layout.py     what a run must share with the run it resumes, and a rank's coordinates
    rank_file.py  one rank's file: its state, its sha256, written atomically, loaded back
    sets.py       save: every rank's file, then a split run's manifest, last; pruning; the
                  set to resume, and a rank's share checked against its manifest
    resume.py     --resume: checkpoint.pt or the set (ps's of one step too), checked
                  against this run, restored into the engine
"""
from .layout import layout_of
from .paths import ps_folder
from .rank_file import FORMAT, digest, load, on_device, on_host
from .resume import ps_set_to_resume, read, restore
from .sets import save

__all__ = ["save", "read", "restore", "ps_folder", "ps_set_to_resume", "layout_of",
           "FORMAT", "digest", "load", "on_host", "on_device"]
