"""GradientSync: the one interface between the training loop and every synchronisation.

    sync = make_sync(cfg, ctx, device)
    sync.setup(model)                  # replicas start equal; hooks attached
    optimizer = sync.make_optimizer(model)   # None where the servers apply the update
    each step:
        sync.before_backward()         # fresh (zero) gradients
        loss.backward()                # all-reduce syncs may already communicate here
        sync.synchronize(step)         # afterwards every replica has the same gradients
        sync.step(optimizer)           # ... or, for ps, the same new parameters
    sync.bytes_sent, sync.bytes_received, sync.staleness
    sync.close()

Implementations:
  LocalSync       one process, nothing to do: the reference the others must reproduce.
  AllReduceSync   ring, tree, halving_doubling, hierarchical, mpi, torch (allreduce/),
                  through GradBuckets: bucketed, overlapped with backward.
  PSSync          parameter servers (psrv/): push gradients, pull parameters; the
                  servers average the workers' gradients and run the optimizer.
  HybridSync      all-reduce inside a node, then the node leaders talk to the
                  servers and broadcast the new parameters inside their node.

Every data-parallel rank computes the mean loss over its B/P samples, and the
syncs average over P ranks, so the update is the one of the mean over all B
samples: exactly one process's update, up to the order of float additions.
The model, the optimizer and the sync are separate objects on purpose, so that
ZeRO (a sync that owns sharded optimizer state) and pipeline/tensor parallelism
(a model split over a grid axis, with the sync on the dp axis) can plug in.
"""
import os
import socket
import zlib

import torch

import allreduce

from .buckets import GradBuckets
from .compress import make_compressor
from .config import ALLREDUCE_SYNCS, ConfigError
from .context import require_psrv


def make_optimizer(cfg, params):
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class GradientSync:
    name = "?"
    staleness = None

    def __init__(self, cfg, ctx, device):
        self.cfg, self.ctx, self.device = cfg, ctx, device

    def setup(self, model):
        self.model = model

    def make_optimizer(self, model):
        return make_optimizer(self.cfg, model.parameters())

    def before_backward(self):
        for p in self.model.parameters():
            p.grad = None

    def synchronize(self, step):
        pass

    def step(self, optimizer):
        optimizer.step()

    bytes_sent = bytes_received = 0

    def close(self):
        pass


class LocalSync(GradientSync):
    name = "local"


def collective_for(name, cfg, comm):
    """An allreduce/ collective over `comm` (None: COMM_WORLD, or torchrun's world)."""
    options = {}
    if name == "hierarchical" and cfg.ranks_per_node:
        options["ranks_per_node"] = cfg.ranks_per_node
    if cfg.device == "cuda":
        os.environ["TOPOLAB_DEVICE"] = "cuda"     # the torch transport then picks NCCL
    return allreduce.create(name, comm=comm, timeout=cfg.timeout, **options)


class AllReduceSync(GradientSync):
    def __init__(self, cfg, ctx, device, coll=None):
        super().__init__(cfg, ctx, device)
        self.name = cfg.sync
        self.coll = coll or collective_for(cfg.sync, cfg, ctx.dp_comm)

    def setup(self, model):
        super().setup(model)
        with torch.no_grad():                       # DDP does the same: rank 0's weights win
            for p in model.parameters():
                self.coll.broadcast(p.data, root=0)
        # The torch transport moves CUDA tensors itself (NCCL); the MPI ones stage via the host.
        stage = self.device.type == "cuda" and self.cfg.sync != "torch"
        self.buckets = GradBuckets(list(model.parameters()),
                                   lambda flat: self.coll.allreduce(flat, op="avg"),
                                   int(self.cfg.bucket_mb * 2**20),
                                   make_compressor(self.cfg.compress), self.cfg.overlap, stage)

    def before_backward(self):
        self.buckets.zero_()

    def synchronize(self, step):
        self.buckets.wait()

    @property
    def bytes_sent(self):
        return self.coll.transport.bytes_sent

    @property
    def bytes_received(self):
        return self.coll.transport.bytes_received

    def close(self):
        self.buckets.close()


