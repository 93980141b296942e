"""ConfigError, the values each choice flag may take, and how an error message names a
flag: the bottom of strategies/.

combinations.py (the checks of TrainConfig and SyncOptions), mesh.py (Mesh)
and the optimizer all check against these tuples and raise ConfigError, so they
live in a module that imports nothing of the package: none of those files needs
another one of them for a name.
"""

# auto: allreduce picks one of the others per call, from the size, P and the nodes
ALLREDUCE_SYNCS = ("ring", "tree", "halving_doubling", "hierarchical", "mpi", "torch", "auto")
PS_SYNCS = ("ps", "hybrid")
SYNCS = ALLREDUCE_SYNCS + PS_SYNCS + ("local",)
# the textbook all-reduces, whose point-to-point links can be slowed down (--link-*)
EMULATED_SYNCS = ("ring", "tree", "halving_doubling", "hierarchical")
MODELS = ("mlp", "gpt", "moe")
OPTIMIZERS = ("sgd", "adam")
COMPRESSIONS = ("none", "fp16", "bf16")
CONSISTENCIES = ("bsp", "ssp", "asp")
DEVICES = ("cpu", "cuda")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
ZERO_STAGES = (0, 1, 2, 3)
# compute under autocast, fp32 master weights (precision.py)
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A bad flag, a bad combination of flags, or bad input data: reported before training.
    `field`: the TrainConfig field (or keyword, or "world_size") it is about, so that a
    front end points at its own line for it (the sweep at the line of a sweep file)."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


# how the checks of combinations.py and config/compress_spec.py name a field in their messages
def flag_of(field, cli=True):
    return f"--{field.replace('_', '-')}" if cli else field


def setting_of(field, value, cli=True):
    """A field and its value as a message names them: `--sync local` or `sync='local'`."""
    return f"{flag_of(field)} {value}" if cli else f"{field}={value!r}"
