"""Data parallelism through the parameter servers, one bucket at a time (ps, hybrid).

The bucket engine (buckets.py) hands each bucket to a reduction the moment backward
finishes it.  For the all-reduce syncs that reduction is a collective (zero.py); here
it is a round trip to the servers, as BytePS plugs its servers into the framework's
gradient hooks per tensor partition (Jiang et al., "A Unified Architecture for
Accelerating Distributed DNN Training in Heterogeneous GPU/CPU Clusters", OSDI 2020):

    backward finishes bucket i      push its flat gradient under key "pp{p}.tp{t}.b{i}"
                                    pull the key's new value (the servers ran the step)
    synchronize                     wait for the last buckets' round trips
    step                            the pulled values into the bucket's flat parameters

A key names its pipeline stage, its tp rank and its bucket, so every stage's
data-parallel replicas push their own layers and every tp rank its own piece: the
key's group (psrv/store.py) is this rank's replicas, the ranks that hold the same
parameters (the mesh's dp_cp axis: dp, times cp where context parallelism cuts each
replica's sequences, whose ranks push gradients of their own positions' share of the
loss), and BSP waits for it alone, SSP and ASP count staleness per key, as with the
whole model.  An expert's bucket (--ep, expert_parallel.py) is held by its replicas
only, the ranks at the same place of every expert group: its key names that place
too, "pp0.tp0.ep1.b3", and its group is those replicas (the mesh's ep_replicas), whose
average the worker scales by 1 / ep before the push, as the all-reduce syncs do after
theirs.  The servers hold the
parameters and the optimizer state, so there is nothing to shard: ZeRO has no
meaning here (config/validate.py says so).

The hybrid (--sync hybrid): inside a node the replicas all-reduce the bucket (the
ring), the node's leader alone talks to the servers, and broadcasts what it pulled:

    node 0: dp ranks 0 1 ──ring──▶ leader 0 ─┐
                                              ├── push / pull key "pp0.tp0.b3" ── servers
    node 1: dp ranks 2 3 ──ring──▶ leader 2 ─┘
            then each leader broadcasts the key's new values inside its node

so a key's group on the servers is its replicas' leaders.  Nodes must hold equally
many replicas: the servers average over the leaders, the ring over the node, and
the mean of equal-sized means is the mean.  An expert's bucket (--ep) does the same
over its own replicas: its node is the expert's replicas (ep_replicas) among the
node's ranks, which ring-average it and scale it by 1 / ep, and that node's leader
pushes and pulls its key.  One host, dp 4, ep 2:

    dense keys     node {0, 1, 2, 3}   leader 0
    ep0 keys       node {0, 2}         leader 0
    ep1 keys       node {1, 3}         leader 1   (which leads no dense key)

so the servers' workers are every rank that leads some key, numbered in rank order,
and each of them declares only the keys it leads.  Each expert's nodes must hold
equally many of its replicas, for the same reason.

--compress on the wire to the servers, as BytePS compresses its pushes:

    fp16, bf16          each slice cast (psrv/protocol.py's to_wire); under hybrid the
                        node's ring casts too
    fp8, topk, powersgd each slice a push carries (placement.py cuts a key into slices)
                        encoded by the compressor's `encode` (compression/), with error
                        feedback kept on the worker per slice (its key), laid out as
                        psrv/protocol.py says (PushEncoder); the server decodes it into
                        a dense float32 slice and sums and steps as for any push

Under hybrid only the leader compresses, the node's mean, and the ring inside the
node stays dense: its bytes are on the node's fast links, and a lossy all-reduce
would need top-k's all-gather there and a second residual per rank for one push.
The step records' wire_bytes count the payload each push put on the wire
(Handle.pushed_bytes), plus the node ring's.
"""
import zlib

import torch

from ..compression.casts import Compressor
from ..config.choices import ConfigError
from ..config.compress_spec import parse_compress
from ..runtime.context import require_psrv
from ..runtime.precision import any_rank_of
from ..runtime.trace import span
from .buckets import Replicas
from .gradient_sync import build_compressor, make_optimizer
from .zero import ZeRO


