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
                  (both in ps_sync.py)

Every data-parallel rank computes the mean loss over its B/P samples, and the
syncs average over P ranks, so the update is the one of the mean over all B
samples: exactly one process's update, up to the order of float additions.
The model, the optimizer and the sync are separate objects on purpose, so that
ZeRO (a sync that owns sharded optimizer state) and pipeline/tensor parallelism
(a model split over a grid axis, with the sync on the dp axis) can plug in.
"""

import torch

import allreduce

from .buckets import GradBuckets
from .compress import make_compressor
from .config import ALLREDUCE_SYNCS, EMULATED_SYNCS, ConfigError


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
    if name in EMULATED_SYNCS:                     # a slower network, if asked for
        options.update(link_latency_us=cfg.link_latency_us, link_gbps=cfg.link_gbps or None)
    return allreduce.create(name, comm=comm, timeout=cfg.timeout, **options)


class AllReduceSync(GradientSync):
    def __init__(self, cfg, ctx, device, coll=None):
        super().__init__(cfg, ctx, device)
        self.name = cfg.sync
        coll = coll or collective_for(cfg.sync, cfg, ctx.dp_comm)
        # On a GPU every collective of this sync (the broadcast of setup, the
        # buckets) goes through one staging: NCCL moves CUDA tensors itself, the
        # MPI transports (not CUDA-aware) get them through pinned host memory.
        self.coll = allreduce.host_staged(coll) if device.type == "cuda" else coll

    def setup(self, model):
        super().setup(model)
        with torch.no_grad():                       # DDP does the same: rank 0's weights win
            for p in model.parameters():
                self.coll.broadcast(p.data, root=0)
        self.buckets = GradBuckets(list(model.parameters()),
                                   lambda flat: self.coll.allreduce(flat, op="avg"),
                                   int(self.cfg.bucket_mb * 2**20),
                                   make_compressor(self.cfg.compress), self.cfg.overlap)

    def before_backward(self):
        self.buckets.zero_()

    def synchronize(self, step):
        self.buckets.wait()

    # None for the mpi and torch baselines: their libraries' traffic is not observable
    @property
    def bytes_sent(self):
        return self.coll.transport.bytes_sent if self.coll.counts_traffic else None

    @property
    def bytes_received(self):
        return self.coll.transport.bytes_received if self.coll.counts_traffic else None

    def close(self):
        self.buckets.close()


def make_sync(cfg, ctx, device):
    if cfg.sync == "local":
        return LocalSync(cfg, ctx, device)
    if cfg.sync in ALLREDUCE_SYNCS:
        return AllReduceSync(cfg, ctx, device)
    if cfg.sync in ("ps", "hybrid"):
        from .ps_sync import HybridSync, PSSync
        return (PSSync if cfg.sync == "ps" else HybridSync)(cfg, ctx, device)
    raise ConfigError(f"unknown --sync {cfg.sync!r}")

