"""One parallelize step: a rank's share of the model, its sync and its schedule, in one order.

    plan = parallelize(model, ctx, cfg, device, tracer)   # every rank, collective
    plan.model                 what this rank trains (its state is what it checkpoints)
    plan.schedule.run(x, y)    one step's micro-batches forward and backward through it
    plan.sync, plan.optimizer  the data parallelism over what is left (a GradientSync)

The transforms, in the order they are applied (torchtitan's parallelize_llama: tensor
parallelism, activation checkpointing, then data parallelism; picotron: TP, PP, DP):

    0. the cut         the layers this rank keeps: its pipeline stage (pipeline.py), or v
                       chunks of layers (interleaved.py); the whole model where pp = 1
    1. tensor          Megatron's split of the kept blocks over tp (tensor_parallel.py),
                       and with --sequence-parallel the LayerNorms on T/tp positions
    2. recompute       each kept block checkpointed (recompute.py)
    3. pipeline        the kept layers as Stage modules, v of them where interleaved
    4. experts         this rank's experts kept, tokens moved by all-to-alls
                       (expert_parallel.py); the dense layers stay whole
    5. data parallel   over what is left: ZeRO's layers (sync/zero.py, stage 0 is plain
                       data parallelism) where the model is split into layers, else
                       DistributedOptimizer's sync (buckets, ps, hybrid, local)
    6. the schedule    Pipeline (GPipe, 1F1B, interleaved) over the stages, or the trivial
                       schedule of one stage (accumulation.py) over the whole model

Why this order.  The cut comes first only as arithmetic (which layers), so that 1 and 2
touch the kept layers only.  Tensor parallelism before recompute: the checkpoint wraps
the split block, so a replay runs the block's tp collectives again, in the same order
on every tp rank.  Recompute before the stages: a Stage holds the wrapped blocks.
Experts before data parallelism: an expert's gradient is averaged over its replicas,
not over dp, so data parallelism must know which parameters are experts.  Data
parallelism last: ZeRO makes each layer's final parameters views of one flat buffer,
which a later split would break.  The schedule after it: the pipeline's activation
meter leaves ZeRO's parameter storages out, and the trivial schedule asks the sync for
no_sync (communication once per step).

Three shapes of run go through these steps, decided by the flags (config/mesh.py):
the grid (--dp/--pp/--tp/--zero: steps 0-3, 5 with ZeRO, 6 a Pipeline), the experts
(--model moe with --ep or --zero: steps 4, 5 with ZeRO, 6 trivial) and the whole model
(steps 2, 5 with DistributedOptimizer, 6 trivial).
"""
from dataclasses import dataclass, field

import torch.nn as nn

from allreduce import make_transport

from ..config.choices import ALLREDUCE_SYNCS, PS_SYNCS
from ..config.sections import PrecisionOptions, SyncOptions
from ..model.moe import MoE
from ..parallel.expert_parallel import AllToAllExperts, ExpertPlacement, shard_experts, units_of
from ..parallel.interleaved import InterleavedPipeline, chunk_layers
from ..parallel.pipeline import Pipeline, Stage, layers_of
from ..parallel.recompute import Recompute
from ..parallel.sequence_parallel import positions_per_rank, split_sequence
from ..parallel.tensor_parallel import TensorParallel, parallelize_blocks
from ..runtime.memory import ActivationMeter
from ..runtime.precision import any_rank_of, of_config
from ..sync.gradient_sync import build_compressor, collective_for, for_device, torch_optimizer
from ..sync.server_buckets import ServerBuckets
from ..sync.zero import ZeRO, Replicas
from .accumulation import Accumulation
from .optimizer import DistributedOptimizer


@dataclass
class Parallelized:
    """What parallelize hands the step engine (engine/loop.py)."""
    model: nn.Module            # this rank's share: the whole model, a Stage, or v of them
    schedule: object            # run(x, y) -> this rank's loss (None: not on the last stage)
    sync: object                # a GradientSync (sync/gradient_sync.py)
    optimizer: object
    precision: object           # the run's MixedPrecision (runtime/precision.py)
    scales_in_sync: bool = False  # ZeRO keeps 16-bit buffers: it unscales and skips itself
    recompute: object = None    # --recompute: a Recompute over the kept blocks
    agree: object = None        # fp16's overflow vote where ranks hold different gradients
    pipelined: bool = False     # the schedule is a Pipeline: its times are read off spans
    reports: bool = True        # this rank's loss is one of the step's (last stage, tp 0)
    meter: object = None        # the pipeline's ActivationMeter
    exchange: object = None     # the experts' AllToAllExperts
    placement: object = None    # the experts' ExpertPlacement
    expert_params: list = field(default_factory=list)  # the experts this rank keeps
    counters: list = field(default_factory=list)  # whose bytes_sent/received are the rank's
    names: dict = field(default_factory=dict)         # id(parameter) -> its name in the model
    tp_pieces: dict = field(default_factory=dict)     # id(parameter) -> tp.pieces' entry
    originals: list = field(default_factory=list)     # alive: no new parameter reuses an id


