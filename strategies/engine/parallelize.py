"""One parallelize step: a rank's share of the model, its sync and its schedule, in one order.

    plan = parallelize(model, ctx, cfg, device, tracer)   # every rank, collective
    plan.model                 what this rank trains (its state is what it checkpoints)
    plan.schedule.run(x, y)    one step's micro-batches forward and backward through it
    plan.sync, plan.optimizer  the data parallelism over what is left (a GradientSync)

The transforms, in the order they are applied (torchtitan's parallelize_llama: tensor
parallelism, activation checkpointing, then data parallelism; picotron: TP, PP, DP),
after --precision fp8's swap of every nn.Linear for its fp8 form (fp8_linear.py), which
goes first so that each split below inherits it (tp's layers take the function of the
Linear they cut; a Stage, an expert or a bucket holds the swapped module):

    0. the cut         the layers this rank keeps: its pipeline stage (pipeline.py), or v
                       chunks of layers (interleaved.py); the whole model where pp = 1
    1. tensor          Megatron's split of the kept blocks over tp (tensor_parallel.py),
                       and with --sequence-parallel the LayerNorms on T/tp positions
    2. context         each kept block's attention core replaced by ring attention or
                       Ulysses over the cp axis, the positions embedded from this
                       rank's slice on (context_parallel.py)
    3. recompute       each kept block checkpointed (recompute.py)
    4. pipeline        the kept layers as Stage modules, v of them where interleaved
    5. experts         this rank's experts kept, tokens moved by all-to-alls
                       (expert_parallel.py); the dense layers stay whole
    6. data parallel   over what is left, one call for every run and every --sync
                       (sync/data_parallel.py): the bucket engine over this rank's units
                       (its layers, its experts, or the whole model's parameters), whose
                       bucket reduction is an all-reduce, a reduce-scatter (--zero) or a
                       push and pull to the parameter servers (ps, hybrid), over the
                       dp x cp replicas of the parameters
    7. the schedule    Pipeline (GPipe, 1F1B, interleaved) over pp >= 2 stages; the
                       trivial schedule of one stage (accumulation.py) over everything
                       else: the grid's one Stage at pp = 1, or the whole model

Why this order.  The cut comes first only as arithmetic (which layers), so that 1 to 3
touch the kept layers only.  Tensor parallelism before recompute: the checkpoint wraps
the split block, so a replay runs the block's tp collectives again, in the same order
on every tp rank.  Context after tensor parallelism: the core is handed the heads this
tp rank keeps (Ulysses splits them over cp again), whatever attention module holds it;
before recompute for tp's reason: a replay passes the keys and values round the ring
again, in the same order on every cp rank.  Context parallelism adds no parameter, so
data parallelism needs only its axis (dp x cp), not its layers.  Recompute before the
stages: a Stage holds the wrapped blocks.
Experts before data parallelism: an expert's gradient is averaged over its replicas,
not over dp, so data parallelism must know which parameters are experts.  Data
parallelism last: ZeRO makes each layer's final parameters views of one flat buffer,
which a later split would break.  The schedule after it: its activation meter leaves
ZeRO's parameter storages out (and packs ZeRO-3's), and every schedule's k backwards
a step are what the sync was built to count (communication once per step).

Every run is a mesh run (config/mesh.py: plain data parallelism is dp = the workers)
and takes the steps its flags enable: a model cut into layers (--dp/--pp/--tp/--zero:
steps 0-4, 6, 7 a Pipeline where pp > 1, else trivial; step 5 too for --model moe
--ep, each stage's experts over the expert groups of its replicas), the experts apart
on a whole model (--model moe with --ep or --zero, without --pp and --tp: steps 5, 6, 7
trivial), or whole on every worker (steps 2, 3, 6, 7 trivial); step 2 where --cp > 1.
"""
from dataclasses import dataclass, field

import torch.nn as nn

from allreduce import make_transport