def wire_of(cfg):
    """What a push carries: --compress fp16 or bf16 halves it (the servers widen it to
    float32 before they sum and step), else float32."""
    return cfg.compress if cfg.compress in ("fp16", "bf16") else "fp32"


class PushEncoder:
    """A lossy compressor's encoding of each slice a push carries, in psrv/protocol.py's
    layout: Client(encoder=...) calls it with the slice (placement.Slice) and its
    float32 gradient, and it returns (dtype code, param, payload).  The compressor's
    residuals and warm starts are keyed by the slice's key."""

    def __init__(self, kind, compressor, protocol):
        self.kind, self.compressor, self.protocol = kind, compressor, protocol

    def __call__(self, sl, piece):
        P, flat = self.protocol, torch.from_numpy(piece)
        if self.kind == "fp8":
            q, scale = self.compressor.encode(sl.key, flat)
            return P.FP8, 0, P.compressed_payload(P.FP8, q.view(torch.uint8).numpy(),
                                                  scale.item())
        if self.kind == "topk":
            indices, values = self.compressor.encode(sl.key, flat)
            return P.TOPK, 0, P.compressed_payload(P.TOPK, indices.numpy(), values.numpy())
        factors = self.compressor.encode(sl.key, flat, P.matrix_shape(len(piece)))
        if factors is None:           # a slice too small for its factors: dense
            return P.FLOAT32, 0, piece
        return P.POWERSGD, self.compressor.rank, \
            P.compressed_payload(P.POWERSGD, *(f.numpy() for f in factors))


def check_servers_step(start_step, state):
    """On --resume: the servers' shards and the workers' checkpoint must be of one step."""
    if state.get("servers_step") != start_step:
        raise RuntimeError(f"--resume: the servers resumed at step {start_step}, "
                           f"the worker checkpoint is at step {state.get('servers_step')}")