def experts_apart(cfg):
    """Whether the MoE's experts get data parallelism of their own (their replicas), split
    over --ep ranks or sharded by --zero; a MoE otherwise trains as any whole model."""
    return cfg.model == "moe" and (cfg.ep > 1 or cfg.zero > 0)


def cut_into_layers(cfg):
    """Whether the model is cut into layers and stages over the grid (steps 0-3 and a
    Pipeline); the experts' run shards by --zero too, but keeps its model whole."""
    return cfg.on_grid and not experts_apart(cfg)


def axis_collective(cfg):
    """The algorithm of the collectives inside a step (tp's all-reduces, the experts'
    all-to-alls): the --sync's own where it is an all-reduce, else (ps, hybrid, whose
    --sync says how data parallelism meets the servers) the ring."""
    return cfg.sync if cfg.sync in ALLREDUCE_SYNCS else "ring"


def parallelize(model, ctx, cfg, device, tracer):
    """This rank's Parallelized of `model` (whole, as model/models.py built it), by the
    steps of the module docstring.  Collective: every rank of the run calls it."""
    comms = ctx.mesh
    grid, experts = cut_into_layers(cfg), experts_apart(cfg)
    plan = Parallelized(model, None, None, None, of_config(cfg, device.type),
                        originals=list(model.parameters()),
                        names={id(p): n for n, p in model.named_parameters()})
    # 0. the cut: v chunks of layers (interleaved.py), or the one stage of GPipe and 1F1B
    if grid:
        chunks = chunk_layers(model, comms.pp_rank, comms.pp_size, cfg.virtual_stages,
                              cfg.stage_split)
        layers = [layer for chunk in chunks for layer in chunk]
    # 1. tensor parallelism: Megatron's split of this stage's blocks
    if grid and comms.tp_size > 1:
        tp_coll = collective_for(axis_collective(cfg), cfg, comms.tp, device=device)
        tp = TensorParallel(tp_coll, comms.tp_rank, comms.tp_size, tracer)
        parallelize_blocks([b for name, b in layers if name.startswith("blocks.")], tp)
        if cfg.sequence_parallel:                  # LayerNorms on T/tp positions each
            layers = split_sequence(layers, tp)
        plan.tp_pieces, plan.counters = tp.pieces, [tp_coll.transport]
        for name, block in layers:                 # the split layers' new parameters
            for local, p in block.named_parameters():
                plan.names.setdefault(id(p), f"{name}.{local}")
    # 2. recompute: the kept GPT blocks after their tp split; the whole model's blocks
    if cfg.recompute:
        blocks = {name for name, _ in layers_of(model)[1]}   # GPT blocks, MLP hidden layers
        plan.recompute = Recompute.of_blocks(
            [(n, b) for n, b in layers if n in blocks], tracer) if grid \
            else Recompute(model, tracer)
    # 3. the pipeline split: the kept layers, in order, re-cut into their chunks
    if grid:
        sizes = [len(chunk) for chunk in chunks]
        stages = [Stage(layers[sum(sizes[:c]):sum(sizes[:c + 1])]) for c in range(len(sizes))]
        plan.model = stages[0] if len(stages) == 1 else nn.ModuleList(stages)
    # 4. expert parallelism: keep this rank's experts, route the tokens to them
    if experts:
        plan.placement = ExpertPlacement(comms.mesh, cfg.experts, ctx.rank)
        # the mesh's expert groups: the all-to-alls never meet the comm thread's collectives
        plan.exchange = AllToAllExperts(collective_for(axis_collective(cfg), cfg, comms.ep,
                                                       device=device),
                                        plan.placement, tracer)
        plan.expert_params = shard_experts(model, plan.placement, plan.exchange)
        plan.counters = [plan.exchange.coll]
    # 5. data parallelism over what is left
    if grid or experts:
        zero_data_parallel(plan, ctx, cfg, device, tracer, layers if grid else None)
    else:
        whole_data_parallel(plan, ctx, cfg)
    # 6. the schedule of one step's micro-batches
    if grid:
        pipeline(plan, comms, cfg, device, stages, tracer,
                 getattr(model, "token_loss", model.criterion))
    else:
        plan.schedule = Accumulation(model, model, cfg.micro_batches, plan.sync, device, tracer,
                                     plan.recompute, plan.precision)
    return plan


