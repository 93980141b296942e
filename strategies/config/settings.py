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
from .validate import (check_flags, check_world, gating_group, parse_pp_layers,
                       parse_straggler, world_of)

__all__ = ["ALLREDUCE_SYNCS", "PS_SYNCS", "SYNCS", "ConfigError", "TrainConfig",
           "check_checkpoint_dir", "check_memory", "check_outputs", "check_ranges",
           "check_world", "memory_floor", "parse_args", "parse_straggler", "parser",
           "with_moe_group", "world_of"]

INT_MAX = 2**63 - 1      # numpy's int64 and torch's seeds: a larger int overflows in them
LONGEST_WAIT_S = 10**6   # ~11.6 days: longer waits overflow time.sleep and torch's timedelta
THREADS_PER_CORE = 4     # --threads: at most this many a core of the host
SLOWEST_LINK_GBPS = 1e-3  # 1 Mbit/s: a 25 MB bucket takes 200 s; slower ones overflow sleeps


class Settings:
    """What TrainConfig adds to its fields: the checks on construction, the sections,
    and the values derived from several fields."""

    def __post_init__(self):
        check_flags(self)
        check_ranges(self)
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
    def stage_split(self):
        """--pp-layers as a tuple of blocks per stage, or None (the balanced split)."""
        return parse_pp_layers(self.pp_layers) if self.pp_layers else None

    @property
    def blocks(self):
        """(how many blocks the model stacks, the flag that sets them): what a pipeline
        splits into stages."""
        return (self.layers, "--layers") if self.model in ("gpt", "moe") else (self.depth, "--depth")

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


def with_moe_group(cfg, dp):
    """cfg with --moe-group's default written in at data-parallel size dp: 0 becomes the
    sequences of one forward call of a replica, one micro-batch of its local batch
    (validate.gating_group), so that the records and checkpoints name the gating group
    in force.  Without --cp the one-process reference can be read off them: --moe-group
    that many sequences.  Under --cp a rank gates only its T / cp positions of those
    sequences (its slice or zig-zag chunks, parallel/context_order.py): a group of
    moe_group x T / cp tokens, each with a capacity of its own, which no --moe-group of
    one process over whole sequences reproduces.  check_world first."""
    if cfg.model != "moe" or cfg.moe_group:
        return cfg
    return dataclasses.replace(cfg, moe_group=gating_group(0, cfg.global_batch // dp,
                                                           cfg.micro_batches))


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


