"""The step engine of --ep: expert parallelism (parallel/expert_parallel.py) for the
MoE blocks, ZeRO's layers (parallel/zero.py) for the data parallelism of the dense
parameters and of each expert's replicas, one step of the loop (engine/loop.py).
"""
from ..model.models import count_parameters
from ..model.moe import MoE
from ..parallel.expert_parallel import AllToAllExperts, ExpertPlacement, shard_experts, units_of
from ..runtime.precision import any_rank_of, of_config
from ..sync.gradient_sync import build_compressor, collective_for, total
from ..sync.zero import ZeRO, Replicas
from .loop import StepEngine, one_step


class ExpertParallel(StepEngine):
    """The step engine of --ep (loop.py's interface): data parallel for the dense
    parameters, experts split over each expert group."""

    def __init__(self, cfg, ctx, device, data, model):
        super().__init__(cfg, ctx, device, data, model)
        self.layout["ep_size"] = cfg.ep
        self.parameters = count_parameters(model)          # the whole model, every expert
        comms = ctx.mesh
        self.placement = ExpertPlacement(comms.mesh, cfg.experts, ctx.rank)
        lay = self.placement
        # the mesh's expert groups: the all-to-alls never meet the comm thread's collectives
        group_comm = comms.ep                                       # {0, 1}, {2, 3}
        self.exchange = AllToAllExperts(collective_for(cfg.sync, cfg, group_comm), lay,
                                        self.tracer)
        self.expert_params = shard_experts(model, lay, self.exchange)
        # the data parallelism of both kinds of parameters is ZeRO's (stage 0: plain),
        # on the comm thread: dense layers over the world, each expert over its replicas
        # {0, 2}, {1, 3} (one rank each where ep = world), averaged over the world
        replica_comm = comms.ep_replicas
        experts = Replicas(collective_for(cfg.sync, cfg, replica_comm),
                           collective_for(cfg.sync, cfg, replica_comm.Dup())
                           if cfg.overlap else None, scale=1.0 / cfg.ep)
        thread_coll = collective_for(cfg.sync, cfg, ctx.dp_comm.Dup()) if cfg.overlap else None
        self.sync = ZeRO(cfg.zero, units_of(model, experts),
                         collective_for(cfg.sync, cfg, ctx.dp_comm), cfg, tracer=self.tracer,
                         thread_coll=thread_coll, overlap=cfg.overlap,
                         compressor=build_compressor(cfg.compress))
        self.sync.setup(model)
        self.optimizer = self.sync.make_optimizer()
        # --precision: the fp32 parameters are the master weights, autocast casts them per
        # matmul (as DataParallel); the dense gradients are the same on every rank after
        # the all-reduce, the experts' differ from rank to rank of an expert group, so
        # under fp16 the whole launch votes on an overflow and skips the same steps (an
        # inf in any gradient skips the update: Micikevicius et al. 2018, section 3.2)
        self.precision = of_config(cfg, device.type)
        self.agree = any_rank_of(ctx.comm) if self.precision.scaler else None

    def describe(self):
        lay = self.placement
        return f", ep {lay.ep}: experts {lay.per_rank} of {lay.experts} per rank, " \
               f"{lay.replicas} replica(s) each"

    def trace_label(self, rank):
        return f"rank {rank} (expert group {rank // self.cfg.ep}, ep {rank % self.cfg.ep})"

    def traffic(self):
        sent = total([self.sync.bytes_sent, self.exchange.coll.bytes_sent])
        received = total([self.sync.bytes_received, self.exchange.coll.bytes_received])
        if None in (sent, received):
            return None, None
        return sent, received

    def step(self, step):
        """loop.one_step, plus the all-to-alls' fields."""
        alltoall_bytes, alltoall_s = self.exchange.coll.bytes_sent, self.exchange.seconds
        # two all-to-alls per MoE block in the forward, two more in the backward
        loss, compute_s, comm_s, step_s = one_step(step, self.cfg, self.ctx, self.data,
                                                   self.model, self.sync, self.optimizer,
                                                   self.device, tracer=self.tracer,
                                                   precision=self.precision,
                                                   agree=self.agree)
        # the all-to-alls block the forward and backward: exposed communication
        alltoall_s = self.exchange.seconds - alltoall_s
        dropped = [m.dropped_fraction for m in self.model.modules() if isinstance(m, MoE)]
        return loss, {
            "step_time_s": step_s, "compute_time_s": compute_s - alltoall_s,
            "comm_time_s": comm_s + alltoall_s, "alltoall_time_s": alltoall_s,
            "alltoall_bytes": None if alltoall_bytes is None else
            self.exchange.coll.bytes_sent - alltoall_bytes,
            "dropped_fraction": sum(dropped) / len(dropped), **self.precision.record()}

    def parameters_npz(self):
        """The whole model on world rank 0 (collective): the dense parameters of rank 0,
        the experts of the first expert group's ranks."""
        experts = {id(p) for p in self.expert_params}
        mine = {n: p.detach().cpu().numpy() for n, p in self.model.named_parameters()
                if (self.ctx.rank == 0 if id(p) not in experts else self.placement.group == 0)}
        gathered = self.ctx.comm.gather(mine, root=0)
        return {n: a for part in gathered for n, a in part.items()} if self.ctx.rank == 0 \
            else {}
