"""Which flags go together: the checks of one technique against the rest of a TrainConfig.

TrainConfig.__post_init__ (config.py) calls each; a combination that has no
implementation gets a ConfigError that names both flags, before any rank starts.
The checks that also need the world size are in config.dp_size_of,
expert_parallel.check and interleaved.check.
"""
from .choices import ALLREDUCE_SYNCS, PRECISIONS, PS_SYNCS, ConfigError


def check_schedule(cfg):
    """--schedule interleaved and --virtual-stages go together, on a pipeline;
    interleaved.check adds the micro-batches and the model's cut."""
    interleaved = cfg.schedule == "interleaved"
    if cfg.virtual_stages > 1 and not interleaved:
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages} needs --schedule "
                          f"interleaved, not --schedule {cfg.schedule}")
    if interleaved and cfg.virtual_stages < 2:
        raise ConfigError(f"--schedule interleaved needs --virtual-stages >= 2, got "
                          f"--virtual-stages {cfg.virtual_stages} (with 1 it is 1f1b)")
    if interleaved and cfg.pp < 2:
        raise ConfigError(f"--schedule interleaved --virtual-stages {cfg.virtual_stages} "
                          f"needs a pipeline: --pp >= 2, got --pp {cfg.pp}")


def check_moe(cfg):
    """The mixture-of-experts flags alone; expert_parallel.check adds the world's."""
    if cfg.experts < 1 or cfg.top_k not in (1, 2) or cfg.top_k > cfg.experts:
        raise ConfigError(f"--top-k {cfg.top_k} must be 1 or 2 and at most --experts "
                          f"{cfg.experts} (>= 1)")
    if not cfg.capacity_factor > 0 or cfg.moe_group < 0 or cfg.balance_loss < 0 \
            or cfg.ep < 1:
        raise ConfigError("--capacity-factor must be > 0, --moe-group and --balance-loss "
                          ">= 0, --ep >= 1")
    if cfg.model == "moe" and cfg.grad_accum > 1:
        raise ConfigError(f"--model moe with --grad-accum {cfg.grad_accum} is not "
                          "supported: micro-steps would change the gating groups and "
                          "each expert's capacity")
    if cfg.model == "moe" and cfg.recompute:
        raise ConfigError("--model moe with --recompute is not supported: it checkpoints "
                          "the blocks of --model mlp and gpt")
    if cfg.model == "moe" and cfg.on_grid:
        raise ConfigError("--model moe with --dp/--pp/--tp/--zero/--micro-batches is not "
                          "supported: micro-batches would change the gating groups")
    if cfg.ep == 1:
        return
    if cfg.model != "moe":
        raise ConfigError(f"--ep {cfg.ep} splits the experts of --model moe, not of "
                          f"--model {cfg.model}")
    if cfg.experts % cfg.ep:
        raise ConfigError(f"--experts {cfg.experts} is not divisible by ep({cfg.ep}): "
                          f"{cfg.experts} % {cfg.ep} = {cfg.experts % cfg.ep}")
    if cfg.sync not in ALLREDUCE_SYNCS or cfg.sync == "torch":
        raise ConfigError(f"--ep {cfg.ep} needs an all-reduce --sync over MPI "
                          f"(ring, tree, ...), not --sync {cfg.sync}")
    for flag, unsupported in (("--checkpoint-dir", cfg.checkpoint_dir),
                              ("--straggler", cfg.straggler),
                              ("--device cuda", cfg.device != "cpu")):
        if unsupported:
            raise ConfigError(f"--ep {cfg.ep} with {flag} is not supported")


def check_precision(cfg):
    """--precision against the rest: where mixed precision has no implementation,
    the error names the combination (precision.py says what each part does)."""
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"--precision {cfg.precision!r} is not one of "
                          f"{', '.join(PRECISIONS)}")
    if not cfg.loss_scale > 0 or cfg.loss_scale_window < 1:
        raise ConfigError(f"--loss-scale must be > 0 and --loss-scale-window >= 1, got "
                          f"{cfg.loss_scale} and {cfg.loss_scale_window}")
    if cfg.precision == "fp32":
        return
    what = f"--precision {cfg.precision}"
    if cfg.sync in PS_SYNCS:
        raise ConfigError(f"{what} with --sync {cfg.sync} is not supported: the servers "
                          f"run the optimizer on what they are sent, with no loss scale")
    # ep: tokens cross ranks in the all-to-alls' fp32 buffers so far;
    # fp16 checkpoints would lose the loss scale
    for flag, unsupported in ((f"--ep {cfg.ep}", cfg.ep > 1),
                              ("--checkpoint-dir", cfg.checkpoint_dir and
                               cfg.precision == "fp16")):
        if unsupported:
            raise ConfigError(f"{what} with {flag} is not supported yet: data parallelism "
                              f"(an all-reduce --sync, --zero 0-3), pipeline and tensor "
                              f"parallelism compute in 16 bit")
