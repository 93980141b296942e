"""Where a run's files live, under --checkpoint-dir, and who writes which.

Two layouts of the files:

    checkpoint.pt      plain data parallelism: every replica holds the same state,
                       so the first (dp rank 0, cp rank 0) writes it and every rank
                       reads it
    step-<S>/rank-R.pt   a split model (--dp/--pp/--tp/--zero, --ep), or a lossy
    step-<S>/manifest.json   --compress: each rank holds a different share (a stage, a
                       tp piece, a ZeRO shard, its experts, its own residuals), so
                       each writes and reads its own; the set of step S is a folder,
                       and its manifest, written last, names every file (sets.py)
    ps/shardI-of-N-steps.npz   --sync ps or hybrid: the servers' shards, beside
                       either layout (psrv/checkpoints.py)

Context parallelism (--cp) changes neither layout.  The ranks of a context group hold
the same parameters, but not always the same state: ZeRO and the experts' replicas
shard over all dp x cp replicas, so two ranks of one group hold different shards.
So in a split run every rank writes its own file, as any rank of the grid does, and
its coordinates name its cp rank (and its ZeRO shard its place among the dp x cp
replicas); where the state is whole, the first replica writes checkpoint.pt alone.
Writing one file per context group and having the others read it would save disk
only where nothing is sharded, at the price of a second rule for who reads what.
"""
import os

from ...config.compress_spec import parse_compress

FILE = "checkpoint.pt"
PS_FOLDER = "ps"                # under --checkpoint-dir: the servers' shards
MANIFEST = "manifest.json"      # in a split run's set folder, written last
SET_PREFIX = "step-"            # a split run's set of step S: DIR/step-<S>/


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


def ps_folder(cfg):
    return os.path.join(cfg.checkpoint_dir, PS_FOLDER)


def writes_whole(ctx):
    """Whether this rank writes checkpoint.pt, the whole state that every replica
    holds: the first replica (dp rank 0, cp rank 0), so that no two ranks write it."""
    return ctx.dp_rank == 0 and (ctx.mesh is None or ctx.mesh.cp_rank == 0)


def set_steps(cfg):
    """{step: whether its folder has a manifest} of the split run's sets on disk."""
    found = {}
    for name in os.listdir(cfg.checkpoint_dir) if os.path.isdir(cfg.checkpoint_dir) else ():
        tail = name[len(SET_PREFIX):]
        if name.startswith(SET_PREFIX) and tail.isdigit():
            found[int(tail)] = os.path.isfile(
                os.path.join(cfg.checkpoint_dir, name, MANIFEST))
    return found
