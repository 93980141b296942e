"""Training throughput of each --sync beside torch's own DistributedDataParallel (gloo).

Same model, same global batch, same P, one launch: every method builds its own
replica, then rounds run the methods in turn (A B C A B C ...), because this
VM's speed drifts minute to minute; the table gives
each method's median over rounds and its ratio to DDP measured in the same rounds.

One process (nothing to synchronise; a sanity check of the harness):
    python -m strategies.bench --syncs local --width 256 --rounds 2

Two processes, the communication-heavy MLP (~21M parameters, 84 MB of gradients):
    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.bench \\
        --syncs ring,ring:no-overlap,mpi,torch,ddp --model mlp --width 2048 --depth 6 \\
        --global-batch 32 --bucket-mb 25 --rounds 5 --steps-per-round 5 --jsonl bench.jsonl

Several hosts: as for strategies.train (`mpiexec -f hosts.txt -n 8 -ppn 4 ...`).

A method is a --sync name (ring, tree, halving_doubling, hierarchical, mpi, torch),
optionally with `:no-overlap` or `:fp16`/`:bf16`, or `ddp`, or `bare`: a plain
PyTorch loop over the same model, data and optimizer with nothing of topolab in its
step (zero_grad, forward under autocast, backward, step, the loss read back, as a
loop that logs it does; torch's GradScaler under fp16), the floor of `local`:

    python -m strategies.bench --syncs local,bare --model gpt --rounds 5 [--device cuda]

ps and hybrid are left out: their servers take ranks away from the data-parallel workers, so P
would not be the same.  `local` under P > 1 ranks trains without any
communication: the compute-only bound.  DDP's exposed communication shows as
0, since it waits inside backward where this harness cannot see it.  The
rounds are allreduce/harness.py's; `x DDP` is the median over rounds of DDP's
step time / the method's in the same round; `/ bare` the median over rounds of the
method's step time / the bare loop's (the trainer's own cost, where `bare` runs).
Every other flag is TrainConfig's, listed under "training flags" below.
"""
import argparse
import dataclasses
import statistics
import sys

import torch

from allreduce.cli import add_output_flags, dataclass_flags
from allreduce.harness import interleaved
from allreduce.records import append_jsonl, provenance

from .config.settings import ALLREDUCE_SYNCS, ConfigError, TrainConfig
from .engine.accumulation import Accumulation
from .engine.loop import StepEngine
from .engine.parallelize import Parallelized
from .model.data import load_data
from .model.models import build_model
from .runtime.context import RunContext
from .runtime.metrics import now
from .runtime.fp8_linear import check_device, to_fp8
from .runtime.precision import HALF_DTYPES, MixedPrecision
from .sync.gradient_sync import GradientSync, make_optimizer, torch_optimizer


class DDPSync(GradientSync):
    """torch.nn.parallel.DistributedDataParallel: it all-reduces inside backward."""
    name = "ddp"

    def setup(self, model):
        from torch.nn.parallel import DistributedDataParallel

        from allreduce.torch_world import init_torch_distributed
        init_torch_distributed(self.ctx.comm)
        super().setup(model)
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=self.cfg.bucket_mb)


class BareLoop:
    """The textbook loop, for the floor: no sync, no engine, no records of its own.
    At P > 1 each rank trains its shard of the batch alone, as `local` does."""

    def __init__(self, cfg, ctx, data, device):
        self.cfg, self.ctx, self.data, self.device = cfg, ctx, data, device
        self.model = build_model(cfg, data.spec, device)
        self.optimizer = torch_optimizer(cfg, self.model.parameters())
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.dtype = HALF_DTYPES.get(cfg.precision)   # fp8: bf16's autocast, and fp8's layers
        if cfg.precision == "fp8":
            check_device(device)
            to_fp8(self.model)
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None
        self.sync = self                           # the harness closes a method's sync

    def step(self, step):
        x, y = self.data.batch(step, self.ctx.dp_rank, self.ctx.dp_size,
                               self.cfg.global_batch, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None):
            loss = self.model.criterion(self.model(x), y)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss.item(), {"comm_time_s": 0.0}

    def close(self):
        pass


def make_method(method, base, ctx, data, device):
    """The step engine (engine/loop.py) of one method name: the syncs of
    strategies.train, built the way it builds them, or torch's DDP, or the bare loop."""
    name, _, option = method.partition(":")
    if name == "bare" and not option:
        return BareLoop(base, ctx, data, device)
    if name != "ddp" and name not in ALLREDUCE_SYNCS + ("local",):
        raise ConfigError(f"bench: unknown method {method!r}; use ddp, bare or one of "
                          f"{', '.join(ALLREDUCE_SYNCS + ('local',))}")
    changes = {"sync": "local" if name == "ddp" else name}
    if option == "no-overlap":
        changes["overlap"] = False
    elif option in ("fp16", "bf16"):
        changes["compress"] = option
    elif option:
        raise ConfigError(f"bench: unknown option {option!r} in {method!r}")
    cfg = dataclasses.replace(base, **changes)
    model = build_model(cfg, data.spec, device)
    if name == "ddp":           # the trainer's step over DDP's forward, backward and sync
        sync = DDPSync(cfg, ctx, device)
        sync.setup(model)
        plan = Parallelized(model, Accumulation(sync.ddp, model.criterion, 1, device), sync,
                            make_optimizer(cfg, model.parameters()), MixedPrecision(),
                            counters=[sync])
        return StepEngine(cfg, ctx, device, data, model, plan)
    # The trainer's own engine (parallelize.py builds the sync).  "local" at P > 1 trains
    # each rank's shard with no communication at all.
    return StepEngine(cfg, ctx, device, data, model)


