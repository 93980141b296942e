"""DistributedOptimizer's arguments, checked before any message is sent.

Its keywords are the fields of two sections (sections.py): `sections_of` builds them,
each checking its fields (validate.py's rules, named as keywords); the wrapped torch
optimizer gives the third, OptimizerOptions (`described_optimizer`).  Each check raises
an error naming what is wrong, on every rank that sees it; `check_same_everywhere`
compares every field of the ranks' sections, so that a rank started with other
settings is named instead of hanging its peers in a collective.
"""
import dataclasses
import sys
import textwrap
import zlib

import torch

from allreduce.cli import field_comments
from allreduce.torch_world import torchrun_world

from .choices import ConfigError
from .sections import OptimizerOptions, PrecisionOptions, SyncOptions

KEYWORD_SECTIONS = (SyncOptions, PrecisionOptions)     # DistributedOptimizer's **settings


def sections_of(settings, sync):
    """(SyncOptions, PrecisionOptions) of DistributedOptimizer's keywords; an unknown
    keyword is a TypeError naming the known ones."""
    known = {f.name: kind for kind in KEYWORD_SECTIONS for f in dataclasses.fields(kind)}
    unknown = sorted(set(settings) - set(known))
    if unknown:
        names = ", ".join(n for n in known if n != "sync")
        raise TypeError(f"DistributedOptimizer got an unknown keyword {unknown[0]!r}; "
                        f"its settings are {names}")
    return tuple(kind(**{k: v for k, v in settings.items() if known[k] is kind},
                      **({"sync": sync} if kind is SyncOptions else {}))
                 for kind in KEYWORD_SECTIONS)


def keyword_help():
    """The keywords' lines of help(DistributedOptimizer), from the sections' comments."""
    lines = ["Build the sync (every rank of comm alike).  Keyword settings, each a field of",
             "config.sections' SyncOptions or PrecisionOptions (the flags of strategies.train):",
             ""]
    for kind in KEYWORD_SECTIONS:
        comments = field_comments(kind)
        for f in dataclasses.fields(kind):
            if f.name != "sync":
                lines += textwrap.wrap(f"{f.name}={f.default!r}: {comments[f.name]}", 84,
                                       initial_indent="    ", subsequent_indent="        ")
    return "\n".join(lines)


def described_optimizer(optimizer, servers, momentum_correction):
    """The OptimizerOptions of the wrapped optimizer, where a sync needs them: the
    servers run it (ps, hybrid), or top-k takes its momentum (momentum_correction);
    else the defaults, which no sync reads."""
    if servers:
        return OptimizerOptions(**server_settings(optimizer))
    if not momentum_correction:
        return OptimizerOptions()
    if type(optimizer) not in SERVER_OPTIMIZERS:
        raise ConfigError(f"momentum_correction=True moves the momentum of torch.optim.SGD "
                          f"into the compressor, not of {type(optimizer).__name__}",
                          field="momentum_correction")
    group = optimizer.param_groups[0]
    return OptimizerOptions(optimizer=SERVER_OPTIMIZERS[type(optimizer)][0],
                            momentum=float(group.get("momentum", 0.0)))


