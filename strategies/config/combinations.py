"""Which flags go together: the checks of one technique against the rest of a TrainConfig.

TrainConfig.__post_init__ (config/settings.py) calls each; a combination that has no
implementation gets a ConfigError that names both flags, before any rank starts.
The settings of the syncs are checked here once for TrainConfig and for
SyncOptions (sync/gradient_sync.py), which share those fields: `cli` names a field as a flag
(`--link-gbps`), else as DistributedOptimizer's keyword (`link_gbps`).
The checks that also need the world size are in config.dp_size_of,
expert_parallel.check and interleaved.check.
"""
import dataclasses
import math

from .choices import (ALLREDUCE_SYNCS, CONSISTENCIES, EMULATED_SYNCS, OPTIMIZERS, PS_SYNCS,
                      SYNCS, ConfigError, flag_of, setting_of)
from .compress_spec import check_compress


def check_finite(cfg, cli=True):
    """Every float field of a config is a number: inf and NaN train to NaN, or hang a
    wait for ever (a NaN timeout), so they are refused where they are read."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag_of(f.name, cli)} must be a finite number, got {value!r}",
                              field=f.name)


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


def check_sync(cfg, cli=True):
    """The settings the syncs read, for TrainConfig and SyncOptions alike; returns the
    CompressSpec (config/compress_spec.py checks --compress against the sync)."""
    check_finite(cfg, cli)
    check_values(cfg, cli, choices=(("sync", SYNCS), ("consistency", CONSISTENCIES),
                                    ("optimizer", OPTIMIZERS)),
                 positive=("bucket_mb", "lr", "timeout"),
                 at_least=((0, ("ranks_per_node", "staleness", "momentum", "weight_decay",
                                "link_latency_us", "link_gbps")),))
    if not cfg.momentum < 1:
        raise ConfigError(f"{flag_of('momentum', cli)} must be < 1, got {cfg.momentum!r}: "
                          f"the velocity v = m v + g grows without bound from m = 1",
                          field="momentum")
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


def check_schedule(cfg):
    """--schedule interleaved and --virtual-stages go together, on a pipeline;
    interleaved.check adds the micro-batches and the model's cut."""
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


def check_moe(cfg):
    """The mixture-of-experts flags alone; expert_parallel.check adds the world's."""
    if cfg.experts < 1 or cfg.top_k not in (1, 2) or cfg.top_k > cfg.experts:
        raise ConfigError(f"--top-k {cfg.top_k} must be 1 or 2 and at most --experts "
                          f"{cfg.experts} (>= 1)", field="top_k")
    check_values(cfg, positive=("capacity_factor",),
                 at_least=((0, ("moe_group", "balance_loss")), (1, ("ep",))))
    if cfg.model == "moe" and cfg.grad_accum > 1:
        raise ConfigError(f"--model moe with --grad-accum {cfg.grad_accum} is not "
                          "supported: micro-steps would change the gating groups and "
                          "each expert's capacity", field="model")
    if cfg.model == "moe" and cfg.recompute:
        raise ConfigError("--model moe with --recompute is not supported: it checkpoints "
                          "the blocks of --model mlp and gpt", field="model")
    if cfg.model == "moe":
        for what, refused, why in (
                (f"--pp {cfg.pp}", cfg.pp > 1, "the last stage's loss adds every block's "
                                               "balance loss, and a stage holds its own only"),
                (f"--tp {cfg.tp}", cfg.tp > 1, "its experts are split over --ep ranks, not tp"),
                (f"--micro-batches {cfg.micro_batches}", cfg.micro_batches > 1,
                 "micro-batches would change the gating groups"),
                ("--zero 3", cfg.zero == 3, "ZeRO-3 would gather each expert inside the "
                                            "all-to-alls; stages 1 and 2 shard it")):
            if refused:
                raise ConfigError(f"--model moe with {what} is not supported: {why}",
                                  field="model")
    if cfg.ep == 1:
        return
    if cfg.model != "moe":
        raise ConfigError(f"--ep {cfg.ep} splits the experts of --model moe, not of "
                          f"--model {cfg.model}", field="ep")
    if cfg.experts % cfg.ep:
        raise ConfigError(f"--experts {cfg.experts} is not divisible by ep({cfg.ep}): "
                          f"{cfg.experts} % {cfg.ep} = {cfg.experts % cfg.ep}", field="experts")
    if cfg.sync not in ALLREDUCE_SYNCS or cfg.sync == "torch":
        raise ConfigError(f"--ep {cfg.ep} needs an all-reduce --sync over MPI "
                          f"(ring, tree, ...), not --sync {cfg.sync}", field="ep")
    if cfg.device != "cpu":
        raise ConfigError(f"--ep {cfg.ep} with --device {cfg.device} is not supported yet: "
                          f"the experts' all-to-alls take CPU tensors", field="ep")


def check_precision_sync(precision, sync, cli=True):
    """Mixed precision against the sync, for TrainConfig and DistributedOptimizer alike.
    bf16 needs no loss scale: the workers compute under autocast and push the fp32
    gradients of their fp32 parameters, which the parameter servers take as they are."""
    if sync in PS_SYNCS and precision == "fp16":
        raise ConfigError(f"{setting_of('precision', precision, cli)} with "
                          f"{setting_of('sync', sync, cli)} is not supported: an fp16 overflow "
                          f"skips the step on every rank, and the servers, which apply what "
                          f"they are pushed, have no message for a skipped step; use bf16",
                          field="precision")


def check_precision(cfg):
    """--precision against the rest: where mixed precision has no implementation,
    the error names the combination (precision.py says what each part does)."""
    check_values(cfg, positive=("loss_scale",), at_least=((1, ("loss_scale_window",)),))
    if cfg.precision == "fp32":
        return
    check_precision_sync(cfg.precision, cfg.sync)
