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
import os
from dataclasses import dataclass

from allreduce.cli import dataclass_flags

from .choices import (ALLREDUCE_SYNCS, DEVICES, MODELS, PRECISIONS, PS_SYNCS, SCHEDULES, SYNCS,
                      ZERO_STAGES, ConfigError, flag_of)
from .combinations import check_moe, check_precision, check_schedule, check_sync, check_values
from .mesh import Mesh, needs_grid

__all__ = ["ALLREDUCE_SYNCS", "PS_SYNCS", "SYNCS", "ConfigError", "TrainConfig",
           "check_checkpoint_dir", "check_outputs", "dp_size_of", "parse_args",
           "parse_straggler", "parser", "world_of"]


def parse_straggler(text):
    """'RANK:SECONDS' -> (rank, seconds); ConfigError with the reason."""
    rank, sep, seconds = str(text).partition(":")
    try:
        rank, seconds = int(rank), float(seconds)
    except ValueError:
        raise ConfigError(f"--straggler {text!r} is not RANK:SECONDS (e.g. 1:0.05)",
                          field="straggler") from None
    if not sep or rank < 0 or not 0 <= seconds < float("inf"):
        raise ConfigError(f"--straggler {text!r} needs RANK >= 0 and SECONDS >= 0",
                          field="straggler")
    return rank, seconds