def check_ranges(cfg):
    """What check_flags leaves to the machine: an int beyond int64 (a seed of 2**70
    overflows in torch.manual_seed), waits so long that the clock's arithmetic
    overflows (--timeout 1e300 under torch, --straggler 0:1e300), and links so slow
    that one bucket's emulated transfer does."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_MAX:
            raise ConfigError(f"{flag_of(f.name)} {value} is out of range: at most "
                              f"2**63 - 1 = {INT_MAX}", field=f.name)
    waits = (("timeout", cfg.timeout, "--timeout"),
             ("straggler", cfg.straggler_seconds, f"--straggler {cfg.straggler}"),
             ("link_latency_us", cfg.link_latency_us / 1e6, "--link-latency-us"))
    for field, seconds, flag in waits:
        if seconds > LONGEST_WAIT_S:
            raise ConfigError(f"{flag}: {seconds:g} s is longer than any wait can be here "
                              f"(at most {LONGEST_WAIT_S:g} s)", field=field)
    if 0 < cfg.link_gbps < SLOWEST_LINK_GBPS:
        raise ConfigError(f"--link-gbps {cfg.link_gbps:g} is slower than the slowest link "
                          f"emulated ({SLOWEST_LINK_GBPS:g} Gbit/s = 1 Mbit/s); 0 = no cap",
                          field="link_gbps")


def parameter_count(cfg):
    """The whole model's parameters as the flags size it (model/models.py's layers),
    before the data may change its input and output (a --data file)."""
    if cfg.model == "mlp":
        dims = [cfg.in_dim] + [cfg.width] * cfg.depth + [cfg.classes]
        return sum(a * b + b for a, b in zip(dims, dims[1:]))
    d, vocab = cfg.d_model, cfg.vocab if not cfg.data else 256
    kv = (cfg.kv_heads or cfg.heads) * (d // cfg.heads)     # keys' and values' width
    f = cfg.ffn_hidden or 4 * d
    mlp = (3 * d * f + 2 * f if cfg.gated_mlp else 2 * d * f + f) + d
    if cfg.model == "moe":
        mlp = cfg.experts * (8 * d * d + 5 * d) + d * cfg.experts
    block = 4 * d + (d + 2 * kv) * (d + 1) + (d * d + d) + mlp
    return 2 * vocab * d + cfg.seq_len * d + cfg.layers * block + 2 * d


def memory_floor(cfg, dp):
    """{part: bytes}: a floor of what one rank allocates (less than it will), so that a
    run refused on it could never have fitted.  Every rank builds the whole model
    (fp32) before parallelize cuts it, then holds gradients and optimizer state of its
    pp x tp share; every rank builds the global batch's indices (int64); its dp share
    of the batch goes through the model (inputs and the activations of one pass); the
    synthetic data are made whole on every rank (model/data.py)."""
    psi = parameter_count(cfg)
    state = 4 + {"adam": 8}.get(cfg.optimizer, 4 if cfg.momentum else 0)
    local = -(-cfg.global_batch // max(dp, 1))
    if cfg.model == "mlp":
        per_sample = 4 * (cfg.in_dim + 2 * cfg.width * cfg.depth + cfg.classes)
        data = 0 if cfg.data else 12 * cfg.dataset_size * cfg.in_dim
    else:
        vocab, S = (cfg.vocab if not cfg.data else 256), cfg.seq_len
        per_sample = 4 * S * (8 * cfg.d_model * cfg.layers + 2 * vocab) + \
            4 * cfg.heads * S * S * cfg.layers
        data = 0 if cfg.data else 16 * vocab * vocab + 16 * cfg.dataset_size * (S + 1) + \
            9 * cfg.dataset_size * vocab
    return {"parameters": 4 * psi + state * psi // (cfg.pp * cfg.tp),
            "data": data, "batch indices": 8 * cfg.global_batch,
            "activations": local * per_sample}


# the flags that size each part of memory_floor, for the message
SIZED_BY = {"parameters": {"mlp": "--width, --depth, --in-dim, --classes",
                           "gpt": "--d-model, --layers, --vocab, --seq-len",
                           "moe": "--d-model, --layers, --experts, --vocab"},
            "data": "--dataset-size, --in-dim, --vocab, --seq-len",
            "batch indices": "--global-batch",
            "activations": "--global-batch over dp, the model's widths"}


def gib(nbytes):
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes < 2**40 * 1000 else f"{nbytes / 2**40:,.0f} TiB"


def check_memory(cfg, dp, ranks_on_host, available=None):
    """Refuse --threads beyond THREADS_PER_CORE a core, and a run whose floor
    (memory_floor) is more than this host's free memory (MemAvailable) shared by its
    ranks, with the figure, before anything is built:
    such a run used to end in a traceback from the allocator (--width 3000000: 36 TB)
    or to grow until the kernel killed it (--global-batch 10**12)."""
    cores = os.cpu_count() or 1
    if cfg.threads > THREADS_PER_CORE * cores:     # 10**8 threads crashed torch (SIGSEGV)
        raise ConfigError(f"--threads {cfg.threads} is more than {THREADS_PER_CORE} a core of "
                          f"this host's {cores} cores", field="threads")
    if available is None:
        from allreduce.bench_setup import available_memory
        available = available_memory()
    if available is None:                          # not Linux: nothing to compare with
        return
    parts = memory_floor(cfg, dp)
    need, share = sum(parts.values()), available // max(ranks_on_host, 1)
    if need <= share:
        return
    part = max(parts, key=parts.get)
    by = SIZED_BY[part]
    by = by[cfg.model] if isinstance(by, dict) else by
    raise ConfigError(f"the run needs at least {gib(need)} a rank ({part} {gib(parts[part])}: "
                      f"{by}), more than the {gib(share)} this host has free for each of its "
                      f"{ranks_on_host} rank(s)", field="global_batch" if part != "parameters"
                      else "model")


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