def parser():
    """The bench's own flags, then every TrainConfig flag (help from strategies/config/settings.py)."""
    p = argparse.ArgumentParser(prog="python -m strategies.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--syncs", default="ring,mpi,torch,ddp",
                   help="comma list of methods: a --sync name, optionally with :no-overlap, "
                        ":fp16 or :bf16, or ddp, or bare (a plain PyTorch loop)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (every method once each)")
    p.add_argument("--steps-per-round", type=int, default=5,
                   help="training steps a method takes in each round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per method first")
    add_output_flags(p, out=False)
    dataclass_flags(p.add_argument_group("training flags (as strategies.train)"), TrainConfig,
                    skip=("jsonl",))
    return p


def bench(argv=None):
    """Run the benchmark; returns its rows (every rank)."""
    args = parser().parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup < 0:
        raise ConfigError(f"--rounds {args.rounds} --steps-per-round {args.steps_per_round} "
                          f"--warmup {args.warmup}: need rounds and steps >= 1, warmup >= 0",
                          field="rounds")
    methods = args.syncs.split(",")
    base = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                          if f.name not in ("jsonl", "progress")}, progress=False)  # no bar
    # The context only needs the world; "ring" stands for any all-reduce method.
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    ctx = RunContext.create(dataclasses.replace(base, sync="ring" if comm.size > 1 else "local"))
    ctx.set_threads(base)
    device = ctx.device(base)
    data = load_data(base)
    built = {m: make_method(m, base, ctx, data, device) for m in methods}
    params = next(iter(built.values())).parameters
    if ctx.rank == 0:
        print(f"bench: {base.model} with {params:,} parameters ({4 * params / 2**20:.0f} MiB of "
              f"gradients), P={ctx.dp_size}, global batch {base.global_batch}, "
              f"bucket {base.bucket_mb} MB, {torch.get_num_threads()} torch thread(s) per rank, "
              f"{args.rounds} rounds x {args.steps_per_round} steps, interleaved", flush=True)
    steps = {m: 0 for m in methods}
    exposed = {m: [] for m in methods}         # exposed communication, step by step

    def step(method):
        _, fields = built[method].step(steps[method])
        steps[method] += 1
        exposed[method].append(fields["comm_time_s"])

    for m in methods:
        for _ in range(args.warmup):
            step(m)
        exposed[m].clear()
    # one sample: a round's steps of one method, per step; the slowest rank sets the pace
    timings = interleaved({m: (lambda m=m: step(m)) for m in methods}, rounds=args.rounds,
                          warmup=0, calls=args.steps_per_round, comm=comm,
                          settle=lambda: now(device))
    for m in methods:
        built[m].sync.close()
    rows = []
    for m in methods:
        step_s = timings.median(m)
        rows.append({"kind": "bench", "method": m, "world_size": ctx.world_size,
                     "parameters": params, "global_batch": base.global_batch,
                     "median_step_s": step_s, "step_s_spread": timings.spread(m),
                     "samples_per_s": base.global_batch / step_s,
                     "median_exposed_comm_s": statistics.median(exposed[m]),
                     "speedup_vs_ddp": timings.ratio("ddp", m) if "ddp" in methods else None,
                     "vs_bare": timings.ratio(m, "bare") if "bare" in methods else None,
                     "step_s_per_round": timings.samples[m], "config": base.as_dict(),
                     "argv": sys.argv[1:] if argv is None else argv, **provenance()})
    if ctx.rank == 0:
        print(f"{'method':<22}{'samples/s':>12}{'step ms':>10}{'exposed comm ms':>17}"
              f"{'x DDP':>8}{'/ bare':>8}")
        for row in rows:
            ratio = f"{row['speedup_vs_ddp']:.2f}" if row["speedup_vs_ddp"] else "-"
            over = f"{row['vs_bare']:.3f}" if row["vs_bare"] else "-"
            print(f"{row['method']:<22}{row['samples_per_s']:>12.1f}"
                  f"{1000 * row['median_step_s']:>10.1f}"
                  f"{1000 * row['median_exposed_comm_s']:>17.1f}{ratio:>8}{over:>8}",
                  flush=True)
        if args.jsonl:
            append_jsonl(args.jsonl, rows)
    comm.Barrier()
    return rows


def main(argv=None):
    """The command line (`topolab-train-bench`): exit status 0 after a run (sys.exit
    would print a returned list of rows and exit 1)."""
    try:
        bench(argv)
    except ConfigError as e:                    # every rank finds the same bad flag
        print(f"strategies.bench: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
