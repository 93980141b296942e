"""Run a topolab command over an emulated slower network and/or with a straggler.

    mpiexec -n 4 .venv/bin/python -m mpi4py -m experiments.emulate \\
        --link-latency-us 100 --link-gbps 1 allreduce.bench --algos ring,tree --sizes 4K,4M
    mpiexec -n 3 .venv/bin/python -m mpi4py -m experiments.emulate --straggler 1:0.02 \\
        strategies.train --sync ps --servers 1 --consistency ssp --staleness 2 --steps 50
    (several hosts: the same after `mpiexec -f hosts.txt -n 8`; the emulation is per rank)

The options go before the command's name; everything after it is the command's own.

--link-latency-us / --link-gbps
    Every collective made through `allreduce.create` gets them, so each send
    costs latency + bytes / bandwidth (allreduce/emulate.py, the alpha-beta
    model).  Works for allreduce.bench and for strategies.train with any
    textbook --sync (ring, tree, halving_doubling, hierarchical); the mpi and
    torch baselines cannot be slowed down (allreduce refuses).
--straggler RANK:SECONDS
    strategies.train: the given rank's forward pass sleeps SECONDS every step,
    so it shows in that rank's compute time, as a slow GPU would.

Why a wrapper and not flags of the commands themselves: the two benchmarks
and the worker were written before this issue; wrapping keeps them untouched.
It patches the module-level names they call (`allreduce.create`,
`strategies.train.one_step`) before calling their `main(argv)`.
"""
import argparse
import importlib
import sys
import time

COMMANDS = ("allreduce.bench", "strategies.train", "psrv.bench")


def parse_straggler(text):
    """'RANK:SECONDS' -> (rank, seconds); ValueError with the reason."""
    rank, sep, seconds = str(text).partition(":")
    try:
        rank, seconds = int(rank), float(seconds)
    except ValueError:
        raise ValueError(f"--straggler {text!r} is not RANK:SECONDS (e.g. 1:0.05)") from None
    if not sep or rank < 0 or seconds < 0:
        raise ValueError(f"--straggler {text!r} needs RANK >= 0 and SECONDS >= 0")
    return rank, seconds


def slow_links(latency_us, gbps):
    """Make every allreduce.create(...) that does not choose a link emulate this one."""
    import allreduce
    real_create = allreduce.create

    def create(name, *args, **kwargs):
        if name not in ("mpi", "torch"):
            kwargs.setdefault("link_latency_us", latency_us)
            kwargs.setdefault("link_gbps", gbps)
        return real_create(name, *args, **kwargs)

    allreduce.create = create
    return create


def slow_rank(rank, seconds):
    """strategies.train: rank `rank` sleeps `seconds` inside every forward pass."""
    import strategies.train as train
    real_one_step = train.one_step

    def one_step(step, cfg, ctx, data, model, sync, optimizer, device, forward=None):
        if ctx.rank == rank:
            inner = forward or model

            def forward(x):
                time.sleep(seconds)
                return inner(x)
        return real_one_step(step, cfg, ctx, data, model, sync, optimizer, device, forward)

    train.one_step = one_step


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.emulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link-latency-us", type=float, default=0.0)
    p.add_argument("--link-gbps", type=float, default=0.0, help="0 = no bandwidth cap")
    p.add_argument("--straggler", default="", help="RANK:SECONDS (strategies.train only)")
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.link_latency_us < 0 or a.link_gbps < 0:
        p.error("--link-latency-us and --link-gbps must be >= 0")
    if a.link_latency_us or a.link_gbps:
        if a.command == "psrv.bench":
            p.error("psrv.bench talks over ZeroMQ; link emulation covers allreduce/ only")
        slow_links(a.link_latency_us, a.link_gbps or None)
    if a.straggler:
        if a.command != "strategies.train":
            p.error("--straggler applies to strategies.train")
        try:
            slow_rank(*parse_straggler(a.straggler))
        except ValueError as e:
            p.error(str(e))
    module = importlib.import_module(a.command)
    if a.command == "allreduce.bench":         # it imported `create` by name
        module.create = sys.modules["allreduce"].create
    return module.main(a.args)


if __name__ == "__main__":
    main()
