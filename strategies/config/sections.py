"""The sections of a run's configuration: one frozen dataclass per component, each field
written once, with its meaning as the trailing comment (the flag's --help text).

    SyncOptions(compress="topk:0.01")      # validated on construction, errors name keywords
    cfg.section(SyncOptions)               # the same section of a TrainConfig (settings.py)

TrainConfig (settings.py) is the flat union of these fields, in this order, so that the
command line stays flat (`--compress`, not `--sync.compress`).  DistributedOptimizer's
keywords are SyncOptions' and PrecisionOptions' fields; the wrapped torch optimizer gives
OptimizerOptions.  Every rule about a field lives in validate.py: a section alone checks
its own fields there (`check_section`), TrainConfig checks them all, and their
combinations (`check_flags`), and them against the world (`check_world`).
"""
from dataclasses import dataclass

from .validate import (check_section, data_rules, model_rules, moe_rules, optimizer_rules,
                       output_rules, parallel_rules, precision_rules, run_rules, sync_rules)


@dataclass(frozen=True)
class SyncOptions:
    """How the gradients travel: the settings the syncs read (sync/)."""
    sync: str = "local"           # gradient synchronisation: local (one process), ring, tree,
                                  # halving_doubling, hierarchical, mpi, torch, auto, ps, hybrid
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
    timeout: float = 60.0         # seconds any rank waits for a peer before giving up
    # emulation (experiments): a slower network
    link_latency_us: float = 0.0  # per message, on the textbook all-reduce backends' links
    link_gbps: float = 0.0        # bandwidth of each rank's emulated link in Gbit/s; 0 = no cap

    def __post_init__(self):
        check_section(self, sync_rules)


@dataclass(frozen=True)
class PrecisionOptions:
    """The arithmetic of forward and backward (runtime/precision.py)."""
    precision: str = "fp32"       # compute in fp32, or bf16 / fp16 under autocast with fp32
                                  # master weights (Micikevicius et al. 2018), or fp8: the
                                  # linear layers' matmuls in e4m3 / e5m2, the rest as bf16
                                  # (Micikevicius et al. 2022; runtime/fp8_linear.py)
    loss_scale: float = 65536.0   # fp16: the initial loss scale (halved on inf/NaN, the step
                                  # skipped; doubled after --loss-scale-window clean steps)
    loss_scale_window: int = 1000  # fp16: clean steps in a row before the scale doubles
    reduce_precision: str = "param"  # what a gradient bucket is reduced in: param,
                                     # the dtype its gradients are held in (16-bit on
                                     # a split model under --precision, fp32 where the
                                     # parameters stay fp32 under autocast), or fp32:
                                     # 16-bit buckets widened for their reduction
                                     # (Megatron-LM's grad_reduce_in_fp32)

    def __post_init__(self):
        check_section(self, precision_rules)


@dataclass(frozen=True)
class ParallelOptions:
    """How the world is split: dp x cp x pp x tp (ep cut out of dp), or workers and servers."""
    servers: int = 1              # ps / hybrid: the last SERVERS ranks serve
    dp: int = 0                   # data-parallel size; 0 = what is left, world / (cp * pp * tp)
    pp: int = 1                   # pipeline stages
    tp: int = 1                   # tensor-parallel ranks (GPT)
    ep: int = 1                   # expert-parallel ranks: each holds experts / EP experts
    cp: int = 1                   # context-parallel ranks (GPT): each holds 1/CP of every
                                  # sequence's positions, the same samples and parameters
    cp_kind: str = "ring"         # --cp's attention: ring (the keys and values go round
                                  # the cp ranks) or ulysses (two all-to-alls swap the
                                  # position split for a head split: heads a multiple
                                  # of cp)
    cp_order: str = "contiguous"  # which positions a cp rank holds: contiguous (one slice
                                  # of T / cp) or zigzag (chunks r and 2 cp - 1 - r of
                                  # 2 cp: causal attention's work balanced over the ring;
                                  # T a multiple of 2 cp)
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
    pp_layers: str = ""           # each pipeline stage's blocks by hand, e.g. 2,3,2 (pp of
                                  # them, each >= 1, adding up to the blocks); "" = the
                                  # balanced split (parallel/stages.py)
    grad_accum: int = 1           # the other name of --micro-batches (gradient accumulation)
    recompute: bool = False       # keep only each block's input; re-run its forward in
                                  # backward (activation checkpointing, recompute.py)

    def __post_init__(self):
        check_section(self, parallel_rules)