from ..config.choices import ALLREDUCE_SYNCS, PS_SYNCS
from ..model.moe import MoE
from ..parallel.context_parallel import set_attention_core
from ..parallel.expert_parallel import (AllToAllExperts, ExpertPlacement, block_units,
                                        moe_of, shard_experts, units_of)
from ..parallel.interleaved import InterleavedPipeline, chunk_layers
from ..parallel.pipeline import Pipeline, Stage, layers_of
from ..parallel.recompute import Recompute
from ..parallel.ring_attention import RingAttention
from ..parallel.sequence_parallel import positions_per_rank, split_sequence
from ..parallel.tensor_parallel import TensorParallel, parallelize_blocks
from ..parallel.ulysses import Ulysses
from ..runtime.memory import ActivationMeter
from ..runtime.fp8_linear import check_device, to_fp8
from ..runtime.precision import any_rank_of, of_config
from ..sync.buckets import Replicas
from ..sync.data_parallel import data_parallel, parameter_units
from ..sync.gradient_sync import collective_for, for_device
from .accumulation import Accumulation


@dataclass
class Parallelized:
    """What parallelize hands the step engine (engine/loop.py)."""
    model: nn.Module            # this rank's share: the whole model, a Stage, or v of them
    schedule: object            # run(x, y) -> this rank's loss (None: not on the last stage)
    sync: object                # a GradientSync (sync/gradient_sync.py)
    optimizer: object
    precision: object           # the run's MixedPrecision (runtime/precision.py)
    recompute: object = None    # --recompute: a Recompute over the kept blocks
    pipelined: bool = False     # cut into stages (the grid, pp >= 1): the grid's records,
                                # their times read off the schedule's spans
    reports: bool = True        # this rank's loss is one of the step's (last stage, tp 0)
    meter: object = None        # the schedule's ActivationMeter (the grid, ZeRO-3)
    exchange: object = None     # the experts' AllToAllExperts
    context: object = None      # --cp: the blocks' attention core (RingAttention, Ulysses)
    placement: object = None    # the experts' ExpertPlacement
    expert_params: list = field(default_factory=list)  # the experts this rank keeps
    counters: list = field(default_factory=list)  # whose bytes_sent/received are the rank's
    names: dict = field(default_factory=dict)         # id(parameter) -> its name in the model
    tp_pieces: dict = field(default_factory=dict)     # id(parameter) -> tp.pieces' entry
    originals: list = field(default_factory=list)     # alive: no new parameter reuses an id


def experts_apart(cfg):
    """Whether the MoE's experts get data parallelism of their own (their replicas): split
    over --ep ranks, or sharded by --zero on a whole model; on the grid without --ep
    they are parameters of their block like any other, and a MoE otherwise trains as
    any whole model."""
    return cfg.model == "moe" and (cfg.ep > 1 or cfg.zero > 0 and not cut_into_layers(cfg))


