"""The parameter-server syncs of the GradientSync contract (sync/gradient_sync.py): ps and hybrid.

The servers (psrv/) hold the parameters and the optimizer state; a worker
pushes its gradients and pulls fresh parameters (`push_pull`).  Under BSP the
servers wait for all W workers of a step, average their gradients and apply
torch-identical SGD/Adam, so the result is the one-process step again; under
SSP/ASP a worker may run ahead on stale parameters (psrv records the staleness).

Against the contract: `synchronize` is the round trip (gradients out, the
servers' new parameters back into buffers of the sync's own), `step` puts
those parameters into the model.  So the model changes in `step` only, as with
an all-reduce and a local optimizer, and whatever runs between the two (a
gradient clip, a look at the parameters) sees the same state under every sync.
"""
import zlib

import numpy as np
import torch

from ..config.choices import ConfigError
from ..runtime.context import require_psrv
from .gradient_sync import GradientSync, collective_for
from .zero import AllReduceSync


def check_servers_step(start_step, state):
    """On --resume: the servers' shards and the workers' checkpoint must be of one step."""
    if state.get("servers_step") != start_step:
        raise RuntimeError(f"--resume: the servers resumed at step {start_step}, "
                           f"the worker checkpoint is at step {state.get('servers_step')}")


def deferred_push(cfg, ctx):
    """(whether the push waits for step, the vote over the workers) under fp16's loss
    scaling: each worker holds its own gradients until the push, so they vote."""
    if cfg.precision != "fp16":
        return False, None
    from ..runtime.precision import any_rank_of
    return True, any_rank_of(ctx.dp_comm)


def wire_of(cfg):
    """What a push carries: --compress fp16 or bf16 halves it (the servers widen it to
    float32 before they sum and step), else float32."""
    return cfg.compress if cfg.compress in ("fp16", "bf16") else "fp32"


class PSSync(GradientSync):
    """Workers push gradients and pull parameters; no optimizer on the worker.

    Not overlapped with backward: the push starts after backward (the client's
    push_pull is itself asynchronous, but the next forward needs its result).
    bind_grads: autograd accumulates straight into the buffers the client sends
    from (CPU); off where another sync owns .grad (HybridSync's buckets).
    """
    name = "ps"
    signal_stop = True           # its waits are ZeroMQ polls, which run signal handlers

    def __init__(self, cfg, ctx, device, worker_id=None, num_workers=None, bind_grads=True):
        super().__init__(cfg, ctx, device)
        psrv = require_psrv()
        # fp16: the push waits for the workers' vote on an overflow (precision.step calls
        # `step` only where no worker found one), so a skipped step is skipped by all of
        # them and never reaches the servers; the pushed gradients are unscaled by then
        self.deferred, self.agree = deferred_push(cfg, ctx)
        role = ctx.role
        self.bind_grads = bind_grads and device.type == "cpu"
        self.client = psrv.Client(
            endpoints=role.endpoints,
            worker_id=role.worker_id if worker_id is None else worker_id,
            num_workers=ctx.dp_size if num_workers is None else num_workers,
            timeout=cfg.timeout,
            consistency=psrv.Consistency(mode=cfg.consistency, staleness=cfg.staleness),
            keys=role.keys,             # CURVE keys when the servers listen off loopback
            wire=wire_of(cfg))
        self.optimizer_config = psrv.OptimizerConfig(
            name=cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum, betas=(0.9, 0.999),
            eps=1e-8, weight_decay=cfg.weight_decay)

    def setup(self, model):
        super().setup(model)
        self.named = dict(model.named_parameters())
        # Host buffers the client reads gradients from and writes parameters into
        # (pinned on a GPU), with numpy views of them;
        # host_params: the servers' parameters for the next step, filled by
        # synchronize and put into the model by step.
        pin = self.device.type == "cuda"
        self.host_params = {n: torch.empty(p.shape, pin_memory=pin) for n, p in self.named.items()}
        self.host_grads = {n: torch.zeros(p.shape, pin_memory=pin) for n, p in self.named.items()}
        for n, p in self.named.items():
            self.host_params[n].copy_(p.data)
            if self.bind_grads:
                p.grad = self.host_grads[n]         # autograd adds into it in place
        self.params_np = {n: t.numpy() for n, t in self.host_params.items()}
        self.grads_np = {n: t.numpy() for n, t in self.host_grads.items()}
        # worker 0's values win; after --resume the servers' saved ones, at start_step
        self.start_step = self.next_step = self.client.init(self.params_np, self.optimizer_config)
        self.wire_bytes = self.dense_bytes = 0    # gradient bytes pushed, and as float32
        self._install()

    def before_backward(self):
        for n, p in self.named.items():
            if self.bind_grads:
                if p.grad is None or p.grad.data_ptr() != self.host_grads[n].data_ptr():
                    p.grad = self.host_grads[n]
                p.grad.zero_()
            else:
                p.grad = None

    def synchronize(self, step):
        if not self.deferred:
            self.push()

    def push(self):
        """The gradients to the servers as their next step (`next_step`: the pushes so
        far, which a skipped fp16 step does not count), their new parameters back."""
        for n, p in self.named.items():             # gradients not in our buffer: copy
            if p.grad is not None and p.grad.data_ptr() != self.host_grads[n].data_ptr():
                self.host_grads[n].copy_(p.grad)
        self.client.push_pull(self.grads_np, self.params_np, self.next_step).wait()
        self.comm_rounds += 1
        dense = 4 * sum(g.size for g in self.grads_np.values())
        self.dense_bytes += dense
        self.wire_bytes += dense // 2 if self.client.wire else dense     # 16-bit frames
        self.next_step += 1

    def step(self, optimizer):
        if self.deferred:
            self.push()
        self._install()

    def _install(self):
        """The parameters the servers sent, into the model."""
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
        log = self.client.staleness_log
        return log[-1] if log else None

    def state_dict(self):
        """The servers hold parameters and optimizer state and write their own shards
        (under --checkpoint-dir/ps): worker 0 asks them for their parts of the checkpoint
        set of this step (every worker is at it: checkpoint.save).  The checkpoint keeps
        the step the servers' shards are at, for the check on resuming."""
        if self.ctx.dp_rank == 0:
            self.client.checkpoint(self.next_step)
        return {"servers_step": self.next_step}

    def load_state_dict(self, state):
        check_servers_step(self.start_step, state)

    def abort(self, error):
        """Close as a crash: the servers get ABORT with the error, not BYE, so that under
        BSP/SSP they fail the run on every worker instead of going on without this one."""
        self.client.close(error=f"{type(error).__name__}: {error}")

    def close(self):
        self.client.close()


