"""Every rule about a run's settings, in one module, with two entry points (torchtitan's
config/validation.py):

    check_flags(cfg)               the config alone: each section's fields, then how the
                                   sections combine; TrainConfig.__post_init__ calls it
    check_world(cfg, world_size)   the config against the world: -> the data-parallel size

The command line (strategies.train), the Python API (DistributedOptimizer: its
sections, and its communicator's size) and the sweep (experiments/sweepfile.py) call
the same functions, so a rule is written once and a bad setting gets one message
wherever it is given.  `cli` names a field as a flag (`--link-gbps`) or as a keyword
(`link_gbps`), for the rules the API reaches; every ConfigError names its `field`.

A section (sections.py) checks its own fields on construction (`*_rules`, keyword
names); TrainConfig checks the same rules with flag names, then the combinations.
"""
from .choices import (ALLREDUCE_SYNCS, CONSISTENCIES, CP_KINDS, CP_ORDERS, DEGREES, DEVICES,
                      EMULATED_SYNCS, MODELS, OPTIMIZERS, PRECISIONS, PS_SYNCS,
                      REDUCE_PRECISIONS, SCHEDULES, SYNCS, ZERO_STAGES, ConfigError,
                      check_types, check_values, flag_of, setting_of)
from .compress_spec import check_compress, parse_compress
from .mesh import Mesh


# ------------------------------------------------------------------ each section alone
def check_section(section, rules):
    """A section built on its own (DistributedOptimizer's keywords): its fields' types,
    then its rules, each message naming a keyword."""
    check_types(section, cli=False)
    rules(section, cli=False)


def sync_rules(cfg, cli=True):
    """SyncOptions' fields; returns the CompressSpec (compress_spec.py checks --compress
    against the sync)."""
    check_values(cfg, cli, choices=(("sync", SYNCS), ("consistency", CONSISTENCIES)),
                 positive=("bucket_mb", "timeout"),
                 at_least=((0, ("ranks_per_node", "staleness", "link_latency_us",
                                "link_gbps")),))
    if (cfg.link_latency_us or cfg.link_gbps) and cfg.sync not in EMULATED_SYNCS:
        raise ConfigError(f"link emulation slows the textbook all-reduces "
                          f"({', '.join(EMULATED_SYNCS)}), "
                          f"not {setting_of('sync', cfg.sync, cli)}", field="sync")
    if cfg.consistency == "bsp" and cfg.staleness:
        raise ConfigError(f"{flag_of('staleness', cli)} needs "
                          f"{setting_of('consistency', 'ssp', cli)} (bsp waits for every worker)",
                          field="staleness")
    return check_compress(cfg.compress, cfg.sync, cfg.error_feedback, cli,
                          cfg.sparsity_warmup)


def precision_rules(cfg, cli=True):
    check_values(cfg, cli, choices=(("precision", PRECISIONS),
                                    ("reduce_precision", REDUCE_PRECISIONS)),
                 positive=("loss_scale",),
                 at_least=((1, ("loss_scale_window",)),))


def parallel_rules(cfg, cli=True):
    check_values(cfg, cli, choices=(("schedule", SCHEDULES), ("zero", ZERO_STAGES),
                                    ("cp_kind", CP_KINDS), ("cp_order", CP_ORDERS)),
                 at_least=DEGREES + ((1, ("servers", "micro_batches", "virtual_stages",
                                          "grad_accum")),))
    if cfg.sequence_parallel and cfg.tp < 2:
        raise ConfigError(f"--sequence-parallel splits the sequence over the tp ranks: "
                          f"it needs --tp > 1, got --tp {cfg.tp}", field="sequence_parallel")
    # --schedule interleaved and --virtual-stages go together, on a pipeline;
    # check_world adds the micro-batches and the model's cut
    interleaved = cfg.schedule == "interleaved"
    if cfg.virtual_stages > 1 and not interleaved:
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages} needs --schedule "
                          f"interleaved, not --schedule {cfg.schedule}", field="virtual_stages")
    if interleaved and cfg.virtual_stages < 2:
        raise ConfigError(f"--schedule interleaved needs --virtual-stages >= 2, got "
                          f"--virtual-stages {cfg.virtual_stages} (with 1 it is 1f1b)",
                          field="schedule")
    if interleaved and cfg.pp < 2:
        raise ConfigError(f"--schedule interleaved --virtual-stages {cfg.virtual_stages} "
                          f"needs a pipeline: --pp >= 2, got --pp {cfg.pp}", field="schedule")
    if cfg.pp_layers:
        split = parse_pp_layers(cfg.pp_layers, cli)
        if len(split) != cfg.pp or min(split) < 1:
            raise ConfigError(f"{flag_of('pp_layers', cli)} {cfg.pp_layers}: needs {cfg.pp} "
                              f"stages (pp({cfg.pp})) of at least one block each, got "
                              f"{len(split)}", field="pp_layers")
        if interleaved:
            raise ConfigError(f"{flag_of('pp_layers', cli)} {cfg.pp_layers} with --schedule "
                              f"interleaved is not supported: its pp x v chunks are cut "
                              f"evenly; use --schedule 1f1b or gpipe", field="pp_layers")


