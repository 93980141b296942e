"""The training configuration: one frozen dataclass, validated on construction.

    cfg = TrainConfig(sync="ring", steps=50)           # raises ConfigError if wrong
    cfg = parse_args(["--sync", "ring", "--steps", "50"])   # the same from a command line

The command line maps `--key value` onto the fields (`global_batch` is
`--global-batch`); a boolean that defaults to True is switched off with
`--no-key` (`--no-overlap`), one that defaults to False is switched on with
`--key` (`--resume`).  Every check that needs only the config is here; the
checks that also need the world size are in `dp_size_of`, so that an error
names each factor (`global batch 10 % dp(3) != 0`).
"""
import argparse
import dataclasses
from dataclasses import dataclass

# auto: allreduce picks one of the others per call, from the size, P and the nodes
ALLREDUCE_SYNCS = ("ring", "tree", "halving_doubling", "hierarchical", "mpi", "torch", "auto")
PS_SYNCS = ("ps", "hybrid")
SYNCS = ALLREDUCE_SYNCS + PS_SYNCS + ("local",)
MODELS = ("mlp", "gpt")
OPTIMIZERS = ("sgd", "adam")
COMPRESSIONS = ("none", "fp16", "bf16")
CONSISTENCIES = ("bsp", "ssp", "asp")
DEVICES = ("cpu", "cuda")
SCHEDULES = ("gpipe", "1f1b")
ZERO_STAGES = (0, 1, 2, 3)


EMULATED_SYNCS = ("ring", "tree", "halving_doubling", "hierarchical")


class ConfigError(ValueError):
    """A bad flag, a bad combination of flags, or bad input data: reported before training."""


def parse_straggler(text):
    """'RANK:SECONDS' -> (rank, seconds); ConfigError with the reason."""
    rank, sep, seconds = str(text).partition(":")
    try:
        rank, seconds = int(rank), float(seconds)
    except ValueError:
        raise ConfigError(f"--straggler {text!r} is not RANK:SECONDS (e.g. 1:0.05)") from None
    if not sep or rank < 0 or seconds < 0:
        raise ConfigError(f"--straggler {text!r} needs RANK >= 0 and SECONDS >= 0")
    return rank, seconds


@dataclass(frozen=True)
class TrainConfig:
    # synchronisation
    sync: str = "local"
    servers: int = 1              # ps / hybrid: the last `servers` ranks serve
    consistency: str = "bsp"      # ps: bsp, ssp (bounded by --staleness) or asp
    staleness: int = 0
    ranks_per_node: int = 0       # hierarchical / auto / hybrid: 0 = ranks that share a host name
    bucket_mb: float = 25.0       # gradient bucket cap (DDP's default is 25 MB as well)
    overlap: bool = True          # --no-overlap: all-reduce after backward, not during it
    compress: str = "none"        # gradients on the wire: none, fp16, bf16
    device: str = "cpu"
    threads: int = 0              # torch intra-op threads per rank; 0 = cores / ranks on host
    timeout: float = 60.0         # seconds any rank waits for a peer before giving up
    # model
    model: str = "mlp"
    width: int = 128              # mlp hidden width
    depth: int = 2                # mlp hidden layers
    layers: int = 2               # gpt blocks
    d_model: int = 64
    heads: int = 4
    vocab: int = 32               # gpt, synthetic data (byte-level text always uses 256)
    seq_len: int = 32
    # parallelism on a dp x pp x tp grid (grid.py, parallel.py, zero.py, ...)
    dp: int = 0                   # data-parallel size; 0 = what is left, world / (pp * tp)
    pp: int = 1                   # pipeline stages
    tp: int = 1                   # tensor-parallel ranks (GPT)
    zero: int = 0                 # ZeRO stage over the dp axis: 0 (plain DP), 1, 2, 3
    micro_batches: int = 1        # per step and dp replica
    schedule: str = "1f1b"        # pipeline schedule: gpipe or 1f1b
    trace: str = ""               # Chrome trace (Perfetto) of every rank's step
    # emulation (experiments): a slower network, a slow rank
    link_latency_us: float = 0.0  # per message, on the textbook all-reduce backends' links
    link_gbps: float = 0.0        # bandwidth of each rank's link; 0 = no cap
    straggler: str = ""           # RANK:SECONDS: that rank's forward pass sleeps every step
    # data
    data: str = ""                # "" = synthetic; .npz (x, y) for mlp, plain text for gpt
    in_dim: int = 32              # synthetic mlp data: input features and classes
    classes: int = 10
    dataset_size: int = 4096      # synthetic samples
    # optimisation
    steps: int = 100
    global_batch: int = 64        # split evenly across the data-parallel ranks
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    # output
    jsonl: str = ""
    checkpoint_dir: str = ""
    checkpoint_every: int = 0     # 0 = only at the end (when --checkpoint-dir is given)
    resume: bool = False
    params_out: str = ""          # .npz of the final parameters (for equivalence checks)
    progress: bool = True         # --no-progress: no tqdm bar on rank 0

    def __post_init__(self):
        def choose(field, options):
            value = getattr(self, field)
            if value not in options:
                raise ConfigError(f"--{field.replace('_', '-')} {value!r} is not one of "
                                  f"{', '.join(map(str, options))}")

        choose("sync", SYNCS)
        choose("model", MODELS)
        choose("optimizer", OPTIMIZERS)
        choose("compress", COMPRESSIONS)
        choose("consistency", CONSISTENCIES)
        choose("device", DEVICES)
        choose("schedule", SCHEDULES)
        choose("zero", ZERO_STAGES)
        for field in ("steps", "global_batch", "width", "depth", "layers", "d_model", "heads",
                      "vocab", "seq_len", "in_dim", "classes", "dataset_size", "servers",
                      "pp", "tp", "micro_batches"):
            if getattr(self, field) < 1:
                raise ConfigError(f"--{field.replace('_', '-')} must be >= 1, "
                                  f"got {getattr(self, field)}")
        for field in ("staleness", "ranks_per_node", "checkpoint_every", "threads", "momentum",
                      "weight_decay", "dp"):
            if getattr(self, field) < 0:
                raise ConfigError(f"--{field.replace('_', '-')} must be >= 0, "
                                  f"got {getattr(self, field)}")
        if self.link_latency_us < 0 or self.link_gbps < 0:
            raise ConfigError("--link-latency-us and --link-gbps must be >= 0")
        if (self.link_latency_us or self.link_gbps) and self.sync not in EMULATED_SYNCS:
            raise ConfigError(f"link emulation slows the textbook all-reduces "
                              f"({', '.join(EMULATED_SYNCS)}), not --sync {self.sync}")
        if self.straggler:
            parse_straggler(self.straggler)
            if self.on_grid:
                raise ConfigError("--straggler is not supported with --dp/--pp/--tp/--zero yet")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"--bucket-mb must be > 0, got {self.bucket_mb}")
        if self.model == "gpt" and self.d_model % self.heads:
            raise ConfigError(f"--d-model {self.d_model} is not divisible by --heads {self.heads}")
        if self.consistency == "bsp" and self.staleness:
            raise ConfigError("--staleness needs --consistency ssp (bsp waits for every worker)")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir")
        if self.on_grid and self.sync not in ALLREDUCE_SYNCS:
            what = f"--zero {self.zero}" if self.zero else "--dp/--pp/--tp/--micro-batches"
            raise ConfigError(f"{what} needs an all-reduce --sync ({', '.join(ALLREDUCE_SYNCS)}),"
                              f" not --sync {self.sync}: the grid's axes talk through collectives")
        if self.on_grid and self.device != "cpu":
            raise ConfigError("--dp/--pp/--tp/--zero run on --device cpu only so far "
                              "(activations travel through the MPI transport, not NCCL)")
        if self.on_grid and self.checkpoint_dir:
            raise ConfigError("checkpoints are not supported with --dp/--pp/--tp/--zero yet")

    @property
    def straggler_rank(self):
        return parse_straggler(self.straggler)[0] if self.straggler else None

    @property
    def straggler_seconds(self):
        return parse_straggler(self.straggler)[1] if self.straggler else 0.0

    @property
    def on_grid(self):
        """Whether the run needs the dp x pp x tp worker (parallel.py), not the plain loop."""
        return bool(self.dp or self.pp > 1 or self.tp > 1 or self.zero or
                    self.micro_batches > 1)

    @property
    def synchronous(self):
        """Whether every step sees every worker's gradients of the same step."""
        return self.sync not in PS_SYNCS or self.consistency == "bsp"

    def as_dict(self):
        return dataclasses.asdict(self)


