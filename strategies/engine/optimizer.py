"""DistributedOptimizer: data-parallel training of your own model, in your own loop.

    import strategies
    opt = strategies.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                          model, sync="ring")      # every rank builds it
    for x, y in my_shard:              # this rank's B/P samples: shard opt.rank of opt.size
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # gradient buckets are all-reduced meanwhile
        opt.step()                     # waits for the averaged gradients, then steps
    opt.close()                        # or: with strategies.DistributedOptimizer(...) as opt:

The seam is the optimizer, as in Horovod (Sergeev & Del Balso, 2018) and
BytePS: the loop keeps its four lines.  Underneath is the one data-parallel call of
strategies.train (sync/data_parallel.py) over the model's parameters, a sync of the
contract in sync/gradient_sync.py: rank 0's parameters and buffers win and the bucket
hooks attach at construction, `zero_grad` is its before_backward, `step` its
synchronize and step.  Each rank's loss is the mean over its shard and the
gradients are averaged over the communicator, so with equal shards every rank
takes the step of the mean loss over the global batch.

    sync   ring, tree, halving_doubling, hierarchical, mpi, torch, auto; or a collective
           of allreduce.create(...); or ps / hybrid with role=ps_roles(...) (below);
           or local: one process, no communication (the reference for the others)
    comm   an mpi4py communicator (default COMM_WORLD; under torchrun the whole world);
           for the torch transport also a list of global ranks
    **settings   the fields of config/sections.py's SyncOptions and PrecisionOptions, the
           flags of strategies.train by their keyword names (help(DistributedOptimizer.
           __init__) lists them): bucket_mb, overlap, compress ("none", "fp16", "bf16",
           "topk:0.01", "powersgd:4"), error_feedback, momentum_correction (topk: the
           wrapped SGD's momentum moves into the compressor, DGC), sparsity_warmup,
           ranks_per_node, timeout, consistency, staleness, link_latency_us, link_gbps,
           precision, loss_scale, loss_scale_window; each checked by the rule the flag has

Gradient accumulation (DDP's and Horovod's pattern; accumulation.py): backwards
inside `opt.no_sync()` only add into .grad; the one after it carries the sum:

    opt.zero_grad()
    for i, (x, y) in enumerate(micro_batches):          # k of them
        with opt.no_sync() if i < k - 1 else contextlib.nullcontext():
            (loss_fn(model(x), y) / k).backward()
    opt.step()                                          # one all-reduce (ps: one push)

Mixed precision (precision.py): precision="bf16" or "fp16" (loss_scale,
loss_scale_window); the model's parameters stay fp32, the master weights.  Three
lines of the loop change:

    with opt.autocast():               # the forward's matmuls in 16 bit
        loss = loss_fn(model(x), y)
    opt.backward(loss)                 # fp16: backward of the scaled loss
    opt.step()                         # fp16: unscaled, or skipped on an inf / NaN
                                       # (opt.overflow_skips counts those)

precision="fp8" is bf16's loop, and the model's nn.Linear layers are swapped in place
for fp8's (runtime/fp8_linear.py) when the optimizer is built.

Gradient clipping sees averaged gradients after `opt.synchronize()`; `step`
then does not wait again.  Under torchrun there is no MPI: sync="torch", or a
textbook algorithm over torch.distributed (the transport chosen for you).

Parameter servers: psrv.launch decides who serves; ask it first, and let the
server ranks serve until every worker has closed its optimizer.  The servers
run the optimizer (torch's SGD or Adam, psrv/optim.py), so the wrapped one
only describes it: one parameter group, no schedule.

    role = strategies.ps_roles(servers=1)          # collective over COMM_WORLD
    if role.is_server:
        role.serve()                               # returns when the workers are done
    else:
        with strategies.DistributedOptimizer(torch.optim.SGD(...), model, sync="ps",
                                             role=role) as opt:
            ...                                    # shard by opt.rank / opt.size (workers)

No ZeRO here: its stages shard the optimizer state per layer and gather each
layer around its forward (zero.py), with an optimizer they build themselves.
"""
import socket

import torch

import allreduce

from ..config.choices import PS_SYNCS, ConfigError
from ..config.mesh import Mesh
from ..config.optimizer_checks import (check_comm, check_model, check_same_everywhere,
                                       described_optimizer, gathered, keyword_help, sections_of,
                                       transport_for)
from ..config.settings import TrainConfig
from ..config.validate import check_sync_combinations, check_sync_world
from ..runtime.context import ps_role
from ..runtime.fp8_linear import check_device, to_fp8
from ..runtime.precision import of_config
from ..sync.data_parallel import data_parallel, parameter_units
from ..sync.gradient_sync import (broadcast_buffers, collective_for, for_device,
                                  without_momentum)