def parse_pp_layers(text, cli=True):
    """'2,3,2' -> (2, 3, 2); ConfigError where it is not whole numbers between commas."""
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ConfigError(f"{flag_of('pp_layers', cli)} {text!r} is not blocks per stage "
                          f"between commas (e.g. 2,3,2)", field="pp_layers") from None


def model_rules(cfg, cli=True):
    check_values(cfg, cli, choices=(("model", MODELS),),
                 at_least=((1, ("width", "depth", "layers", "d_model", "heads", "vocab",
                                "seq_len")), (0, ("kv_heads", "ffn_hidden"))))
    if cfg.model in ("gpt", "moe") and cfg.d_model % cfg.heads:
        raise ConfigError(f"--d-model {cfg.d_model} is not divisible by --heads {cfg.heads}",
                          field="d_model")
    if cfg.model in ("gpt", "moe") and cfg.kv_heads and cfg.heads % cfg.kv_heads:
        raise ConfigError(f"--kv-heads {cfg.kv_heads} does not divide --heads {cfg.heads}: "
                          f"each key-value head serves heads / kv-heads query heads "
                          f"({cfg.heads} % {cfg.kv_heads} = {cfg.heads % cfg.kv_heads})",
                          field="kv_heads")
    if cfg.model == "moe" and (cfg.ffn_hidden or cfg.gated_mlp):
        raise ConfigError("--ffn-hidden and --gated-mlp shape the GPT's MLP; --model moe's "
                          "experts are GPT-2's 4 x --d-model GELU MLPs", field="model")


def moe_rules(cfg, cli=True):
    if cfg.experts < 1 or cfg.top_k not in (1, 2) or cfg.top_k > cfg.experts:
        raise ConfigError(f"--top-k {cfg.top_k} must be 1 or 2 and at most --experts "
                          f"{cfg.experts} (>= 1)", field="top_k")
    check_values(cfg, cli, positive=("capacity_factor",),
                 at_least=((0, ("moe_group", "balance_loss")),))


def gating_group(moe_group, local, micro_batches):
    """The sequences of one gating group (model/moe.py): --moe-group N, or by default (0)
    those of one forward call of a replica, one of the micro-batches of its `local`
    sequences, which check_world requires to be of one size; without micro-batches, the
    local batch.  A group is what one forward sees, so a rank never waits on another's
    tokens to decide a capacity, and the one-process reference is --moe-group that many."""
    return moe_group or local // micro_batches


def data_rules(cfg, cli=True):
    check_values(cfg, cli, at_least=((1, ("in_dim", "classes", "dataset_size")),))


def optimizer_rules(cfg, cli=True):
    check_values(cfg, cli, choices=(("optimizer", OPTIMIZERS),), positive=("lr",),
                 at_least=((0, ("momentum", "weight_decay")),))
    if not cfg.momentum < 1:
        raise ConfigError(f"{flag_of('momentum', cli)} must be < 1, got {cfg.momentum!r}: "
                          f"the velocity v = m v + g grows without bound from m = 1",
                          field="momentum")