def dp_size_of(cfg, world_size):
    """The data-parallel size, after checking that the world and the batch fit it."""
    servers = cfg.servers if cfg.sync in PS_SYNCS else 0
    dp = world_size - servers
    where = f"world {world_size} = dp({dp}) + servers({servers})" if servers else \
        f"world {world_size} = dp({dp})"
    if cfg.on_grid:                        # world = dp x pp x tp (grid.py names each factor)
        from .grid import ProcessGrid
        grid = ProcessGrid(world_size, cfg.dp, cfg.pp, cfg.tp)
        dp, where = grid.dp, grid.describe()
    if dp < 1:
        raise ConfigError(f"no worker left: {where}; use fewer --servers or more ranks")
    if cfg.straggler and cfg.straggler_rank >= world_size:
        raise ConfigError(f"--straggler rank {cfg.straggler_rank} is not a rank "
                          f"(world size {world_size})")
    if cfg.sync == "local" and world_size != 1:
        raise ConfigError(f"--sync local runs on one process, not {world_size}")
    if cfg.global_batch % dp:
        raise ConfigError(f"--global-batch {cfg.global_batch} is not divisible by the "
                          f"data-parallel size: {cfg.global_batch} % dp({dp}) = "
                          f"{cfg.global_batch % dp} ({where})")
    if cfg.sync == "hybrid" and cfg.ranks_per_node and dp % cfg.ranks_per_node:
        raise ConfigError(f"--ranks-per-node {cfg.ranks_per_node} does not divide dp({dp}) "
                          f"into whole nodes ({where})")
    return dp


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # raise instead of exiting, so that every rank reports it
        raise ConfigError(message)


def parser():
    p = _Parser(prog="python -m strategies.train", add_help=True,
                description="One training worker; --sync picks the gradient synchronisation.")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            if f.default:
                p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name,
                               action="store_false")
            else:
                p.add_argument(flag, dest=f.name, action="store_true")
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            p.add_argument(flag, dest=f.name, type=kind, default=f.default,
                           metavar=f.name.upper())
    return p


def parse_args(argv=None):
    """A TrainConfig from command-line arguments (ConfigError on any problem)."""
    return TrainConfig(**vars(parser().parse_args(argv)))