@dataclass(frozen=True)
class TrainConfig:
    # synchronisation (each trailing comment is the flag's --help text)
    sync: str = "local"           # gradient synchronisation: local (one process), ring, tree,
                                  # halving_doubling, hierarchical, mpi, torch, auto, ps, hybrid
    servers: int = 1              # ps / hybrid: the last SERVERS ranks serve
    consistency: str = "bsp"      # ps / hybrid: bsp, ssp (bounded by --staleness) or asp
    staleness: int = 0            # ssp: how many steps a worker may run ahead of the slowest
    ranks_per_node: int = 0       # hierarchical / auto / hybrid: 0 = ranks that share a host name
    bucket_mb: float = 25.0       # gradient bucket cap in MB (DDP's default is 25 MB as well)
    overlap: bool = True          # all-reduce buckets during backward; --no-overlap: after it
    compress: str = "none"        # gradients on the wire: none, fp16, bf16, topk:RATIO (the
                                  # largest RATIO of each bucket), powersgd:RANK (low rank)
    error_feedback: bool = True   # topk / powersgd: keep what was not sent and add it to the
                                  # next step's gradient; --no-error-feedback: drop it
    momentum_correction: bool = False  # topk with sgd --momentum: the momentum is kept per
                                       # rank before top-k (Deep Gradient Compression)
    sparsity_warmup: int = 0      # topk: the kept fraction falls from 1/4 to RATIO over this
                                  # many first steps, a quarter per stage (DGC's warm-up)
    device: str = "cpu"           # cpu or cuda (one GPU per rank of a host)
    threads: int = 0              # torch intra-op threads per rank; 0 = cores / ranks on host
    timeout: float = 60.0         # seconds any rank waits for a peer before giving up
    precision: str = "fp32"       # compute in fp32, or bf16 / fp16 under autocast with fp32
                                  # master weights (Micikevicius et al. 2018)
    loss_scale: float = 65536.0   # fp16: the initial loss scale (halved on inf/NaN, the step
                                  # skipped; doubled after --loss-scale-window clean steps)
    loss_scale_window: int = 1000  # fp16: clean steps in a row before the scale doubles
    # model
    model: str = "mlp"            # mlp, gpt, or moe (the gpt with mixture-of-experts MLPs)
    width: int = 128              # mlp hidden width
    depth: int = 2                # mlp hidden layers
    layers: int = 2               # gpt blocks
    d_model: int = 64             # gpt embedding width
    heads: int = 4                # gpt attention heads (they divide --d-model)
    vocab: int = 32               # gpt, synthetic data (byte-level text always uses 256)
    seq_len: int = 32             # gpt tokens per sample
    # mixture of experts (moe.py) and expert parallelism (expert_parallel.py)
    experts: int = 4              # moe: experts per block
    top_k: int = 2                # moe: experts per token, 1 (Switch) or 2 (GShard)
    capacity_factor: float = 1.25  # moe: an expert takes ceil(factor * k * S / experts) of
                                   # a group's S tokens; the rest pass by on the residual
    moe_group: int = 0            # moe: sequences per gating group (capacity is per group);
                                  # 0 = a data-parallel rank's local batch
    balance_loss: float = 0.01    # moe: weight of Switch's load-balancing loss; 0 = none
    ep: int = 1                   # expert-parallel ranks: each holds experts / EP experts
    # parallelism on a dp x pp x tp grid (mesh.py, engine/parallelize.py, zero.py, ...)
    dp: int = 0                   # data-parallel size; 0 = what is left, world / (pp * tp)
    pp: int = 1                   # pipeline stages
    tp: int = 1                   # tensor-parallel ranks (GPT)
    sequence_parallel: bool = False  # with --tp: LayerNorms and residuals on 1/tp of
                                     # the sequence each (Korthikanti et al. 2023)
    zero: int = 0                 # ZeRO stage over the dp axis: 0 (plain DP), 1, 2, 3
    micro_batches: int = 1        # per step and dp replica: each forward and backward in turn,
                                  # the gradients added up, communicated once (a pipeline's
                                  # schedule, or accumulation.py's of one stage)
    schedule: str = "1f1b"        # pipeline schedule: gpipe, 1f1b or interleaved (needs
                                  # --virtual-stages >= 2)
    virtual_stages: int = 1       # interleaved: model chunks per pipeline rank (Narayanan
                                  # et al. 2021); the model is cut into pp x v stages
    trace: str = ""               # write a Chrome trace (Perfetto) of every rank's steps to FILE
    # emulation (experiments): a slower network, a slow rank
    link_latency_us: float = 0.0  # per message, on the textbook all-reduce backends' links
    link_gbps: float = 0.0        # bandwidth of each rank's emulated link in Gbit/s; 0 = no cap
    straggler: str = ""           # RANK:SECONDS: that rank's forward pass sleeps every step
    # data
    data: str = ""                # "" = synthetic; .npz (x, y) for mlp, plain text for gpt
    in_dim: int = 32              # synthetic mlp data: input features
    classes: int = 10             # synthetic mlp data: classes
    dataset_size: int = 4096      # synthetic samples
    # optimisation
    steps: int = 100              # training steps (a resumed run ends at the same one)
    global_batch: int = 64        # samples per step, split evenly across the data-parallel ranks
    grad_accum: int = 1           # the other name of --micro-batches (gradient accumulation)
    recompute: bool = False       # keep only each block's input; re-run its forward in
                                  # backward (activation checkpointing, recompute.py)
    lr: float = 0.05              # learning rate
    optimizer: str = "sgd"        # sgd or adam (torch's; under ps the servers run it)
    momentum: float = 0.0         # sgd momentum
    weight_decay: float = 0.0     # L2 penalty (torch's weight_decay)
    seed: int = 0                 # model initialisation and data order
    # output
    jsonl: str = ""               # append the run's records (config, steps, summary) to FILE
    checkpoint_dir: str = ""      # write checkpoints into DIR (ps: the servers write theirs too)
    checkpoint_every: int = 0     # steps between checkpoints; 0 = only at the end
    resume: bool = False          # go on from the checkpoint in --checkpoint-dir
    params_out: str = ""          # .npz of the final parameters (for equivalence checks)
    progress: bool = True         # a tqdm bar on rank 0; --no-progress: none

    def __post_init__(self):
        check_values(self, choices=(("model", MODELS), ("device", DEVICES),
                                    ("schedule", SCHEDULES), ("zero", ZERO_STAGES),
                                    ("precision", PRECISIONS)),
                     at_least=((1, ("steps", "global_batch", "width", "depth", "layers",
                                    "d_model", "heads", "vocab", "seq_len", "in_dim", "classes",
                                    "dataset_size", "servers", "pp", "tp", "micro_batches",
                                    "virtual_stages", "grad_accum")),
                               (0, ("checkpoint_every", "threads", "dp", "seed"))))
        spec = check_sync(self)
        if self.straggler:
            parse_straggler(self.straggler)
        if self.grad_accum > 1:
            # one concept: accumulating K micro-batches is what a schedule does, the
            # pipeline's or the trivial one of one stage, so --grad-accum K is
            # --micro-batches K on every run (on the grid it is left at 1 in the record)
            if self.micro_batches not in (1, self.grad_accum):
                raise ConfigError(f"--grad-accum {self.grad_accum} and --micro-batches "
                                  f"{self.micro_batches} are the same thing on the grid and "
                                  f"off it: give one of them", field="grad_accum")
            object.__setattr__(self, "micro_batches", self.grad_accum)
            if self.on_grid:
                object.__setattr__(self, "grad_accum", 1)
        if self.model in ("gpt", "moe") and self.d_model % self.heads:
            raise ConfigError(f"--d-model {self.d_model} is not divisible by --heads {self.heads}",
                              field="d_model")
        check_moe(self)
        check_precision(self)
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir", field="resume")
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError(f"--sequence-parallel splits the sequence over the tp ranks: "
                              f"it needs --tp > 1, got --tp {self.tp}", field="sequence_parallel")
        if self.sequence_parallel and self.seq_len % self.tp:
            raise ConfigError(f"--sequence-parallel: --seq-len {self.seq_len} is not divisible "
                              f"by tp({self.tp}): {self.seq_len} % {self.tp} = "
                              f"{self.seq_len % self.tp}", field="sequence_parallel")
        check_schedule(self)
        if self.on_grid and self.sync not in ALLREDUCE_SYNCS:
            what = f"--zero {self.zero}" if self.zero else "--dp/--pp/--tp"
            raise ConfigError(f"{what} needs an all-reduce --sync ({', '.join(ALLREDUCE_SYNCS)}),"
                              f" not --sync {self.sync}: the grid's axes talk through collectives",
                              field="sync")
        if self.on_grid and self.recompute and self.model != "gpt":
            raise ConfigError(f"--recompute with --dp/--pp/--tp/--zero/--micro-batches "
                              f"checkpoints GPT blocks; --model {self.model} is not cut into "
                              f"blocks a stage can replay (use --model gpt, or the plain loop)",
                              field="recompute")
        if self.momentum_correction and not (spec.kind == "topk" and self.optimizer == "sgd"
                                             and self.momentum > 0 and self.error_feedback):
            raise ConfigError(f"--momentum-correction needs --compress topk:RATIO with "
                              f"--optimizer sgd, --momentum > 0 and error feedback, not "
                              f"--compress {self.compress} --optimizer {self.optimizer} "
                              f"--momentum {self.momentum:g}"
                              + ("" if self.error_feedback else " --no-error-feedback"),
                              field="momentum_correction")
        if self.ep > 1 and spec.lossy:
            raise ConfigError(f"--compress {self.compress} with --ep {self.ep} is not "
                              f"supported; fp16 and bf16 are", field="compress")
        if self.on_grid and self.device != "cpu":
            raise ConfigError(f"--dp/--pp/--tp/--zero with --device "
                              f"{self.device} is not supported yet: the pipeline's transport "
                              f"and ZeRO's flat buffers take CPU tensors", field="device")

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

    def as_dict(self):
        return dataclasses.asdict(self)


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