class PSSync(GradientSync):
    """Workers push gradients and pull parameters; no optimizer on the worker.

    Not overlapped with backward: the push starts after backward (the client's
    push_pull is itself asynchronous, but the next forward needs its result).
    """
    name = "ps"

    def __init__(self, cfg, ctx, device, worker_id=None, num_workers=None):
        super().__init__(cfg, ctx, device)
        psrv = require_psrv()
        role = ctx.role
        self.client = psrv.Client(
            endpoints=role.endpoints,
            worker_id=role.worker_id if worker_id is None else worker_id,
            num_workers=ctx.dp_size if num_workers is None else num_workers,
            timeout=cfg.timeout,
            consistency=psrv.Consistency(mode=cfg.consistency, staleness=cfg.staleness))
        self.optimizer_config = psrv.OptimizerConfig(
            name=cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum, betas=(0.9, 0.999),
            eps=1e-8, weight_decay=cfg.weight_decay)

    def setup(self, model, bind_grads=True):
        super().setup(model)
        self.named = dict(model.named_parameters())
        # numpy views the client reads gradients from and writes parameters into;
        # on a GPU they are pinned host copies (UNVERIFIED: no GPU here).
        cuda = self.device.type == "cuda"
        self.host_params = {n: (torch.empty(p.shape, pin_memory=True) if cuda else p.data)
                            for n, p in self.named.items()}
        self.host_grads = {n: torch.zeros(p.shape, pin_memory=cuda) for n, p in self.named.items()}
        for n, p in self.named.items():
            self.host_params[n].copy_(p.data)
            if bind_grads and not cuda:
                p.grad = self.host_grads[n]         # autograd adds into it in place
        self.params_np = {n: t.numpy() for n, t in self.host_params.items()}
        self.grads_np = {n: t.numpy() for n, t in self.host_grads.items()}
        self.client.init(self.params_np, self.optimizer_config)   # worker 0's values win
        if cuda:
            self.step(None)

    def make_optimizer(self, model):
        return None

    def before_backward(self):
        for n, p in self.named.items():
            if p.grad is None or p.grad.data_ptr() != self.host_grads[n].data_ptr():
                p.grad = self.host_grads[n] if self.device.type == "cpu" else None
            if p.grad is not None:
                p.grad.zero_()

    def synchronize(self, step):
        for n, p in self.named.items():             # gradients not in our buffer: copy
            if p.grad is not None and p.grad.data_ptr() != self.host_grads[n].data_ptr():
                self.host_grads[n].copy_(p.grad)
        self.client.push_pull(self.grads_np, self.params_np, step).wait()

    def step(self, optimizer):
        if self.device.type == "cuda":
            with torch.no_grad():
                for n, p in self.named.items():
                    p.copy_(self.host_params[n], non_blocking=True)

    @property
    def bytes_sent(self):
        return self.client.bytes_sent

    @property
    def bytes_received(self):
        return self.client.bytes_received

    @property
    def staleness(self):
        log = getattr(self.client, "staleness_log", None)
        return log[-1] if log else None

    def close(self):
        self.client.close()


class HybridSync(GradientSync):
    """All-reduce inside a node, parameter servers between the node leaders.

        node 0: workers 0 1 ──ring──▶ leader 0 ─┐
                                                ├── push grads / pull params ── servers
        node 1: workers 2 3 ──ring──▶ leader 2 ─┘
        then each leader broadcasts the new parameters inside its node.

    The servers average over the leaders, so nodes must hold equally many
    workers for that to be the mean over all workers.
    """
    name = "hybrid"

    def __init__(self, cfg, ctx, device):
        super().__init__(cfg, ctx, device)
        comm = ctx.dp_comm
        per = cfg.ranks_per_node
        node_id = comm.rank // per if per else zlib.crc32(socket.gethostname().encode())
        self.node = comm.Split(node_id % (2**31), comm.rank)
        self.is_leader = self.node.rank == 0
        leaders = comm.Split(0 if self.is_leader else 1, comm.rank)
        sizes = comm.allgather(self.node.size)
        if len(set(sizes)) != 1:
            raise ConfigError(f"--sync hybrid needs equally many workers per node, got node "
                              f"sizes {sorted(set(sizes))} (use --ranks-per-node)")
        nodes = comm.size // self.node.size
        self.node_coll = collective_for("ring", cfg, self.node)
        self.ps = PSSync(cfg, ctx, device, worker_id=leaders.rank, num_workers=nodes) \
            if self.is_leader else None

    def setup(self, model):
        super().setup(model)
        self.allreduce_part = AllReduceSync(self.cfg, self.ctx, self.device, self.node_coll)
        self.allreduce_part.setup(model)             # p.grad become views of its buckets
        if self.ps is not None:
            self.ps.setup(model, bind_grads=False)

    def make_optimizer(self, model):
        return None

    def before_backward(self):
        self.allreduce_part.before_backward()

    def synchronize(self, step):
        self.allreduce_part.synchronize(step)      # gradients averaged over the node
        if self.ps is not None:
            for n, p in self.ps.named.items():
                self.ps.host_grads[n].copy_(p.grad)
            self.ps.client.push_pull(self.ps.grads_np, self.ps.params_np, step).wait()
            self.ps.step(None)
        with torch.no_grad():
            for p in self.model.parameters():
                self.node_coll.broadcast(p.data, root=0)

    def step(self, optimizer):
        pass

    @property
    def bytes_sent(self):
        return self.node_coll.transport.bytes_sent + (self.ps.bytes_sent if self.ps else 0)

    @property
    def bytes_received(self):
        return self.node_coll.transport.bytes_received + \
            (self.ps.bytes_received if self.ps else 0)

    @property
    def staleness(self):
        return self.ps.staleness if self.ps else None

    def close(self):
        self.allreduce_part.close()
        if self.ps is not None:
            self.ps.close()


def make_sync(cfg, ctx, device):
    if cfg.sync == "local":
        return LocalSync(cfg, ctx, device)
    if cfg.sync in ALLREDUCE_SYNCS:
        return AllReduceSync(cfg, ctx, device)
    if cfg.sync == "ps":
        return PSSync(cfg, ctx, device)
    if cfg.sync == "hybrid":
        return HybridSync(cfg, ctx, device)
    raise ConfigError(f"unknown --sync {cfg.sync!r}")