class ServerBuckets(ZeRO):
    """Stage 0 of the bucket engine (every replica holds every parameter of its piece),
    whose reduction is a push and a pull.

    units: [(name, module, [parameters])] of this rank's layers, in forward order;
    comms: the run's mesh.MeshComms (over the workers); role: psrv.launch's Role of
    this worker; collective_for: gradient_sync's, for the replicas or the hybrid's node;
    host: this rank's host name (the hybrid's nodes, without --ranks-per-node)."""
    signal_stop = True           # its waits are ZeroMQ polls and Python-polled MPI

    def __init__(self, units, comms, role, cfg, backwards_per_step, tracer, device,
                 collective_for, host="", precision=None):
        psrv = require_psrv()
        # hybrid: every bucket's replicas become their node's, the dense layers' (dp x cp)
        # and each expert's (ep_replicas) alike; its ring runs over that node
        nodes = hybrid_nodes(cfg, comms, host, collective_for, device, units) \
            if cfg.sync == "hybrid" else None
        if nodes is not None:
            dense, experts = nodes
            units = [(*u[:3], experts if len(u) > 3 and u[3] is not None else dense)
                     for u in units]
        # the replicas start equal (ZeRO broadcasts each bucket over `coll`: the replicas,
        # or the hybrid's node), then take the servers' values.  fp32 parameters under
        # autocast, as the whole model's ps: the servers hold and update fp32
        coll = nodes[0].coll if nodes else \
            collective_for("ring", cfg, comms.dp_cp, device=device)
        # the node's ring: the casts, or dense; a lossy compression is the push's alone
        lossy = parse_compress(cfg.compress).lossy
        super().__init__(0, units, coll, cfg, backwards_per_step, tracer, None,
                         thread_coll=nodes[0].thread_coll if nodes else coll,
                         compressor=Compressor() if lossy else build_compressor(cfg.compress),
                         overlap=cfg.overlap, device=device)
        self.push_compressor = build_compressor(
            cfg.compress, None, cfg.error_feedback, cfg.compressor_momentum,
            cfg.sparsity_warmup) if lossy else None
        self.name, self.nodes, self.comms = cfg.sync, nodes, comms
        self.node_rounds = 0            # the node rings run so far (hybrid)
        # fp16: the buckets wait for step, where the workers vote on an overflow (each
        # stage and tp rank sees its own gradients) and push only where none found one
        self.scaling = precision
        self.deferred = precision is not None and precision.scaler is not None
        self.agree = any_rank_of(comms.world) if self.deferred else None
        # who talks to the servers for a key: under ps every rank for each of its keys,
        # under hybrid the leader of the key's node.  A rank may lead an expert's node
        # and not its dense node (one host, dp 4, ep 2: rank 1 leads expert place 1)
        self.leads = [nodes is None or u.replicas.rank == 0 for u in self.units]
        # every rank learns every group's keys (a control allgather over the workers),
        # so that all number them alike
        prefix = f"pp{comms.pp_rank}.tp{comms.tp_rank}."
        places = [b.replicas.place for b in self.engine.buckets]      # "" or an expert's
        self.keys = [prefix + (f"{place}." if place else "") + f"b{u.index}"
                     for place, u in zip(places, self.units)]
        mine = {k: (u.numel,) for k, u, leads in zip(self.keys, self.units, self.leads)
                if leads}
        shapes = {k: s for part in comms.world.allgather(mine) for k, s in part.items()}
        # the servers bind now, each with a receive queue of one step's messages of a
        # worker, counted from these keys (psrv.launch.KeysFirst): every worker declares
        role.declare(shapes, cfg.timeout)
        # the servers' workers are the ranks that lead some key, numbered in rank order
        leading = nodes is None or any(self.leads)
        leaders = [r for r, leads in enumerate(comms.world.allgather(leading)) if leads]
        worker_id = {r: i for i, r in enumerate(leaders)}
        # a key's group: the leaders among its replicas, dp x cp for a dense key, the
        # expert's (ep_replicas) for an expert's; under ps every replica (every rank
        # asks, on both axes: collective)
        dense, experts = nodes or (None, None)
        groups = {place: [worker_id[r] for r, leads in axis.allgather(
                              (comms.rank, nodes is None or node is not None and node.rank == 0))
                          if leads]
                  for place, axis, node in (("", comms.dp_cp, dense),
                                            ("experts", comms.ep_replicas, experts))}
        self.host = {k: u.full.detach().cpu().clone() for k, u in zip(self.keys, self.units)}
        self.client = None
        start = 0
        if leading:
            self.client = psrv.Client(
                endpoints=role.endpoints, worker_id=worker_id[comms.rank],
                num_workers=len(leaders),
                timeout=cfg.timeout, keys=role.keys,
                consistency=psrv.Consistency(mode=cfg.consistency, staleness=cfg.staleness),
                wire=wire_of(cfg), encoder=PushEncoder(
                    parse_compress(cfg.compress).kind, self.push_compressor,
                    psrv.protocol) if lossy else None)
            # --momentum-correction: top-k keeps the velocity on the worker, so the
            # servers' SGD runs without momentum (as make_optimizer's torch one does)
            optimizer = psrv.OptimizerConfig(
                name=cfg.optimizer, lr=cfg.lr, betas=(0.9, 0.999),
                momentum=0.0 if cfg.momentum_correction else cfg.momentum,
                eps=1e-8, weight_decay=cfg.weight_decay)
            # the group's first rank brings the values; after --resume, the servers' own.
            # One init a group whose keys this rank leads, the dense layers' first, in
            # the same order on every rank.  A shard knows a group by its workers, so
            # the dense and the experts' keys of one set of leaders (one host: rank 0
            # leads both) are one group, declared in one init
            values = {tuple(sorted(groups[kind])): {} for kind in ("", "experts")}
            for place, (k, t), leads in zip(places, self.host.items(), self.leads):
                if leads:
                    values[tuple(sorted(groups["experts" if place else ""]))][k] = t.numpy()
            start = min(self.client.init(mine, optimizer, group=group, shapes=shapes)
                        for group, mine in values.items() if mine)
        if nodes is not None:         # each node starts from its leader's values and step
            step = torch.tensor([start], dtype=torch.float64)
            nodes[0].coll.broadcast(step, root=0)
            start = int(step[0])
            for t, u in zip(self.host.values(), self.units):
                u.replicas.coll.broadcast(t, root=0)
        self.start_step = self.next_step = start
        if self.push_compressor is not None:      # top-k's warm-up goes by the step
            self.push_compressor.set_step(start)
        self.pending = {}
        self._install()

    def make_optimizer(self, model=None):
        """The servers step; the torch optimizer is held for the checkpoint's format only."""
        return make_optimizer(self.cfg, [p for u in self.units for p in u.params])

    # ---------------------------------------------- a bucket's reduction
    def _reduce_bucket(self, bucket, flat):
        """On the comm thread: the bucket's gradient to the servers, its values back.
        Returns the bytes this rank sent."""
        sent = 0
        if self.node_ring(bucket.replicas):   # through the compressor, as every all-reduce
            name = self.units[bucket.index].name       # sync; an expert's scaled by 1 / ep
            with span(self.tracer, f"all-reduce grads {name} (node)", self.category):
                sent += self._allreduce_avg(bucket, flat)
            self.node_rounds += 1
        elif bucket.replicas.scale != 1.0:              # an expert's: 1 / ep
            flat.mul_(bucket.replicas.scale)
        if self.deferred:           # fp16: pushed by step, after the vote
            self.pending[bucket.index] = flat
            return sent
        return sent + self._push(bucket.index, flat)

    def _push(self, index, flat):
        """One bucket's round trip (the leader's) and its values to the node; its bytes."""
        key, sent, replicas = self.keys[index], 0, self.units[index].replicas
        if self.leads[index]:
            grad = flat.detach().cpu().float().numpy()
            with span(self.tracer, f"push/pull {key}", self.category):
                handle = self.client.push_pull({key: grad}, {key: self.host[key].numpy()},
                                               self.next_step)
                handle.wait()
            sent += handle.pushed_bytes          # the gradient as it went on the wire
        if self.node_ring(replicas):
            replicas.thread_coll.broadcast(self.host[key], root=0)
        return sent

    def node_ring(self, replicas):
        """Whether a bucket's node holds several replicas, which reduce before the push
        (hybrid)."""
        return self.nodes is not None and replicas.size > 1

    def synchronize(self, step):
        super().synchronize(step)
        if self.push_compressor is not None:
            self.push_compressor.set_step(step + 1)
        if not self.deferred:
            self.next_step += 1

    @property
    def kept_ratio(self):
        return self.push_compressor.kept_ratio if self.push_compressor else None

    def before_backward(self):
        self.pending = {}
        super().before_backward()

    def gradients(self):
        return []                  # the servers updated: no gradient is left to check

    @property
    def scales_itself(self):
        """The servers step: fp16's vote and unscaling come before the pushes, in step."""
        return True

    def step(self, optimizer):
        """The pulled values into the buckets' flat parameters: the one change of the
        model in a step, as the contract says (gradient_sync.py).  fp16: first the vote
        and the unscaling (precision.py), then the pushes, or neither where any worker
        found an overflow: the servers never see the skipped step."""
        if self.deferred:
            order = sorted(self.pending)

            def push():
                self.engine.wire_bytes += sum(self._push(i, self.pending[i]) for i in order)
            if not self.scaling.step([self.pending[i] for i in order], push, self.agree):
                return
            self.next_step += 1
        self._install()

    def _install(self):
        with torch.no_grad():
            for k, u in zip(self.keys, self.units):
                u.full.copy_(self.host[k], non_blocking=True)

    # ------------------------------------------------------ what it holds
    @property
    def comm_rounds(self):
        """A bucket's round trip to the servers, and before it the node's all-reduce
        where the node holds several replicas (hybrid)."""
        return self.engine.reductions + self.node_rounds if self.units else 0

    def _node_transports(self):
        """The nodes' collectives' transports (the main thread's and the comm thread's)."""
        if self.nodes is None:
            return []
        colls = []
        for node in (n for n in self.nodes if n is not None):
            for c in (node.coll, node.thread_coll):
                if all(c is not o for o in colls):
                    colls.append(c)
        return [c.transport for c in colls]

    @property
    def bytes_sent(self):
        return (self.client.bytes_sent if self.client else 0) + \
            sum(t.bytes_sent for t in self._node_transports())

    @property
    def bytes_received(self):
        return (self.client.bytes_received if self.client else 0) + \
            sum(t.bytes_received for t in self._node_transports())

    @property
    def staleness(self):
        log = self.client.staleness_log if self.client else []
        return log[-1] if log else None

    def state_dict(self):
        """The servers write their shards (under --checkpoint-dir/ps) when the first
        worker asks; the rank files keep the step they are at, for the check on resume,
        and the push compressor's state (its residuals and warm starts per slice, which
        the servers never see)."""
        if self.comms.rank == 0:
            self.client.checkpoint(self.next_step)
        return {"servers_step": self.next_step, **self.workers_state_dict()}

    def load_state_dict(self, state):
        check_servers_step(self.start_step, state)
        self.load_workers_state_dict(state)

    def workers_state_dict(self):
        """What this worker holds that the servers never see, without asking them to
        checkpoint (DistributedOptimizer's state_dict, whose user saves the servers' part
        their own way): the push compressor's state, or {}."""
        if self.push_compressor is None:
            return {}
        return {"compressor": self.push_compressor.state_dict()}

    def load_workers_state_dict(self, state):
        if self.push_compressor is not None:   # loaded on the host, where pushes encode
            self.push_compressor.load_state_dict(state["compressor"])

    def abort(self, error):
        if self.client is not None:
            self.client.close(error=f"{type(error).__name__}: {error}")

    def close(self):
        super().close()
        if self.client is not None:
            self.client.close()


