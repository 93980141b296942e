"""Where a shard's checkpoints go: one file of its own, or one file per step of a set.

    shard0-of-2.npz          the shard's own checkpoint (psrv.server alone): written every
                             --checkpoint-every steps, on a CHECKPOINT without a step and
                             on SIGINT/SIGTERM, each time over the last
    shard0-of-2-step150.npz  the shard's part of the checkpoint SET of step 150: written
                             only when a worker asks for that step (CHECKPOINT with a step)

A set is what a trainer with workers of its own state needs (strategies, --sync ps):
the shards and the workers' file of ONE step.  The workers ask every shard for step
s, each shard checks that every live worker is exactly at s (store.off_step), writes
its file and answers; then the workers write theirs, last, which completes the set.
A shard keeps the files of the last two steps asked for (and, after a resume, of the
step it resumed from), never the older ones: the set the workers' file names is one of
them until the next workers' file replaces it, so a signal or a crash at any moment
leaves a complete set behind.  Every file is written to a temporary name and renamed
(store.save), so a reader sees the old file or the new one, never half of one.
"""
import os
import re

from . import protocol as P

STEP_FILE = re.compile(r"shard(\d+)-of-(\d+)-step(\d+)\.npz")


def shard_file(folder, shard, num_shards, step=None):
    """The shard's own file (step None), or its part of the set of `step`."""
    tail = "" if step is None else f"-step{step}"
    return os.path.join(folder, f"shard{shard}-of-{num_shards}{tail}.npz")


def saved_steps(folder, num_shards):
    """{shard: sorted steps of the set files in `folder`} for each of num_shards shards."""
    steps = {shard: [] for shard in range(num_shards)}
    names = os.listdir(folder) if os.path.isdir(folder) else []
    for match in filter(None, map(STEP_FILE.fullmatch, names)):
        shard, of, step = map(int, match.groups())
        if of == num_shards and shard < num_shards:
            steps[shard].append(step)
    return {shard: sorted(s) for shard, s in steps.items()}


def requested_step(frame):
    """The step a CHECKPOINT's frame names (None: the shard's own file), or ValueError."""
    frame = bytes(frame[:P.CHECKPOINT_STEP.size + 1])
    if len(frame) != P.CHECKPOINT_STEP.size:
        raise ValueError(f"CHECKPOINT's step frame is {len(frame)} bytes, not "
                         f"{P.CHECKPOINT_STEP.size}")
    step, = P.CHECKPOINT_STEP.unpack(frame)
    if step < -1:
        raise ValueError(f"CHECKPOINT of step {step}: a step is >= 0 (-1: the shard's own file)")
    return None if step == -1 else step


class ShardCheckpoints:
    """One shard's checkpoints in `folder` (None: it writes none).  every: steps between
    its own periodic checkpoints (0: none); resumed_step: the set step it was loaded
    from (None: its own file), which it keeps until two later sets are written."""

    def __init__(self, folder, shard, num_shards, every=0, resume_step=None):
        self.folder, self.shard, self.num_shards, self.every = folder, shard, num_shards, every
        self.resume_step = resume_step
        self.last_own = 0                    # step of the own file written last
        self.kept = [] if resume_step is None else [resume_step]    # set steps kept

    def load(self, store):
        """On a resume: the set's file of resume_step, or the own file if there is one.
        Returns the path loaded, or None."""
        path = shard_file(self.folder, self.shard, self.num_shards, self.resume_step)
        if self.resume_step is None and not os.path.exists(path):
            return None
        store.load(path)
        self.last_own = store.steps_done()
        return path

    def write(self, store, force=False, step=None):
        """The part of the set of `step`; without a step the own file, when forced or
        when the periodic one is due.  Returns the path written, or None."""
        if step is not None:
            return self.save_step(store, step)
        if not force and not (self.every and store.steps_done() >= self.last_own + self.every):
            return None
        path = shard_file(self.folder, self.shard, self.num_shards)
        store.save(path)
        self.last_own = store.steps_done()
        return path

    def save_step(self, store, step):
        """The shard's part of the set of `step`: refused unless every live worker is
        exactly at `step`; then the files of all but the last two steps go."""
        problem = store.off_step(step)
        if problem:
            raise ValueError(f"a checkpoint of step {step} was asked for, but {problem}: "
                             f"a checkpoint set holds every worker at one step")
        path = shard_file(self.folder, self.shard, self.num_shards, step)
        store.save(path)
        self.kept = ([s for s in self.kept if s != step] + [step])[-2:]
        for old in saved_steps(self.folder, self.num_shards)[self.shard]:
            if old not in self.kept:
                os.remove(shard_file(self.folder, self.shard, self.num_shards, old))
        return path