def run_rules(cfg, cli=True):
    check_values(cfg, cli, choices=(("device", DEVICES),),
                 at_least=((1, ("steps", "global_batch")), (0, ("threads", "seed"))))
    if cfg.straggler:
        parse_straggler(cfg.straggler)


def output_rules(cfg, cli=True):
    check_values(cfg, cli, at_least=((0, ("checkpoint_every",)),))
    if cfg.resume and not cfg.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir", field="resume")


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


# ------------------------------------------------------------------ sections together
def check_sync_combinations(sync, precision, optimizer, cli=True):
    """The sync section against the precision and the optimizer: for TrainConfig (pass it
    three times) and DistributedOptimizer (its sections; the optimizer's is the wrapped one)."""
    if sync.momentum_correction and not (
            parse_compress(sync.compress).kind == "topk" and optimizer.optimizer == "sgd"
            and optimizer.momentum > 0 and sync.error_feedback):
        raise ConfigError(f"{flag_of('momentum_correction', cli)} needs "
                          f"{setting_of('compress', 'topk:RATIO', cli)} with "
                          f"{setting_of('optimizer', 'sgd', cli)}, "
                          f"{flag_of('momentum', cli)} > 0 and error feedback, not "
                          f"{setting_of('compress', sync.compress, cli)} "
                          f"{setting_of('optimizer', optimizer.optimizer, cli)} "
                          f"{flag_of('momentum', cli)}{' ' if cli else '='}{optimizer.momentum:g}"
                          + ("" if sync.error_feedback else
                             " --no-error-feedback" if cli else " error_feedback=False"),
                          field="momentum_correction")


def check_flags(cfg):
    """Everything that needs the TrainConfig alone, each section then their combinations;
    the first problem is a ConfigError naming its flag."""
    check_types(cfg)
    sync_rules(cfg)
    for rules in (precision_rules, parallel_rules, model_rules, moe_rules, data_rules,
                  optimizer_rules, run_rules, output_rules):
        rules(cfg)
    if cfg.grad_accum > 1 and cfg.micro_batches not in (1, cfg.grad_accum):
        # one concept: accumulation is a schedule's micro-batches (settings.py folds them)
        raise ConfigError(f"--grad-accum {cfg.grad_accum} and --micro-batches "
                          f"{cfg.micro_batches} are the same thing on the grid and "
                          f"off it: give one of them", field="grad_accum")
    if cfg.tp > 1 and cfg.model == "mlp":
        raise ConfigError(f"--tp {cfg.tp}: tensor parallelism splits the GPT's attention "
                          "and MLP; use --model gpt", field="tp")
    check_moe(cfg)
    check_context(cfg)
    check_sync_combinations(cfg, cfg, cfg)
    blocks, what = cfg.blocks
    if cfg.pp_layers and sum(parse_pp_layers(cfg.pp_layers)) != blocks:
        split = parse_pp_layers(cfg.pp_layers)
        raise ConfigError(f"--pp-layers {cfg.pp_layers} adds up to {sum(split)} blocks, "
                          f"the model has {what} {blocks}", field="pp_layers")
    if cfg.sequence_parallel and cfg.seq_len % cfg.tp:
        raise ConfigError(f"--sequence-parallel: --seq-len {cfg.seq_len} is not divisible "
                          f"by tp({cfg.tp}): {cfg.seq_len} % {cfg.tp} = "
                          f"{cfg.seq_len % cfg.tp}", field="sequence_parallel")
    if cfg.zero and cfg.sync in PS_SYNCS:
        raise ConfigError(f"--zero {cfg.zero} needs an all-reduce --sync "
                          f"({', '.join(ALLREDUCE_SYNCS)}), not --sync {cfg.sync}: it has no "
                          f"meaning there, the parameter servers already hold the optimizer "
                          f"state and the parameters, sharded over the servers", field="zero")
    if cfg.on_grid and cfg.sync == "local":
        raise ConfigError("--dp/--pp/--tp split a model over ranks; --sync local is one "
                          "process", field="sync")


