"""The training configuration: one frozen dataclass, the flat union of the sections.

    cfg = TrainConfig(sync="ring", steps=50)           # raises ConfigError if wrong
    cfg = parse_args(["--sync", "ring", "--steps", "50"])   # the same from a command line
    cfg.compress, cfg.zero                             # every field, flat
    cfg.section(SyncOptions)                           # one section of it (sections.py)

Each field is written once, in its section (sections.py), with its meaning; TrainConfig
is made of the sections' fields in their order, each field's metadata naming its
section and its help text.  The command line maps `--key value` onto the fields
(`global_batch` is `--global-batch`); a boolean that defaults to True is switched
off with `--no-key` (`--no-overlap`), one that defaults to False is switched on with
`--key` (`--resume`).  Construction runs validate.check_flags (the config alone);
validate.check_world adds the world size, so that an error names each factor
(`global batch 10 % dp(3) != 0`).
"""
import argparse
import dataclasses
import os

from allreduce.cli import dataclass_flags, field_comments

from .choices import ALLREDUCE_SYNCS, PS_SYNCS, SYNCS, ConfigError, flag_of
from .mesh import needs_grid
from .sections import SECTIONS
from .validate import check_flags, check_world, parse_straggler, world_of

__all__ = ["ALLREDUCE_SYNCS", "PS_SYNCS", "SYNCS", "ConfigError", "TrainConfig",
           "check_checkpoint_dir", "check_outputs", "check_world", "parse_args",
           "parse_straggler", "parser", "world_of"]


class Settings:
    """What TrainConfig adds to its fields: the checks on construction, the sections,
    and the values derived from several fields."""

    def __post_init__(self):
        check_flags(self)
        if self.grad_accum > 1:
            # one concept: accumulating K micro-batches is what a schedule does, the
            # pipeline's or the trivial one of one stage, so --grad-accum K is
            # --micro-batches K on every run (on the grid it is left at 1 in the record)
            object.__setattr__(self, "micro_batches", self.grad_accum)
            if self.on_grid:
                object.__setattr__(self, "grad_accum", 1)

    @classmethod
    def of(cls, *sections, **fields):
        """A TrainConfig of these sections' values (and `fields`), the rest defaults."""
        values = {k: v for s in sections for k, v in dataclasses.asdict(s).items()}
        return cls(**values, **fields)

    def section(self, kind):
        """This config's section `kind` (a class of sections.py), e.g. SyncOptions."""
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    @property
    def straggler_rank(self):
        return parse_straggler(self.straggler)[0] if self.straggler else None

    @property
    def straggler_seconds(self):
        return parse_straggler(self.straggler)[1] if self.straggler else 0.0

    @property
    def on_grid(self):
        """Whether the model is cut over a dp x pp x tp grid (mesh.needs_grid), not kept whole."""
        return needs_grid(vars(self))

    @property
    def blocks(self):
        """(how many blocks the model stacks, the flag that sets them): what a pipeline
        splits into stages."""
        return (self.layers, "--layers") if self.model == "gpt" else (self.depth, "--depth")

    @property
    def synchronous(self):
        """Whether every step sees every worker's gradients of the same step."""
        return self.sync not in PS_SYNCS or self.consistency == "bsp"

    @property
    def compressor_momentum(self):
        """The momentum top-k keeps per rank (--momentum-correction: DGC's, taken from the
        optimizer, which then runs without it); 0 = none."""
        return self.momentum if self.momentum_correction else 0.0

    def as_dict(self):
        return dataclasses.asdict(self)


def flat_fields(sections):
    """(name, type, field) of every field of the sections, in order: its default, and its
    section and help text as metadata (a field in two sections is a TypeError)."""
    seen, out = {}, []
    for section in sections:
        comments = field_comments(section)
        for f in dataclasses.fields(section):
            if f.name in seen:
                raise TypeError(f"field {f.name!r} is in {seen[f.name].__name__} and "
                                f"{section.__name__}: a setting has one section")
            seen[f.name] = section
            out.append((f.name, f.type, dataclasses.field(
                default=f.default, metadata={"section": section, "help": comments[f.name]})))
    return out


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", flat_fields(SECTIONS), bases=(Settings,), frozen=True,
    namespace={"__module__": __name__, "__doc__": "Every setting of a run, flat: the fields "
               "of the sections of sections.py, validated on construction (validate.py)."})


def check_outputs(cfg, writer):
    """The files the run will write, before it starts: a run that trains to the end and
    then finds no folder for its parameters loses them.  `writer`: whether this rank
    writes the records, the parameters and the trace (every rank may checkpoint)."""
    outputs = [("params_out", cfg.params_out), ("trace", cfg.trace), ("jsonl", cfg.jsonl)]
    for field, path in outputs if writer else ():
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise ConfigError(f"{flag_of(field)} {path}: no folder {folder} to write it in"
                              if not os.path.isdir(folder) else
                              f"{flag_of(field)} {path}: the folder {folder} is not writable",
                              field=field)
        if path and os.path.isdir(path):
            raise ConfigError(f"{flag_of(field)} {path} is a folder, not a file", field=field)
    check_checkpoint_dir(cfg)


def check_checkpoint_dir(cfg):
    """--checkpoint-dir names a folder, or nothing yet (it is made)."""
    if cfg.checkpoint_dir and os.path.exists(cfg.checkpoint_dir) and \
            not os.path.isdir(cfg.checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {cfg.checkpoint_dir} is a file, not a folder",
                          field="checkpoint_dir")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # raise instead of exiting, so that every rank reports it
        raise ConfigError(message)


def parser():
    """The trainer's command line: a flag per TrainConfig field, its help the field's comment."""
    p = _Parser(prog="python -m strategies.train",
                description="One training worker; --sync picks the gradient synchronisation.")
    return dataclass_flags(p, TrainConfig)


def parse_args(argv=None):
    """A TrainConfig from command-line arguments (ConfigError on any problem)."""
    return TrainConfig(**vars(parser().parse_args(argv)))