def ps_roles(servers=1, comm=None, keys_timeout=600.0):
    """psrv.launch's roles over `comm` (default COMM_WORLD): psrv decides who serves (the
    last `servers` ranks), the others train.  Collective over comm.  The servers bind
    once the workers' DistributedOptimizer has cut the model into buckets, and wait
    keys_timeout seconds for that (the time the workers may take to build their model
    and their optimizer).  A server that cannot start raises ConfigError on every rank."""
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    check_comm(comm, "mpi")
    return ps_role(comm, servers, keys_timeout)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (over `model`'s parameters) so that its steps are data parallel.

    A torch.optim.Optimizer for LR schedulers and checkpoints: param_groups and state
    are the wrapped optimizer's own; state_dict is the wrapped optimizer's, plus, under
    "data_parallel", what this rank's sync holds beyond the model and the optimizer (a
    lossy compressor's residuals, warm starts, velocities and step: each rank's own),
    and under "loss_scale" fp16's scale and its counters, so that a resumed loop goes on
    exactly where it stopped.  (The parameters stay fp32 under every precision, the
    master weights: there is no master copy or shard beside them.)  Under ps and hybrid
    the servers hold the parameters and their optimizer state, and checkpoint them; the
    push compressor's state is the workers' and stays in "data_parallel"."""

    def __init__(self, optimizer, model, sync="ring", comm=None, *, transport=None, role=None,
                 **settings):
        # No Optimizer.__init__: the wrapped optimizer owns the parameter groups and state.
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError("the optimizer is a DistributedOptimizer already; wrap the "
                              "plain one")
        params, device = check_model(optimizer, model)
        if isinstance(sync, allreduce.Collective):
            if comm is not None or transport is not None:
                raise ConfigError("sync is a collective already: it has its communicator and "
                                  "transport, so pass neither comm nor transport")
            name, coll = sync.name, sync
        else:
            name, coll = sync, None
        # the keywords are the sections' fields, each checked by its section (keyword names)
        options, precision = sections_of(settings, sync=name)
        if name not in PS_SYNCS and role is not None:
            raise ConfigError(f"role= is for sync='ps' or 'hybrid', not {name!r}", field="role")
        described = described_optimizer(optimizer, name in PS_SYNCS, options.momentum_correction)
        check_sync_combinations(options, precision, described, cli=False)
        if options.momentum_correction:
            without_momentum(optimizer)      # its momentum is the compressor's now
        self.optimizer, self.model, self.options = optimizer, model, options
        self.sections = (options, precision, described)
        # what the syncs read: a TrainConfig of these sections, the same object as the trainer's
        self.config = TrainConfig.of(*self.sections)
        self.precision = of_config(self.config, device.type)
        if self.config.precision == "fp8":  # the user's nn.Linear layers, swapped in place
            check_device(device)
            to_fp8(model)
        # the one data-parallel call of strategies.train too (sync/data_parallel.py), over
        # the model's parameters one by one, as DDP buckets them
        units = parameter_units(model)
        if name in PS_SYNCS:
            comms, coll = self._workers_mesh(role, params), None
            self.rank, self.size = comms.rank, comms.world.size
        elif name == "local":              # one process: the reference the others reproduce
            check_comm(comm, "mpi")
            check_sync_world(options, 1 if comm is None else comm.Get_size(), cli=False)
            self.rank, self.size, comms = 0, 1, None
        else:
            if coll is None:
                transport = transport_for(name, transport)
                check_comm(comm, transport)
                coll = collective_for(name, self.config, comm, transport, device)
            else:                          # a user's collective, staged as ours are
                coll = for_device(coll, device)
            self.rank, self.size, comms = coll.rank, coll.size, None
            check_same_everywhere(lambda mine: gathered(coll, mine), params, self.sections)
        self.sync = data_parallel(units, comms, self.config, device=device, coll=coll,
                                  precision=self.precision if name in PS_SYNCS else None,
                                  role=role, host=socket.gethostname())
        if name != "local":                # rank 0's buffers win, as its parameters did
            broadcast_buffers(coll or collective_for("mpi", self.config, comms.world), model)
        self.sync.setup(model)             # the bucket hooks are attached
        self._step = self.sync.start_step  # > 0 where parameter servers resumed a run
        self._synchronized, self._closed = False, False

    def _workers_mesh(self, role, params):
        """ps / hybrid: the workers as a mesh of data parallelism alone (the servers are
        a role beside it, as in strategies.train)."""
        if role is None:
            raise ConfigError(f"sync={self.options.sync!r} needs role=strategies.ps_roles("
                              "servers=S), made on every rank before the optimizer (the "
                              "server ranks serve instead), or run `python -m "
                              "strategies.train --sync ps`", field="sync")
        if role.is_server:
            raise ConfigError("this rank is a server (role.is_server): call role.serve() "
                              "instead of building an optimizer")
        workers = role.worker_comm
        check_same_everywhere(workers.allgather, params, self.sections)
        return Mesh(workers.size).split(workers)

    # -------------------------------------------------------- the wrapped optimizer
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        """The wrapped optimizer's state_dict, plus "data_parallel": this rank's sync's
        own state where it holds any (module docstring), and "loss_scale": fp16's scale
        and its counters.  Under ps and hybrid the servers hold the parameters and the
        optimizer's state, in their own files: "data_parallel" is then the push
        compressor's state alone (the servers are not asked to checkpoint)."""
        state = self.optimizer.state_dict()
        # per rank: save each rank's, as torch's DCP does
        mine = self.sync.workers_state_dict() if self.options.sync in PS_SYNCS else \
            self.sync.state_dict()
        if mine:
            state["data_parallel"] = mine
        scaling = self.precision.state_dict()
        if scaling:
            state["loss_scale"] = scaling
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        mine = state_dict.pop("data_parallel", {})
        self.precision.load_state_dict(state_dict.pop("loss_scale", {}))
        self.optimizer.load_state_dict(state_dict)
        if mine and self.options.sync in PS_SYNCS:
            self.sync.load_workers_state_dict(mine)
        elif mine:
            self.sync.load_state_dict(mine)

    def add_param_group(self, group):
        raise ConfigError("DistributedOptimizer: parameters added after construction would "
                          "not be synchronised; build the optimizer with all of them")

    def __repr__(self):
        return f"DistributedOptimizer({self.options.sync}, rank {self.rank} of {self.size}, " \
               f"{type(self.optimizer).__name__})"

    # ------------------------------------------------------------ the step
    def zero_grad(self, set_to_none=True):
        """Fresh gradients for the next backward (set to None, as torch's default;
        the sync decides, as parameter servers keep them in buffers of their own)."""
        self._require_open()
        self.sync.before_backward()

    def no_sync(self):
        """A context: backwards inside it add into the local gradients and communicate
        nothing (torch DDP's no_sync); the next backward outside it sends the sum."""
        self._require_open()
        return self.sync.no_sync()

    def synchronize(self):
        """Wait until every rank's gradients of this step are averaged into .grad
        (ps/hybrid: until the servers' new parameters are in the model)."""
        self._require_open()
        if not self._synchronized:
            self.sync.synchronize(self._step)
            self._synchronized = True

    def step(self, closure=None):
        """synchronize(), then the wrapped optimizer's step (ps/hybrid: the servers' step
        is done by then).  A closure runs once, before; LBFGS-style re-evaluation
        inside step is not supported."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr = self.optimizer.param_groups[0]["lr"]
        if self.options.sync in PS_SYNCS and lr != self.config.lr:
            raise ConfigError(f"sync={self.options.sync!r}: the servers run the optimizer with "
                              f"lr={self.config.lr}; a schedule cannot change it to {lr}",
                              field="sync")
        self.synchronize()
        # every rank holds the same averaged gradients, or (ps) the workers vote: all
        # skip the same fp16 steps
        if self.sync.scales_itself:     # the servers' pushes wait for fp16's vote
            self.sync.step(self.optimizer)
        else:
            self.precision.step(self.sync.gradients(), lambda: self.sync.step(self.optimizer),
                                self.sync.agree, self.sync.kept)
        self._synchronized = False
        self._step += 1
        return loss

    def autocast(self):
        """The forward's context: torch.autocast in bf16 / fp16, nothing in fp32."""
        return self.precision.autocast()

    def backward(self, loss):
        """loss.backward(), of the scaled loss under fp16 (the scale: opt.loss_scale)."""
        self._require_open()
        self.precision.backward(loss)

    @property
    def loss_scale(self):
        """fp16: the loss scale now; None otherwise."""
        return self.precision.scaler.scale if self.precision.scaler else None

    @property
    def overflow_skips(self):
        """fp16: how many steps were skipped for an inf or NaN gradient; 0 otherwise."""
        return self.precision.scaler.overflow_skips if self.precision.scaler else 0

    def _require_open(self):
        if self._closed:
            raise RuntimeError("DistributedOptimizer is closed")

    @property
    def bytes_sent(self):
        return self.sync.bytes_sent

    @property
    def bytes_received(self):
        return self.sync.bytes_received

    @property
    def staleness(self):
        return self.sync.staleness

    @property
    def start_step(self):
        """The step this run goes on from: 0, or where parameter servers resumed."""
        return self.sync.start_step

    def close(self):
        """Detach the hooks and stop the communication thread (ps: tell the servers
        this worker is done).  Idempotent."""
        if not self._closed:
            self._closed = True
            self.sync.close()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is not None and not self._closed:
            self.sync.abort(error)        # ps: the servers fail the run instead of waiting
        self.close()


# help(DistributedOptimizer): its keywords, with their meanings, from the sections
DistributedOptimizer.__init__.__doc__ = keyword_help()