def cut_into_layers(cfg):
    """Whether the model is cut into layers and stages over the grid (steps 0-4 and a
    Pipeline).  The experts' run without --pp and --tp (--ep, or a MoE under --zero)
    shards by --zero too, but keeps its model whole."""
    whole_experts = cfg.model == "moe" and (cfg.ep > 1 or cfg.zero > 0) and \
        cfg.pp == 1 and cfg.tp == 1
    return cfg.on_grid and not whole_experts


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
    if cfg.precision == "fp8":                     # before any split, so each inherits it
        check_device(device)
        to_fp8(model)
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
    # 2. context parallelism: every kept block's attention sees its cp group's positions
    if cfg.cp > 1:
        blocks = [b for name, b in layers if name.startswith("blocks.")] if grid \
            else list(model.blocks)
        context_parallel(plan, model, blocks, comms, cfg, device, tracer)
    # 3. recompute: the kept GPT blocks after their tp split; the whole model's blocks
    if cfg.recompute:
        blocks = {name for name, _ in layers_of(model)[1]}   # GPT blocks, MLP hidden layers
        plan.recompute = Recompute.of_blocks(
            [(n, b) for n, b in layers if n in blocks], tracer) if grid \
            else Recompute(model, tracer)
    # 4. the pipeline split: the kept layers, in order, re-cut into their chunks
    if grid:
        sizes = [len(chunk) for chunk in chunks]
        stages = [Stage(layers[sum(sizes[:c]):sum(sizes[:c + 1])]) for c in range(len(sizes))]
        plan.model = stages[0] if len(stages) == 1 else nn.ModuleList(stages)
    # 5. expert parallelism: keep this rank's experts, route the tokens to them
    if experts:
        plan.placement = ExpertPlacement(comms.mesh, cfg.experts, ctx.rank)
        # the mesh's expert groups: the all-to-alls never meet the comm thread's collectives
        plan.exchange = AllToAllExperts(collective_for(axis_collective(cfg), cfg, comms.ep,
                                                       device=device),
                                        plan.placement, tracer)
        # the whole model's MoE blocks, or the kept ones of this rank's stages
        plan.expert_params = shard_experts(plan.model, plan.placement, plan.exchange)
        plan.counters = plan.counters + [plan.exchange.coll]
    # 6. data parallelism over what is left: the one call, whatever the --sync
    data_parallel_step(plan, ctx, cfg, device, tracer, layers if grid else None)
    # 7. the schedule of one step's micro-batches: a pipeline over pp >= 2 stages, else
    # the trivial one of one stage; the grid's records read its meter, ZeRO-3 packs its
    # saved parameters through it
    if grid or cfg.zero == 3:
        plan.meter = ActivationMeter(plan.sync.param_storages,
                                     [plan.sync] if cfg.zero == 3 else [])
    if grid and comms.pp_size > 1:
        pipeline(plan, comms, cfg, device, stages, tracer,
                 getattr(model, "token_loss", model.criterion))
    else:
        plan.schedule = Accumulation(plan.model, model.criterion, cfg.micro_batches, device,
                                     tracer, plan.recompute, plan.precision, plan.meter)
    if grid:
        plan.pipelined = True
        # the loss of a replica is on its last stage, the same on each of its tp ranks
        plan.reports = comms.is_last_stage and comms.tp_rank == 0
    return plan


def context_parallel(plan, model, blocks, comms, cfg, device, tracer):
    """Step 2: the attention core of `blocks` over the cp axis, --cp-kind's: ring
    attention over a point-to-point transport of its own (its messages are waited for
    inside the core, so no other thread's calls meet them), or Ulysses over a
    collective of the step's algorithm (axis_collective, as tp's and the experts')."""
    if cfg.cp_kind == "ring":
        transport = for_device(make_transport(comm=comms.cp, timeout=cfg.timeout), device)
        plan.context, counter = RingAttention(transport, tracer=tracer,
                                               order=cfg.cp_order), transport
    else:
        coll = collective_for(axis_collective(cfg), cfg, comms.cp, device=device)
        plan.context, counter = Ulysses(coll, tracer=tracer, order=cfg.cp_order), coll
    set_attention_core(model, blocks, plan.context, comms.cp_rank, comms.cp_size,
                       cfg.cp_order)
    plan.counters = plan.counters + [counter]