def world_of(cfg, world_size):
    """(dp, how the world splits): `world 3 = dp(2) + servers(1)`, `dp(2) x pp(2) x tp(1) = 4`.
    The parameter servers' launcher (psrv.launch) decides which ranks serve; here only
    how many ranks are left to train."""
    if cfg.on_grid:                        # world = dp x pp x tp (mesh.py names each factor)
        mesh = Mesh(world_size, cfg.dp, cfg.pp, cfg.tp, cfg.ep)
        return mesh.dp, mesh.describe()
    if cfg.sync in PS_SYNCS:
        dp = world_size - cfg.servers
        return dp, f"world {world_size} = dp({dp}) + servers({cfg.servers})"
    return world_size, f"world {world_size} = dp({world_size})"


def dp_size_of(cfg, world_size):
    """The data-parallel size, after checking that the world and the batch fit it: the one
    check of the global batch, for the plain loop and the grid alike.  The flags passed
    TrainConfig's checks alone, so an error here is about them against the world: its
    field is world_size (the straggler's rank excepted)."""
    dp, where = world_of(cfg, world_size)
    if dp < 1:
        raise ConfigError(f"no worker left: {where}; use fewer --servers or more ranks",
                          field="world_size")
    if cfg.straggler and cfg.straggler_rank >= world_size:
        raise ConfigError(f"--straggler rank {cfg.straggler_rank} is not a rank "
                          f"(world size {world_size})", field="straggler")
    if cfg.sync == "local" and world_size != 1:
        raise ConfigError(f"--sync local runs on one process, not {world_size}", field="world_size")
    if cfg.global_batch % dp:
        raise ConfigError(f"--global-batch {cfg.global_batch} is not divisible by the "
                          f"data-parallel size: {cfg.global_batch} % dp({dp}) = "
                          f"{cfg.global_batch % dp} ({where})", field="world_size")
    local, k = cfg.global_batch // dp, cfg.micro_batches
    flag = "--grad-accum" if cfg.grad_accum > 1 else "--micro-batches"
    if k > local:
        raise ConfigError(f"{flag} {k} is more than the {local} samples of each replica "
                          f"(global batch {cfg.global_batch} / dp({dp}))", field="micro_batches")
    if not cfg.on_grid and local % k:          # the grid's pipeline cuts unequal ones
        raise ConfigError(f"{flag} {k} does not divide the local batch: "
                          f"global batch {cfg.global_batch} / dp({dp}) = {local} samples, "
                          f"{local} % {k} = {local % k} ({where})", field="world_size")
    if cfg.sync == "hybrid" and cfg.ranks_per_node and dp % cfg.ranks_per_node:
        raise ConfigError(f"--ranks-per-node {cfg.ranks_per_node} does not divide dp({dp}) "
                          f"into whole nodes ({where})", field="world_size")
    return dp


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