@dataclass(frozen=True)
class ModelOptions:
    """Which model (model/models.py)."""
    model: str = "mlp"            # mlp, gpt, or moe (the gpt with mixture-of-experts MLPs)
    width: int = 128              # mlp hidden width
    depth: int = 2                # mlp hidden layers
    layers: int = 2               # gpt blocks
    d_model: int = 64             # gpt embedding width
    heads: int = 4                # gpt attention heads (they divide --d-model)
    kv_heads: int = 0             # gpt key-value heads, dividing --heads (grouped-query
                                  # attention; 1: multi-query); 0 = --heads
    ffn_hidden: int = 0           # gpt MLP width; 0 = 4 x --d-model
    gated_mlp: bool = False       # gpt MLP as SwiGLU: silu(x W1) * (x W3), then W2
    vocab: int = 32               # gpt, synthetic data (byte-level text always uses 256)
    seq_len: int = 32             # gpt tokens per sample

    def __post_init__(self):
        check_section(self, model_rules)


@dataclass(frozen=True)
class MoEOptions:
    """Mixture of experts (model/moe.py); expert parallelism is ParallelOptions.ep."""
    experts: int = 4              # moe: experts per block
    top_k: int = 2                # moe: experts per token, 1 (Switch) or 2 (GShard)
    capacity_factor: float = 1.25  # moe: an expert takes ceil(factor * k * S / experts) of
                                   # a group's S tokens; the rest pass by on the residual
    moe_group: int = 0            # moe: sequences per gating group (capacity is per group);
                                  # 0 = one forward call's: a data-parallel rank's local
                                  # batch, or one of its --micro-batches (written into the
                                  # run's records)
    balance_loss: float = 0.01    # moe: weight of Switch's load-balancing loss; 0 = none

    def __post_init__(self):
        check_section(self, moe_rules)


@dataclass(frozen=True)
class DataOptions:
    """What the model learns (model/data.py)."""
    data: str = ""                # "" = synthetic; .npz (x, y) for mlp, plain text for gpt
    in_dim: int = 32              # synthetic mlp data: input features
    classes: int = 10             # synthetic mlp data: classes
    dataset_size: int = 4096      # synthetic samples

    def __post_init__(self):
        check_section(self, data_rules)


@dataclass(frozen=True)
class OptimizerOptions:
    """The torch optimizer (under ps the servers run it, psrv/optim.py)."""
    lr: float = 0.05              # learning rate
    optimizer: str = "sgd"        # sgd or adam (torch's; under ps the servers run it)
    momentum: float = 0.0         # sgd momentum
    weight_decay: float = 0.0     # L2 penalty (torch's weight_decay)

    def __post_init__(self):
        check_section(self, optimizer_rules)


@dataclass(frozen=True)
class RunOptions:
    """The run itself: how long, how big a step, where, and a slow rank to emulate."""
    steps: int = 100              # training steps (a resumed run ends at the same one)
    global_batch: int = 64        # samples per step, split evenly across the data-parallel ranks
    seed: int = 0                 # model initialisation and data order
    device: str = "cpu"           # cpu or cuda (one GPU per rank of a host)
    threads: int = 0              # torch intra-op threads per rank; 0 = cores / ranks on host
    straggler: str = ""           # RANK:SECONDS: that rank's forward pass sleeps every step

    def __post_init__(self):
        check_section(self, run_rules)


@dataclass(frozen=True)
class OutputOptions:
    """What the run writes."""
    jsonl: str = ""               # append the run's records (config, steps, summary) to FILE
    trace: str = ""               # write a Chrome trace (Perfetto) of every rank's steps to FILE
    checkpoint_dir: str = ""      # write checkpoints into DIR (ps: the servers write theirs too)
    checkpoint_every: int = 0     # steps between checkpoints; 0 = only at the end
    resume: bool = False          # go on from the checkpoint in --checkpoint-dir
    params_out: str = ""          # .npz of the final parameters (for equivalence checks)
    progress: bool = True         # a tqdm bar on rank 0; --no-progress: none

    def __post_init__(self):
        check_section(self, output_rules)


# in the order of TrainConfig's fields and of --help
SECTIONS = (SyncOptions, PrecisionOptions, ParallelOptions, ModelOptions, MoEOptions,
            DataOptions, OptimizerOptions, RunOptions, OutputOptions)