def data_parallel_step(plan, ctx, cfg, device, tracer, layers):
    """Step 6: the one data-parallel call (sync/data_parallel.py) over this rank's units.
    layers: the grid's kept (name, module) layers, whose buckets keep 16-bit values and
    fp32 masters under --precision (ZeRO's setting) and vote on an fp16 overflow over
    every rank where pp or tp split the model (a rank sees its stage's or its piece's
    gradients only).  None: the experts' units, whose experts are averaged over their
    replicas {0, 2}, {1, 3} (ep 2 of world 4; one rank each where ep = world), or a
    whole model's parameters; both keep fp32 parameters under autocast, and the experts'
    gradients differ from rank to rank of a group, so the workers vote (an inf in any
    gradient skips the update: Micikevicius et al. 2018, section 3.2)."""
    comms = ctx.mesh
    replicas = expert_replicas(comms, cfg, device) if plan.placement is not None else None
    if layers is not None:
        # a MoE block's experts apart from its dense parameters where --ep splits them
        units = [unit for name, module in layers for unit in
                 (block_units(name, module, replicas) if replicas and moe_of(module)
                  else [(name, module, list(module.parameters()))])]
        split = comms.mesh.pp_enabled or comms.mesh.tp_enabled or replicas is not None
        precision, agree = plan.precision, any_rank_of(comms.world) if split else None
    elif plan.placement is not None:
        units = units_of(plan.model, replicas)
        precision = None
        agree = any_rank_of(comms.world) if plan.precision.scaler else None
    else:
        units, precision, agree = parameter_units(plan.model), None, None
    if cfg.sync in PS_SYNCS:      # the servers' fp16 vote: before the pushes, in step
        precision = plan.precision
    # every schedule's micro-batches each fill the buckets (accumulation.py: why)
    backwards = cfg.micro_batches
    plan.sync = data_parallel(units, comms, cfg, device=device, tracer=tracer,
                              precision=precision, agree=agree, backwards_per_step=backwards,
                              role=ctx.role, host=ctx.host)
    plan.sync.setup(plan.model)
    whole = layers is None and plan.placement is None
    plan.optimizer = plan.sync.make_optimizer(plan.model if whole else None)
    # whose bytes are the rank's: the sync's own count for a whole model and the
    # servers; the transports' where other collectives share them (a library's
    # collective, --sync mpi, does not count its own)
    plan.counters = plan.counters + (
        [plan.sync] if whole or cfg.sync in PS_SYNCS
        else [c.transport for c in plan.sync.colls()])


def expert_replicas(comms, cfg, device):
    """The ranks that hold this rank's experts (the mesh's ep_replicas: at this rank's
    stage and tp place), over which their gradients are averaged and scaled by 1 / ep
    (expert_parallel.py's docstring); a second collective on a duplicate for the comm
    thread.  Under ps the servers average them (their keys' group, server_buckets.py);
    the collective, the ring, only starts the replicas equal; under hybrid the servers'
    buckets ring over each expert's node instead (server_buckets.py's hybrid_nodes)."""
    replica_comm, algorithm = comms.ep_replicas, axis_collective(cfg)
    return Replicas(collective_for(algorithm, cfg, replica_comm, device=device),
                    collective_for(algorithm, cfg, replica_comm.Dup(), device=device)
                    if cfg.overlap else None, scale=1.0 / cfg.ep, place=f"ep{comms.ep_rank}")


def pipeline(plan, comms, cfg, device, stages, tracer, criterion):
    """Step 7 on the grid at pp >= 2: this rank's stages under --schedule, their
    activations and gradients over the pp axis's point-to-point transport (on a GPU
    staged through pinned host memory where MPI is not CUDA-aware: for_device).
    criterion: the cross-entropy alone (a stage adds its own balance losses)."""
    p2p = for_device(make_transport(comm=comms.pp, timeout=cfg.timeout), device)
    # a GPT's activation is this rank's positions: T, over tp's sequence-parallel
    # shards, over cp's slices; its peers on the pp axis share its (dp, cp, tp)
    feature = (positions_per_rank(cfg, comms.tp_size) // comms.cp_size, cfg.d_model) \
        if cfg.model in ("gpt", "moe") else (cfg.width,)
    kind = InterleavedPipeline if cfg.schedule == "interleaved" else Pipeline
    plan.schedule = kind(stages, criterion, p2p, comms.pp_rank, comms.pp_size,
                         cfg.micro_batches, cfg.schedule, lambda n: (n, *feature), tracer,
                         plan.meter, plan.precision)
    plan.schedule.recompute = plan.recompute
    plan.counters = plan.counters + [p2p]


def dropped_fraction(model):
    """The experts' run: the mean over MoE blocks of the tokens their capacity dropped."""
    dropped = [m.dropped_fraction for m in model.modules() if isinstance(m, MoE)]
    return sum(dropped) / len(dropped)