def check_moe(cfg):
    """The mixture of experts against the other techniques; check_world adds the world's."""
    if cfg.ep == 1:
        return
    if cfg.model != "moe":
        raise ConfigError(f"--ep {cfg.ep} needs --model moe: it splits the experts of "
                          f"--model moe, not of --model {cfg.model}", field="ep")
    if cfg.experts % cfg.ep:
        raise ConfigError(f"--experts {cfg.experts} is not divisible by ep({cfg.ep}): "
                          f"{cfg.experts} % {cfg.ep} = {cfg.experts % cfg.ep}", field="experts")
    if cfg.sync not in ALLREDUCE_SYNCS + PS_SYNCS:
        raise ConfigError(f"--ep {cfg.ep} needs an all-reduce --sync (ring, tree, ..., "
                          f"torch) or --sync ps or hybrid, not --sync {cfg.sync}", field="ep")


def check_context(cfg):
    """Context parallelism (--cp) against the model and the other techniques: what is
    built is the GPT's attention over a cp group (the whole model, tp and its sequence
    parallelism, pipelines, ZeRO, micro-batches, recompute, the MoE's experts under --ep
    or --zero, checkpoints), its gradients all-reduced or pushed to the parameter servers
    over the dp x cp replicas; the rest is refused with its reason."""
    if cfg.cp == 1:
        return
    if cfg.model not in ("gpt", "moe"):
        raise ConfigError(f"--cp {cfg.cp} splits the GPT's sequences over the cp ranks: it "
                          f"needs --model gpt or moe, not --model {cfg.model}", field="cp")
    if cfg.seq_len % cfg.cp:
        raise ConfigError(f"--cp {cfg.cp}: --seq-len {cfg.seq_len} is not divisible by "
                          f"cp({cfg.cp}): {cfg.seq_len} % {cfg.cp} = {cfg.seq_len % cfg.cp}; "
                          f"each cp rank holds an equal slice of the positions", field="cp")
    chunks = 2 * cfg.cp
    if cfg.cp_order == "zigzag" and cfg.seq_len % chunks:
        raise ConfigError(f"--cp-order zigzag cuts each sequence into 2 x cp({cfg.cp}) = "
                          f"{chunks} chunks: --seq-len {cfg.seq_len} % {chunks} = "
                          f"{cfg.seq_len % chunks}; choose --seq-len a multiple of {chunks}, "
                          f"or --cp-order contiguous", field="cp_order")
    per_tp = cfg.heads // cfg.tp if cfg.heads % cfg.tp == 0 else cfg.heads
    if cfg.cp_kind == "ulysses" and per_tp % cfg.cp:
        tp = f" / tp({cfg.tp})" if cfg.tp > 1 else ""
        raise ConfigError(f"--cp-kind ulysses splits each rank's heads over the cp ranks: "
                          f"--heads {cfg.heads}{tp} = {per_tp} is not a multiple of "
                          f"cp({cfg.cp}) ({per_tp} % {cfg.cp} = {per_tp % cfg.cp}); choose "
                          f"--heads a multiple of --cp, or --cp-kind ring", field="heads")
    slices = cfg.cp * cfg.tp
    if cfg.sequence_parallel and cfg.seq_len % slices:
        # tp's sequence-parallel shards cut each cp rank's slice of the positions again
        raise ConfigError(f"--cp {cfg.cp} with --sequence-parallel: --seq-len {cfg.seq_len} "
                          f"is not divisible by cp({cfg.cp}) x tp({cfg.tp}) = {slices}: "
                          f"{cfg.seq_len} % {slices} = {cfg.seq_len % slices}; tp's shards "
                          f"cut each cp rank's slice of the positions", field="sequence_parallel")
    if cfg.sync == "local":
        raise ConfigError(f"--cp {cfg.cp} with --sync local is not supported: it splits a "
                          f"sequence over ranks; --sync local is one process", field="cp")