class HybridSync(GradientSync):
    """All-reduce inside a node, parameter servers between the node leaders.

        node 0: workers 0 1 ──ring──▶ leader 0 ─┐
                                                ├── push grads / pull params ── servers
        node 1: workers 2 3 ──ring──▶ leader 2 ─┘
        then each leader broadcasts the new parameters inside its node.

    The servers average over the leaders, so nodes must hold equally many
    workers for that to be the mean over all workers.  It is made of two syncs
    and calls only their contract: an AllReduceSync over the node and, on a
    leader, a PSSync that reads the node's averaged gradients from .grad (and
    whose pulled parameters, its host_params, the leader broadcasts, still in
    synchronize, so that all the communication is there and the update in step).
    """
    name = "hybrid"
    # Its waits run signal handlers too: the leaders' ZeroMQ polls, and the node's
    # ring over MPI, which polls its requests from Python (on the comm thread, while
    # the main thread waits on a lock, which handlers interrupt)
    signal_stop = True

    def __init__(self, cfg, ctx, device):
        super().__init__(cfg, ctx, device)
        comm = ctx.dp_comm
        per = cfg.ranks_per_node
        node_id = comm.rank // per if per else zlib.crc32(ctx.host.encode())
        self.node = comm.Split(node_id % (2**31), comm.rank)
        self.is_leader = self.node.rank == 0
        leaders = comm.Split(0 if self.is_leader else 1, comm.rank)
        sizes = comm.allgather(self.node.size)
        if len(set(sizes)) != 1:
            raise ConfigError(f"--sync hybrid needs equally many workers per node, got node "
                              f"sizes {sorted(set(sizes))} (use --ranks-per-node)", field="sync")
        nodes = comm.size // self.node.size
        # One collective for the node, its buckets and its broadcasts alike; on a GPU
        # AllReduceSync stages it through pinned host memory (allreduce.host_staged:
        # the ring's MPI transport is not CUDA-aware), on a CPU it is the ring itself.
        self.inside = AllReduceSync(cfg, ctx, device, collective_for("ring", cfg, self.node))
        self.node_coll = self.inside.coll
        self.ps = PSSync(cfg, ctx, device, worker_id=leaders.rank, num_workers=nodes,
                         bind_grads=False) if self.is_leader else None
        self.deferred, self.agree = deferred_push(cfg, ctx)

    def setup(self, model):
        super().setup(model)
        self.inside.setup(model)                    # p.grad become views of its buckets
        if self.ps is not None:
            self.ps.setup(model)
        # Every worker of a node starts from its leader's parameters and step: the
        # servers' saved ones after --resume (without it, the same values anyway).
        with torch.no_grad():
            for p in model.parameters():
                self.node_coll.broadcast(p.data, root=0)
        step = np.array([self.ps.start_step if self.ps is not None else 0], dtype=np.int64)
        self.node_coll.broadcast(step, root=0)
        self.start_step = self.next_step = int(step[0])
        # where the new parameters arrive before step: the leader's servers' buffers,
        # a copy of its own on every other worker of the node
        names = [n for n, _ in model.named_parameters()]
        self.incoming = [self.ps.host_params[n] for n in names] if self.ps is not None else \
            [torch.empty(p.shape) for p in model.parameters()]

    def before_backward(self):
        self.inside.before_backward()

    def no_sync(self):
        return self.inside.no_sync()                # the leader pushes once, after the last

    @property
    def comm_rounds(self):
        return self.inside.comm_rounds + (self.ps.comm_rounds if self.ps else 0)

    def synchronize(self, step):
        self.inside.synchronize(step)               # gradients averaged over the node
        if not self.deferred:
            self.push()

    def push(self):
        if self.ps is not None:
            self.ps.push()                          # ... and over the nodes, by the servers
        for t in self.incoming:                     # the servers' answer, to the node
            self.node_coll.broadcast(t, root=0)
        self.next_step += 1

    def step(self, optimizer):
        if self.deferred:                           # fp16: after the workers' vote
            self.push()
        with torch.no_grad():
            for p, new in zip(self.model.parameters(), self.incoming):
                p.copy_(new, non_blocking=True)

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

    @property
    def wire_bytes(self):
        return self.inside.wire_bytes + (self.ps.wire_bytes if self.ps else 0)

    @property
    def dense_bytes(self):
        return self.inside.dense_bytes + (self.ps.dense_bytes if self.ps else 0)

    def state_dict(self):
        if self.ps is not None:
            self.ps.state_dict()                    # the leaders' servers save their shards
        return {"servers_step": self.next_step}

    def load_state_dict(self, state):
        check_servers_step(self.start_step, state)

    def abort(self, error):
        """A crash: the leader tells the servers (PSSync.abort); close() still follows."""
        if self.ps is not None:
            self.ps.abort(error)

    def close(self):
        self.inside.close()
        if self.ps is not None:
            self.ps.close()