def zero_data_parallel(plan, ctx, cfg, device, tracer, layers):
    """Step 5 where the model is split into layers: ZeRO over the dp axis (stage 0: plain
    data parallelism), each layer's collective leaving on the comm thread as backward
    finishes it.  layers: the grid's kept (name, module) layers; None: the experts' run,
    whose experts are averaged over their replicas {0, 2}, {1, 3} (ep 2 of world 4; one
    rank each where ep = world) and the dense layers over the world."""
    comms = ctx.mesh

    def over(comm):             # every collective of the step: staged on a GPU (for_device)
        return collective_for(cfg.sync, cfg, comm, device=device)

    if layers is None:
        replica_comm = comms.ep_replicas
        replicas = Replicas(over(replica_comm), over(replica_comm.Dup()) if cfg.overlap
                            else None, scale=1.0 / cfg.ep)
        units = units_of(plan.model, replicas)
    else:
        units = [(name, module, list(module.parameters())) for name, module in layers]
    if cfg.sync in PS_SYNCS:    # a bucket's reduction is a push and a pull to the servers
        plan.sync = ServerBuckets(units, comms, ctx.role, cfg, cfg.micro_batches, tracer,
                                  device, collective_for, ctx.host, plan.precision)
        plan.sync.setup(plan.model)
        plan.optimizer = plan.sync.make_optimizer()
        plan.counters = plan.counters + [plan.sync]
        plan.scales_in_sync = True        # the servers step: nothing to unscale here
        return
    # the comm thread's collective: its own communicator, beside the main thread's
    thread_coll = over(comms.dp.Dup()) if cfg.overlap else None
    compressor = build_compressor(cfg.compress, thread_coll, cfg.error_feedback,
                                  cfg.compressor_momentum, cfg.sparsity_warmup)
    # --precision: on the grid ZeRO keeps 16-bit buffers and fp32 master shards (the
    # paper's setting) and votes on an fp16 overflow over every rank where pp or tp split
    # the model (a rank sees its stage's or its piece's gradients only).  The experts'
    # run keeps fp32 parameters under autocast, as plain data parallelism does; its
    # experts' gradients differ from rank to rank of a group, so the whole launch votes
    # (an inf in any gradient skips the update: Micikevicius et al. 2018, section 3.2)
    split = layers is not None and (comms.mesh.pp_enabled or comms.mesh.tp_enabled)
    plan.sync = ZeRO(cfg.zero, units, over(comms.dp), cfg,
                     cfg.micro_batches, tracer, plan.precision if layers is not None else None,
                     agree=any_rank_of(comms.world) if split else None,
                     thread_coll=thread_coll, compressor=compressor, overlap=cfg.overlap,
                     device=device)
    plan.sync.setup(plan.model)
    plan.optimizer = plan.sync.make_optimizer()
    # the transports' counts: a library's collective (--sync mpi) does not count its own
    plan.counters = plan.counters + [c.transport for c in plan.sync.colls()]
    plan.scales_in_sync = layers is not None
    if layers is None and plan.precision.scaler:
        plan.agree = any_rank_of(ctx.comm)


def whole_data_parallel(plan, ctx, cfg):
    """Step 5 for the whole model on every worker: DistributedOptimizer builds the sync
    (the one place that knows every kind: local, the all-reduces, ps, hybrid).  The
    model's fp32 parameters are the master weights; autocast casts them per matmul."""
    settings = {**vars(cfg.section(SyncOptions)), **vars(cfg.section(PrecisionOptions))}
    opt = DistributedOptimizer(torch_optimizer(cfg, plan.model.parameters()), plan.model,
                               comm=ctx.dp_comm, role=ctx.role, **settings)
    plan.sync, plan.optimizer = opt.sync, opt.optimizer
    plan.counters = [opt.sync]
    plan.agree = opt.sync.agree                # ps under fp16: the workers vote


def pipeline(plan, comms, cfg, device, stages, tracer, criterion):
    """Step 6 on the grid: this rank's stages under --schedule, their activations and
    gradients over the pp axis's point-to-point transport (on a GPU staged through
    pinned host memory where MPI is not CUDA-aware: for_device)."""
    plan.meter = ActivationMeter(plan.sync.param_storages,
                                 [plan.sync] if cfg.zero == 3 else [])
    p2p = for_device(make_transport("mpi", comms.pp, cfg.timeout), device)
    feature = (positions_per_rank(cfg, comms.tp_size), cfg.d_model) \
        if cfg.model in ("gpt", "moe") else (cfg.width,)
    kind = InterleavedPipeline if cfg.schedule == "interleaved" else Pipeline
    plan.schedule = kind(stages, criterion, p2p, comms.pp_rank, comms.pp_size,
                         cfg.micro_batches, cfg.schedule, lambda n: (n, *feature), tracer,
                         plan.meter, plan.precision)
    plan.schedule.recompute = plan.recompute
    plan.counters = plan.counters + [p2p]
    plan.pipelined = True
    # the loss of a replica is on its last stage, the same on each of its tp ranks
    plan.reports = comms.is_last_stage and comms.tp_rank == 0


def dropped_fraction(model):
    """The experts' run: the mean over MoE blocks of the tokens their capacity dropped."""
    dropped = [m.dropped_fraction for m in model.modules() if isinstance(m, MoE)]
    return sum(dropped) / len(dropped)