# ------------------------------------------------------------------ against the world
def world_of(cfg, world_size):
    """(dp, how the world splits): `world 3 = dp(2) + servers(1)`, `dp(2) x pp(2) x tp(1) = 4`.
    The parameter servers' launcher (psrv.launch) decides which ranks serve; here only
    how many ranks are left to train."""
    if cfg.on_grid or cfg.cp > 1:          # world = dp x cp x pp x tp (mesh.py names each)
        servers = cfg.servers if cfg.sync in PS_SYNCS else 0
        if world_size - servers < 1:
            return 0, f"world {world_size} = servers({servers}) and no worker"
        mesh = Mesh(world_size - servers, cfg.dp, cfg.pp, cfg.tp, cfg.ep, cfg.cp)
        return mesh.dp, mesh.describe() + (f" + servers({servers})" if servers else "")
    if cfg.sync in PS_SYNCS:
        dp = world_size - cfg.servers
        return dp, f"world {world_size} = dp({dp}) + servers({cfg.servers})"
    return world_size, f"world {world_size} = dp({world_size})"


def check_sync_world(sync, world_size, cli=True):
    """The sync section against the size of its communicator: for TrainConfig (the whole
    launch) and DistributedOptimizer (its communicator) alike."""
    if sync.sync == "local" and world_size != 1:
        raise ConfigError(f"{setting_of('sync', 'local', cli)} runs on one process, not "
                          f"{world_size}", field="world_size")


def check_launcher(cfg, torchrun):
    """The flags against the launcher: torchrun starts torch.distributed's world alone,
    without MPI, which the parameter servers and the collectives of the other --syncs
    need.  Every split runs under it: the mesh's axes are then torch process groups
    (allreduce/torch_comm.py), not MPI communicators."""
    if not torchrun:
        return
    if cfg.sync != "torch":
        raise ConfigError(f"under torchrun only --sync torch works (got --sync {cfg.sync}); "
                          "launch the others with mpiexec", field="sync")


def check_world(cfg, world_size):
    """Every problem of the flags against the world (ConfigError, field world_size where
    no one flag is to blame); returns the data-parallel size.  The global batch is checked
    here once, for the plain loop and the grid alike; an error names each factor
    (`global batch 10 % dp(3) != 0`)."""
    dp, where = world_of(cfg, world_size)
    if dp < 1:
        raise ConfigError(f"no worker left: {where}; use fewer --servers or more ranks",
                          field="world_size")
    if cfg.straggler and parse_straggler(cfg.straggler)[0] >= world_size:
        raise ConfigError(f"--straggler rank {parse_straggler(cfg.straggler)[0]} is not a rank "
                          f"(world size {world_size})", field="straggler")
    check_sync_world(cfg, world_size)
    if cfg.global_batch % dp:
        raise ConfigError(f"--global-batch {cfg.global_batch} is not divisible by the "
                          f"data-parallel size: {cfg.global_batch} % dp({dp}) = "
                          f"{cfg.global_batch % dp} ({where})", field="world_size")
    local, k = cfg.global_batch // dp, cfg.micro_batches
    flag = "--grad-accum" if cfg.grad_accum > 1 else "--micro-batches"
    if k > local:
        raise ConfigError(f"{flag} {k} is more than the {local} samples of each replica "
                          f"(global batch {cfg.global_batch} / dp({dp}))", field="micro_batches")
    # k need not divide the local batch: every schedule cuts unequal micro-batches and
    # scales each one's loss by its share (engine/accumulation.py, parallel/pipeline.py)
    replicas = dp * cfg.cp                     # a hybrid node holds replicas: dp x cp
    if cfg.sync == "hybrid" and cfg.ranks_per_node and replicas % cfg.ranks_per_node:
        of = f"dp({dp}) x cp({cfg.cp}) = {replicas}" if cfg.cp > 1 else f"dp({dp})"
        raise ConfigError(f"--ranks-per-node {cfg.ranks_per_node} does not divide {of} "
                          f"into whole nodes ({where})", field="world_size")
    if cfg.sync == "hybrid" and cfg.ranks_per_node and cfg.ep > 1:
        check_expert_nodes(cfg, replicas)
    if cfg.on_grid:
        check_grid(cfg, dp)
    if cfg.model == "moe":
        servers = cfg.servers if cfg.sync in PS_SYNCS else 0
        Mesh(world_size - servers, cfg.dp, cfg.pp, cfg.tp, cfg.ep, cfg.cp)   # ep divides dp x cp
        if not cfg.moe_group and local % k:
            # the default group is one micro-batch (gating_group), and shard_bounds cuts
            # micro-batches of two sizes here: a group's size sets its experts' capacity
            raise ConfigError(f"--model moe: {flag} {k} cuts each replica's {local} sequences "
                              f"(global batch {cfg.global_batch} / dp({dp})) into micro-batches "
                              f"of {local // k + 1} and {local // k}, and the default gating "
                              f"group is one micro-batch: groups of unequal size have unequal "
                              f"capacities; give {flag} dividing {local}", field="micro_batches")
        if cfg.moe_group and local % (cfg.moe_group * k):
            raise ConfigError(f"--moe-group {cfg.moe_group} does not divide each of the {k} "
                              f"micro-batch(es) of the local batch into whole groups: global "
                              f"batch {cfg.global_batch} / dp({dp}) = {local} sequences",
                              field="moe_group")
    return dp