def check_model(optimizer, model):
    """The model's trainable parameters and their device, or an error naming the problem."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, not "
                        f"{type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no parameter that requires grad: nothing to synchronise")
    owned = {id(p) for p in model.parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
    if stray:
        shapes = ", ".join(str(tuple(p.shape)) for p in stray[:3])
        raise ConfigError(f"{len(stray)} of the optimizer's parameters are not the model's "
                          f"(shapes {shapes}{', ...' if len(stray) > 3 else ''}): their gradients "
                          "would never be averaged; build the optimizer from model.parameters()")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ConfigError(f"the model's parameters are on several devices ({', '.join(devices)});"
                          " data parallelism wants one device per rank: model.to(device)")
    dtypes = sorted({str(p.dtype) for p in params} - {"torch.float32"})
    if dtypes:
        raise ConfigError(f"the gradient buckets are float32, the parameters {', '.join(dtypes)};"
                          " keep float32 parameters (torch.autocast computes in 16 bits with them)")
    return params, params[0].device


# The optimizer settings psrv/optim.py implements, beyond lr, momentum and weight decay.
SERVER_OPTIMIZERS = {
    torch.optim.SGD: ("sgd", {"dampening": 0, "nesterov": False, "maximize": False}),
    torch.optim.Adam: ("adam", {"betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False,
                                "maximize": False, "decoupled_weight_decay": False}),
}


def server_settings(optimizer):
    """The wrapped optimizer as the servers will run it (ps, hybrid)."""
    if type(optimizer) not in SERVER_OPTIMIZERS:
        raise ConfigError(f"sync='ps'/'hybrid': the servers run torch.optim.SGD or Adam, "
                          f"not {type(optimizer).__name__}", field="sync")
    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"sync='ps'/'hybrid': the servers run one optimizer over all "
                          f"parameters, not {len(optimizer.param_groups)} parameter groups",
                          field="sync")
    name, fixed = SERVER_OPTIMIZERS[type(optimizer)]
    group = optimizer.param_groups[0]
    for key, value in fixed.items():
        if key in group and group[key] != value:
            raise ConfigError(f"sync='ps'/'hybrid': the servers run {name} with {key}={value},"
                              f" this optimizer has {key}={group[key]}", field="sync")
    return {"optimizer": name, "lr": float(group["lr"]),
            "momentum": float(group.get("momentum", 0.0)),
            "weight_decay": float(group["weight_decay"])}


def transport_for(name, transport):
    """MPI under mpiexec; torch.distributed for sync='torch', and under torchrun, which
    starts no MPI world (each process would be a world of its own)."""
    torchrun = torchrun_world()
    if transport is None:
        transport = name if name in ("mpi", "torch") else "torch" if torchrun else "mpi"
    if transport not in ("mpi", "torch"):
        raise ConfigError(f"transport={transport!r} is not 'mpi' or 'torch'", field="transport")
    if name in ("mpi", "torch") and transport != name:
        raise ConfigError(f"sync={name!r} is the {name} library's own all-reduce: it runs over "
                          f"transport={name!r}, not {transport!r}", field="sync")
    if transport == "mpi" and torchrun:
        raise ConfigError(f"under torchrun there is no MPI world: use sync='torch' (or "
                          f"transport='torch' for sync={name!r}), or launch with mpiexec")
    return transport


def check_comm(comm, transport):
    if comm is None:
        return
    if transport == "torch" and (isinstance(comm, (list, tuple, range)) or (
            torch.distributed.is_available() and
            isinstance(comm, torch.distributed.ProcessGroup))):
        return
    MPI = sys.modules.get("mpi4py.MPI")        # imported already wherever a communicator is
    if MPI is not None and isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ConfigError("comm is MPI.COMM_NULL: this rank is not in the communicator "
                              "(a Split with color MPI.UNDEFINED); build no optimizer here")
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an intracommunicator, not an {type(comm).__name__}")
        return
    what = "an mpi4py communicator" + (", a list of global ranks or a torch ProcessGroup"
                                       if transport == "torch" else "")
    raise TypeError(f"comm must be {what} (e.g. MPI.COMM_WORLD.Split(color, key)), "
                    f"not {type(comm).__name__}")


def check_same_everywhere(gather, params, sections):
    """Every rank must bring the same model and settings, or the buckets differ and
    the collectives would pair unrelated buffers (or wait for ever).  If any rank
    differs, every rank sees a rank unlike itself, so every rank raises.  `sections`:
    the config sections the ranks must share, compared field by field (a new setting
    is compared without a word here)."""
    shapes = ";".join(str(tuple(p.shape)) for p in params)
    settings = repr([dataclasses.astuple(s) for s in sections])
    mine = [len(params), sum(p.numel() for p in params), zlib.crc32(shapes.encode()),
            zlib.crc32(settings.encode())]
    for rank, theirs in enumerate(gather(mine)):
        theirs = [int(v) for v in theirs]
        if theirs != mine:
            names = ", ".join(f.name for s in sections for f in dataclasses.fields(s))
            what = f"settings (one of {names})" if theirs[:3] == mine[:3] \
                else f"model ({theirs[0]} trainable tensors, {theirs[1]} elements, shapes " \
                     f"checksum {theirs[2]:x}; here {mine[0]}, {mine[1]}, {mine[2]:x})"
            raise ConfigError(f"rank {rank} of the communicator has another {what} than this "
                              "rank: every rank must wrap the same model with the same settings")


def check_same_config(everyone, cfg):
    """Every rank of a launch must run the same TrainConfig (strategies.train's one
    check, on every run): a rank with another --lr, --layers or --sync would build
    other buckets, stages or keys, and the others would pair unrelated buffers or wait
    for ever.  everyone: every rank's TrainConfig (the launch's control channel
    gathers them); every rank sees a rank unlike itself where one differs, so every
    rank raises, naming the first field that differs."""
    for rank, theirs in enumerate(everyone):
        if theirs == cfg:
            continue
        name = next(f.name for f in dataclasses.fields(cfg)
                    if getattr(theirs, f.name) != getattr(cfg, f.name))
        raise ConfigError(f"rank {rank} was started with other settings than this rank "
                          f"({name} = {getattr(theirs, name)!r} there, {getattr(cfg, name)!r} "
                          f"here): every rank of a launch must get the same flags", field=name)


def gathered(coll, values):
    """Every rank's list of ints, through the collective itself (MPI or torch)."""
    mine = torch.tensor(values, dtype=torch.int64)
    return coll.allgather(mine, len(values) * coll.size).view(coll.size, -1).tolist()