class NodeOfReplicas(Replicas):
    """The hybrid's node of one set of replicas (the dp x cp replicas, or an expert's,
    ep_replicas): those of them on this rank's node, a ring over them, and another for
    the comm thread.  Its rank 0 leads: it alone pushes and pulls, and broadcasts the
    values it pulled over the node.

    replicas: the communicator of the whole set; node_id: this rank's node
    (hybrid_nodes);
    what: how an error names the set."""

    def __init__(self, cfg, replicas, node_id, collective_for, device, scale=1.0, place="",
                 what="replicas"):
        comm = replicas.Split(node_id % (2**31), replicas.rank)
        sizes = replicas.allgather(comm.size)
        # the servers average over the leaders, the ring over the node: the mean of
        # equal-sized means is the mean, of unequal ones it is not
        if len(set(sizes)) != 1:
            raise ConfigError(f"--sync hybrid needs equally many {what} per node, got "
                              f"node sizes {sorted(set(sizes))} (use --ranks-per-node)",
                              field="sync")
        super().__init__(collective_for("ring", cfg, comm, device=device),
                         collective_for("ring", cfg, comm.Dup(), device=device)
                         if cfg.overlap else None, scale, place)


def hybrid_nodes(cfg, comms, host, collective_for, device, units):
    """(the dense layers' node, the experts' node or None) of this rank under hybrid.  A
    node is this rank's host, or --ranks-per-node consecutive dp x cp replicas: the node
    id is computed once and each set of replicas is split by it, so an expert's node is
    its replicas (ep_replicas) among the node's ranks (one host at dp 4, ep 2: {0, 2}
    and {1, 3}), whose scale (1 / ep) and place in the expert group carry over from
    the experts' Replicas (engine/parallelize.py's expert_replicas)."""
    per = cfg.ranks_per_node
    node_id = comms.dp_cp.rank // per if per else zlib.crc32(host.encode())
    dense = NodeOfReplicas(cfg, comms.dp_cp, node_id, collective_for, device)
    experts = next((u[3] for u in units if len(u) > 3 and u[3] is not None), None)
    if experts is not None:
        experts = NodeOfReplicas(cfg, comms.ep_replicas, node_id, collective_for, device,
                                 experts.scale, experts.place, "replicas of each expert")
    return dense, experts
