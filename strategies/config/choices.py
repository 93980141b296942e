"""ConfigError, the values each choice flag may take, how an error message names a
flag, and the checks of one field alone: the bottom of strategies/.

validate.py (every rule of a config), mesh.py (Mesh) and the optimizer all check
against these tuples and raise ConfigError, so they live in a module that imports
nothing of the package: none of those files needs another one of them for a name.
"""
import dataclasses
import math

# auto: allreduce picks one of the others per call, from the size, P and the nodes
ALLREDUCE_SYNCS = ("ring", "tree", "halving_doubling", "hierarchical", "mpi", "torch", "auto")
PS_SYNCS = ("ps", "hybrid")
SYNCS = ALLREDUCE_SYNCS + PS_SYNCS + ("local",)
# the textbook all-reduces, whose point-to-point links can be slowed down (--link-*)
EMULATED_SYNCS = ("ring", "tree", "halving_doubling", "hierarchical")
MODELS = ("mlp", "gpt", "moe")
OPTIMIZERS = ("sgd", "adam")
COMPRESSIONS = ("none", "fp16", "bf16", "fp8")
CONSISTENCIES = ("bsp", "ssp", "asp")
DEVICES = ("cpu", "cuda")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
ZERO_STAGES = (0, 1, 2, 3)
# compute under autocast, fp32 master weights (precision.py); fp8: the linear layers'
# matmuls in 8 bits, the rest as bf16 (fp8_linear.py)
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# the dtype a gradient bucket is reduced in: its own (param) or widened to fp32
REDUCE_PRECISIONS = ("param", "fp32")
# the least value of each parallel degree (dp 0: what is left), for flags and Mesh alike
DEGREES = ((1, ("pp", "tp", "ep", "cp")), (0, ("dp",)))
# context parallelism's attention cores: the keys and values round a ring
# (parallel/ring_attention.py), or two all-to-alls from positions to heads (ulysses.py)
CP_KINDS = ("ring", "ulysses")
# which positions a cp rank holds: one contiguous slice, or chunks r and 2 cp - 1 - r of
# 2 cp (the zig-zag order that balances causal attention: parallel/context_order.py)
CP_ORDERS = ("contiguous", "zigzag")


class ConfigError(ValueError):
    """A bad flag, a bad combination of flags, or bad input data: reported before training.
    `field`: the TrainConfig field (or keyword, or "world_size") it is about, so that a
    front end points at its own line for it (the sweep at the line of a sweep file)."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


# how the checks of validate.py and compress_spec.py name a field in their messages
def flag_of(field, cli=True):
    return f"--{field.replace('_', '-')}" if cli else field


def setting_of(field, value, cli=True):
    """A field and its value as a message names them: `--sync local` or `sync='local'`."""
    return f"{flag_of(field)} {value}" if cli else f"{field}={value!r}"


def check_types(cfg, cli=True):
    """Every float field of a config (a dataclass) is a number, every bool field True or
    False: inf and NaN train to NaN, or hang a wait for ever (a NaN timeout), so they
    are refused where they are read; a keyword given "yes" would read as True."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag_of(f.name, cli)} must be a finite number, got {value!r}",
                              field=f.name)
        if f.type in (bool, "bool") and not isinstance(value, bool):
            raise ConfigError(f"{f.name}={value!r} must be True or False", field=f.name)


def check_values(cfg, cli=True, choices=(), positive=(), at_least=()):
    """Each field alone: `choices` pairs a field with the values it may take,
    `positive` fields must be > 0, `at_least` pairs a least value with its fields."""
    for field, options in choices:
        value = getattr(cfg, field)
        if value not in options:
            raise ConfigError(f"{flag_of(field, cli)}{' ' if cli else '='}{value!r} is not "
                              f"one of {', '.join(map(str, options))}", field=field)
    for field in positive:
        if not getattr(cfg, field) > 0:
            raise ConfigError(f"{flag_of(field, cli)} must be > 0, got {getattr(cfg, field)!r}",
                              field=field)
    for least, fields in at_least:
        for field in fields:
            if not getattr(cfg, field) >= least:
                raise ConfigError(f"{flag_of(field, cli)} must be >= {least}, "
                                  f"got {getattr(cfg, field)!r}", field=field)