def check_expert_nodes(cfg, replicas):
    """--sync hybrid --ep with --ranks-per-node: every node that holds an expert's replicas
    (every ep-th of the dp x cp replicas, config/mesh.py) holds equally many of them, since
    the servers average the nodes' means (sync/server_buckets.py)."""
    per, ep = cfg.ranks_per_node, cfg.ep
    for place in range(ep):
        counts = {sum(1 for r in range(first, first + per) if r % ep == place)
                  for first in range(0, replicas, per)} - {0}
        if len(counts) > 1:
            raise ConfigError(f"--ranks-per-node {per} with --ep {ep} under --sync hybrid puts "
                              f"{' or '.join(map(str, sorted(counts)))} replicas of expert place "
                              f"{place} in a node: each node must hold equally many of an "
                              f"expert's replicas (every ep-th of the {replicas} replicas)",
                              field="ranks_per_node")


def check_grid(cfg, dp):
    """The grid's flags against its sizes and the model's blocks (the mesh is checked)."""
    blocks, what = cfg.blocks
    if cfg.pp > blocks:             # any pp up to the blocks: the split need not be even
        raise ConfigError(f"{what} {blocks} is fewer than pp({cfg.pp}) stages: every stage "
                          f"holds at least one block", field=what[2:])
    v, m = cfg.virtual_stages, cfg.micro_batches
    if cfg.schedule == "interleaved" and blocks % (cfg.pp * v):
        raise ConfigError(f"--schedule interleaved: {what} {blocks} is not divisible by "
                          f"pp({cfg.pp}) x virtual stages({v}) = {cfg.pp * v}: its chunks "
                          f"are cut evenly (1f1b and gpipe take any split)", field="schedule")
    if cfg.schedule == "interleaved" and m % cfg.pp:
        raise ConfigError(f"--schedule interleaved: --micro-batches {m} is not a multiple of "
                          f"pp({cfg.pp}): micro-batches go round the ranks in groups of pp",
                          field="schedule")
    if cfg.tp > 1:
        if cfg.heads % cfg.tp:
            raise ConfigError(f"--heads {cfg.heads} is not divisible by tp({cfg.tp}): "
                              f"{cfg.heads} % {cfg.tp} = {cfg.heads % cfg.tp}", field="heads")
        if cfg.d_model % cfg.tp:
            raise ConfigError(f"--d-model {cfg.d_model} is not divisible by tp({cfg.tp})",
                              field="d_model")
        kv_heads, ffn = cfg.kv_heads or cfg.heads, cfg.ffn_hidden or 4 * cfg.d_model
        if kv_heads % cfg.tp:       # Megatron-LM's num_query_groups % tp == 0
            raise ConfigError(f"--kv-heads {kv_heads} is not divisible by tp({cfg.tp}): "
                              f"each tp rank keeps whole key-value heads, kv-heads / tp of "
                              f"them ({kv_heads} % {cfg.tp} = {kv_heads % cfg.tp})",
                              field="kv_heads")
        if ffn % cfg.tp:
            raise ConfigError(f"--ffn-hidden {ffn} is not divisible by tp({cfg.tp}): each tp "
                              f"rank keeps ffn-hidden / tp of the MLP's columns "
                              f"({ffn} % {cfg.tp} = {ffn % cfg.tp})", field="ffn_hidden")

