"""ZeRO: the training state sharded over the data-parallel ranks (stage 0 is plain DP).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC 2020), section 5.  Ψ parameters, N data-parallel ranks,
fp32 Adam (see memory.py for how the paper's 16 bytes map onto pure fp32):

    stage  keeps whole on each rank      keeps 1/N of          bytes per rank     traffic
    0      params, grads, Adam m and v   -                     16Ψ                2Ψ (all-reduce)
    1      params, grads                 Adam m and v          8Ψ + 8Ψ/N          2Ψ
    2      params                        grads, m, v           4Ψ + 12Ψ/N         2Ψ
    3      -                             params, grads, m, v   16Ψ/N + one layer  3Ψ

(traffic in elements each rank sends, times (N-1)/N.)  The unit of everything
is a *layer* (a GPT block, an embedding, one linear of the MLP): its
parameters are one flat buffer, cut by `allreduce.shard_bounds`, the rule that
reduce-scatter and all-gather use as well, so rank r's shard of parameters,
gradients and optimizer state are the same elements.

A step, per layer, in the order backward finishes the layers:

    stage 0  all-reduce(avg) the layer's flat gradient            -> every rank updates all
    stage 1  reduce-scatter(avg) into the shard of the full gradient buffer
    stage 2  reduce-scatter(avg) into a gradient shard; the full gradient is freed at once
    stage 3  as 2, and the parameters too live as shards only:
             forward pre-hook: all-gather the layer; forward hook: free it
             hook on the layer's output gradient: all-gather again for its backward;
             after its last parameter gradient arrived: reduce-scatter, free
    then each rank's optimizer updates its shard (stages 1-3), and stages 1-2
    all-gather the updated shards into the full parameters.

Stage 1 reduce-scatters where the paper's text says all-reduce: each rank
updates only its shard, so the all-gather half of an all-reduce would move
gradients nobody reads; reduce-scatter + all-gather of parameters is exactly
the 2Ψ of plain DP, which is the paper's figure for stages 1 and 2 (7.2.1).

Stage 3 must really free a layer after its forward, although autograd saved
views of its weights for the backward (`W.t()` in a linear).  So the saved
tensors whose storage is a gathered layer are replaced by a token (layer,
size, stride, offset) and rebuilt from the re-gathered buffer at unpack time
(`pack`/`unpack`, used through memory.ActivationMeter's saved-tensor hooks).

Mixed precision (--precision bf16/fp16, precision.py) is the paper's own setting:
the flat parameter and gradient buffers (and stage 3's parameter shards) are
16-bit, and each rank keeps an fp32 master copy of its shard (of everything
at stage 0) for the optimizer: 2Ψ + 2Ψ + 12Ψ with Adam, sharded as the table
says (memory.zero_memory).  The gradients are reduced in 16 bit; the optimizer
reads them as fp32, unscaled, for its step only, and the updated master shard
is cast back into the 16-bit buffer before the all-gather.

The gradient collectives of stages 0-2 (and stage 3's reduce-scatters) run on
the communication thread (comm_thread.py), as plain data parallelism's buckets
do: a layer's collective is handed over the moment backward finishes its
gradient, and runs while backward computes the layers before it.  The thread
has a collective of its own, over a duplicate of the dp communicator, because
the main thread keeps talking on dp meanwhile (stage 3's gathers).  The layers
go to the thread in the order backward finishes them, which is the same on
every rank of the dp axis: they run the same schedule on the same stage.
--no-overlap runs each collective inside the hook instead.

--compress works on this axis as on plain data parallelism's buckets: a layer
is a bucket of the compressor (compression/casts.py, topk.py, powersgd.py), keyed by its
index.  The 16-bit casts halve a reduce-scatter as they halve an all-reduce;
top-k and PowerSGD compress an all-reduce, so stages 1-3 take their shard of
the compressed all-reduce's result (the shard's bytes are the stage's; the
wire carries what the compressor sends).
"""
import torch
import torch.nn as nn

from allreduce import shard_of

from ..compression.casts import Compressor
from ..runtime.memory import optimizer_tensors, state_bytes
from ..runtime.precision import MixedPrecision, any_rank
from ..runtime.trace import span
from .comm_thread import CommThread
from .gradient_sync import GradientSync, make_optimizer

EMPTY = torch.empty(0)


class Replicas:
    """The ranks that hold replicas of a layer, over which its gradient is averaged and
    its state sharded: the dp axis, or (expert parallelism) an expert's replicas.

    coll: an allreduce/ collective over them; thread_coll: another over a duplicate of
    its communicator, for the comm thread (None: the collectives run in the hooks);
    scale: a factor after the average (an expert's gradient, summed over the tokens of
    its expert group by autograd, is averaged over the world, not its replicas)."""

    def __init__(self, coll, thread_coll=None, scale=1.0):
        self.coll, self.thread_coll, self.scale = coll, thread_coll or coll, scale
        self.rank, self.size = coll.rank, coll.size


class ZeroUnit:
    """One layer's parameters as one flat buffer and this rank's shard of it."""

    def __init__(self, index, name, module, params, zero, replicas):
        self.index, self.name, self.module, self.params = index, name, module, params
        self.zero, self.replicas = zero, replicas
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.start, self.stop = shard_of(replicas.rank, self.numel, replicas.size)
        self.arrivals = 0              # parameter gradients seen this step
        full = torch.cat([p.detach().reshape(-1) for p in params])
        if replicas.size > 1:          # rank 0's weights win, as in DDP
            replicas.coll.broadcast(full, root=0)
        # mixed precision: the fp32 master weights of this rank's shard (all, at stage 0)
        self.master = None
        if zero.precision.mixed:
            mine = full if zero.stage == 0 else full[self.start:self.stop]
            self.master = nn.Parameter(mine.clone())
            full = full.to(zero.precision.half)
        self.full = None
        self.grad_full = None
        if zero.stage < 3:
            self._bind(full)
        if zero.stage in (0, 1):       # a persistent full gradient; p.grad are views of it
            self.grad_full = torch.zeros(self.numel, dtype=full.dtype)
            self._views(self.grad_full, "grad")
        if zero.stage == 0:
            self.shard = None
        elif zero.stage < 3:           # the optimizer's parameter: a view into `full`
            self.shard = nn.Parameter(full[self.start:self.stop])
        else:
            self.shard = nn.Parameter(full[self.start:self.stop].clone())
            self._bind(None)

    def _views(self, flat, attr):
        offset = 0
        for p, shape, n in zip(self.params, self.shapes, self.sizes):
            setattr(p, attr, flat[offset:offset + n].view(shape))
            offset += n

    def _bind(self, full):
        """Point the parameters at `full`, or at nothing (stage 3 between uses)."""
        self.full = full
        if full is None:
            for p in self.params:
                p.data = EMPTY
        else:
            self._views(full, "data")

    # ------------------------------------------------------------- stage 3
    def gather(self, why):
        if self.full is not None:
            return
        with span(self.zero.tracer, f"zero-3 all-gather {self.name} ({why})", "comm"):
            full = self.replicas.coll.allgather(self.shard.detach(), self.numel)
        self._bind(full)
        self.zero.gathered[full.untyped_storage().data_ptr()] = self
        self.zero.note_gathered()

    def release(self):
        if self.full is not None:
            self.zero.gathered.pop(self.full.untyped_storage().data_ptr(), None)
            self._bind(None)

    # --------------------------------------------------------- gradients
    def gradient_arrived(self):
        """A parameter's gradient of this micro-batch is complete (its hook, in backward)."""
        self.arrivals += 1
        if self.arrivals % len(self.params):
            return
        if self.arrivals == len(self.params) * self.zero.backwards_per_step:
            self.zero.launch(self)
        if self.zero.stage == 3:
            self.release()              # until the next micro-batch's forward or backward

    def flat_gradient(self):
        """The layer's whole gradient as one flat buffer, taken in the hook: stages 0-1
        keep it in grad_full; stages 2-3 gather it and let the parameters' go."""
        if self.zero.stage < 2:
            return self.grad_full
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        for p in self.params:
            p.grad = None               # stages 2 and 3 keep only the shard
        return flat

    def reduce(self, flat):
        """Average `flat` over dp: all of it (stage 0) or this rank's shard (1-3)."""
        zero = self.zero
        if zero.stage == 0:
            with span(zero.tracer, f"all-reduce grads {self.name}", zero.category):
                zero.allreduce_avg(self, flat)
            return
        with span(zero.tracer, f"reduce-scatter grads {self.name}", zero.category):
            shard = zero.reduce_scatter_avg(self, flat)
        if zero.stage == 1:
            self.grad_full[self.start:self.stop].copy_(shard)
            shard = self.grad_full[self.start:self.stop]
        self.shard.grad = shard

    def gradient(self):
        """The synchronised gradient the optimizer steps on (16-bit when mixed)."""
        return self.grad_full if self.zero.stage == 0 else self.shard.grad

    def master_step_done(self):
        """Mixed precision: the updated fp32 master into the 16-bit weights (step 5)."""
        with torch.no_grad():
            (self.full if self.zero.stage == 0 else self.shard).copy_(self.master)
        self.master.grad = None        # the fp32 gradient lived for the step only

    def gather_updated(self):
        """Stages 1 and 2: every rank's updated shard into the full parameters."""
        with span(self.zero.tracer, f"all-gather params {self.name}", "comm"):
            full = self.replicas.coll.allgather(self.full[self.start:self.stop], self.numel)
        self.full.copy_(full)


class ZeRO(GradientSync):
    """The data-parallel axis of a grid run: plain DP (stage 0) or ZeRO stages 1-3, a
    sync of the contract in sync/gradient_sync.py.  The replicas start equal at construction (each
    layer broadcast from rank 0), and gradients travel from backward's hooks, so
    `synchronize` only checks that every layer's gradient arrived.

    units: [(name, module, [parameters])] of this rank's layers, in forward order, or
    (name, module, [parameters], Replicas) where a layer has replicas of its own (an
    expert's, expert_parallel.py).
    coll: an allreduce/ collective over the dp communicator; thread_coll: another, over
    a duplicate of it, for the comm thread (None: no thread, every collective in its
    hook); compressor: a compressor of --compress (compression/casts.py), None: float32.  The
    layers go to the thread in the order backward finishes them; where layers have
    different replicas, ranks that share an expert finish it in the same order, so
    every communicator sees its collectives in one order on all of its ranks."""
    name = "zero"

    def __init__(self, stage, units, coll, cfg, backwards_per_step=1, tracer=None,
                 precision=None, agree=None, thread_coll=None, compressor=None, overlap=True):
        super().__init__(cfg, None, torch.device("cpu"))   # the grid runs on CPUs so far
        self.stage, self.coll, self.tracer = stage, coll, tracer
        self.precision = precision or MixedPrecision()
        # fp16: how the ranks agree on an overflow.  Over dp where each holds a shard
        # (stages 1-3); the grid passes a vote over every rank when pp or tp split the
        # model, since a rank then sees its stage's or its piece's gradients only
        self.agree = agree or (any_rank(coll) if stage else None)
        self.backwards_per_step = backwards_per_step
        self.gathered = {}              # storage ptr of a gathered layer -> its ZeroUnit
        self.peak_gathered_bytes = 0
        # the comm thread's own collective (over a duplicate of dp) and the compressor
        self.thread_coll = thread_coll or coll
        self.compressor = compressor or Compressor()
        self.wire_bytes = self.dense_bytes = 0
        self.comm_rounds = 0
        self.thread = CommThread("zero-comm") if overlap and thread_coll is not None else None
        # a collective on the thread overlaps backward: its own track in the trace
        self.category = "dp-comm" if self.thread else "comm"
        dp = Replicas(coll, thread_coll)
        self.units = [ZeroUnit(i, name, module, params, self, rest[0] if rest else dp)
                      for i, (name, module, params, *rest) in enumerate(units)]
        self._hooks = []
        for unit in self.units:
            for p in unit.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda p, unit=unit: unit.gradient_arrived()))
            if stage == 3:
                self._hooks.append(unit.module.register_forward_pre_hook(
                    lambda m, args, unit=unit: unit.gather("forward")))
                self._hooks.append(unit.module.register_forward_hook(
                    lambda m, args, out, unit=unit: self._after_forward(unit, out)))

    def launch(self, unit):
        """A layer's gradient is complete for the step: its collective, now or queued."""
        flat = unit.flat_gradient()
        if self.thread is None:
            unit.reduce(flat)
        else:
            self.thread.submit(lambda: unit.reduce(flat))

    def allreduce_avg(self, unit, flat):
        """flat := its mean over the unit's replicas, through the compressor (the unit a
        bucket of its own).  A compressor other than float32's reads fp32: 16-bit
        buffers go through a copy."""
        replicas = unit.replicas
        self.comm_rounds += 1
        self.dense_bytes += flat.numel() * 4
        if replicas.size > 1:
            work = flat if flat.dtype == torch.float32 or type(self.compressor) is Compressor \
                else flat.float()
            self.wire_bytes += self.compressor.reduce_bucket(
                unit.index, work, None, unit.shapes,
                lambda t: replicas.thread_coll.allreduce(t, op="avg"))
            if work is not flat:
                flat.copy_(work)
        if replicas.scale != 1.0:
            flat.mul_(replicas.scale)

    def reduce_scatter_avg(self, unit, flat):
        """This rank's shard of flat's mean over the unit's replicas.  The casts travel
        16-bit; top-k and PowerSGD compress an all-reduce, whose result the shard is cut
        from."""
        replicas = unit.replicas
        if self.compressor.lossy or replicas.size == 1:
            self.allreduce_avg(unit, flat)
            return flat[unit.start:unit.stop].clone()
        self.comm_rounds += 1
        self.dense_bytes += flat.numel() * 4
        # float32's identity sends the buffer as it is (16-bit under --precision)
        wire = flat if type(self.compressor) is Compressor else \
            flat.to(self.compressor.wire_dtype)
        self.wire_bytes += wire.numel() * wire.element_size()
        shard = replicas.thread_coll.reduce_scatter(wire, op="avg").to(flat.dtype)
        if replicas.scale != 1.0:
            shard.mul_(replicas.scale)
        return shard

    def _after_forward(self, unit, out):
        unit.release()
        if torch.is_tensor(out) and out.requires_grad:
            # fires when the gradient of the layer's output is ready: just before its backward
            out.register_hook(lambda grad: unit.gather("backward"))

    def note_gathered(self):
        now = sum(u.full.nbytes for u in self.gathered.values())
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)

    # ---------------------------------------------------- saved tensors (stage 3)
    def pack(self, t):
        unit = self.gathered.get(t.untyped_storage().data_ptr()) if self.gathered else None
        if unit is None:
            return None
        return unit, t.size(), t.stride(), t.storage_offset()

    def unpack(self, token):
        unit, size, stride, offset = token
        if unit.full is None:
            raise RuntimeError(f"ZeRO-3: layer {unit.name} was not gathered before its backward")
        return unit.full.as_strided(size, stride, offset)

    # ------------------------------------------------------------ the step
    def make_optimizer(self, model=None):
        """Over the fp32 masters (mixed) or the shards (stages 1-3), not the model's."""
        if self.precision.mixed:
            params = [u.master for u in self.units]
        elif self.stage == 0:
            params = [p for u in self.units for p in u.params]
        else:
            params = [u.shard for u in self.units]
        return make_optimizer(self.cfg, params)

    def before_backward(self):
        for unit in self.units:
            unit.arrivals = 0
            if unit.grad_full is not None:
                unit.grad_full.zero_()  # autograd adds into the views in place

    def synchronize(self, step):
        if self.thread is not None:
            with span(self.tracer, f"wait for gradients {step}", "comm"):
                self.thread.flush()     # the last layers' collectives: the exposed part
        self.compressor.set_step(step + 1)
        missing = [u.name for u in self.units
                   if u.arrivals != len(u.params) * self.backwards_per_step]
        if missing:
            raise RuntimeError(f"ZeRO: no complete gradient for {', '.join(missing)} "
                               "(every layer must take part in every micro-batch)")

    def gradients(self):
        return [u.gradient() for u in self.units]

    def step(self, optimizer):
        if not self.precision.mixed:
            optimizer.step()
        elif not self._mixed_step(optimizer):
            return                      # fp16 overflow: the step is skipped everywhere
        if self.stage in (1, 2):
            for unit in self.units:
                unit.gather_updated()

    def _mixed_step(self, optimizer):
        """precision.py's steps 4-5: agree on an overflow (each rank sees its shard only),
        unscale, step the fp32 masters, cast them back.  Returns whether it stepped."""
        # fp32 copies for the check, the unscaling and the step (the paper unscales in fp32)
        grads = [u.gradient().float() for u in self.units]

        def update():
            for unit, grad in zip(self.units, grads):
                unit.master.grad = grad
            optimizer.step()
            for unit in self.units:
                unit.master_step_done()
        return self.precision.step(grads, update, self.agree)

    def state_bytes(self, optimizer):
        """Params, grads and optimizer state this rank holds between steps, measured."""
        params = [u.full for u in self.units] + [u.shard for u in self.units if u.shard is not None]
        grads = [u.grad_full for u in self.units] + \
            [u.shard.grad for u in self.units if u.shard is not None]
        masters = [u.master for u in self.units if u.master is not None]
        # the fp32 master weights count with the optimizer's state, as in the paper's K = 12
        return state_bytes(params, grads, masters + optimizer_tensors(optimizer))

    def param_storages(self):
        return [u.full.untyped_storage().data_ptr() for u in self.units if u.full is not None]

    @property
    def kept_ratio(self):
        return self.compressor.kept_ratio

    def colls(self):
        """The collectives whose traffic is this sync's: each set of replicas' (and its
        thread's, where it has its own), once each."""
        out = []
        for u in self.units:
            for c in (u.replicas.coll, u.replicas.thread_coll):
                if all(c is not o for o in out):
                    out.append(c)
        return out or [self.coll]

    @property
    def bytes_sent(self):
        return sum(c.bytes_sent for c in self.colls())

    @property
    def bytes_received(self):
        return sum(c.bytes_received for c in self.colls())

    def state_dict(self):
        """What the model's state_dict does not hold: stage 3's parameter shards (the
        parameters are empty between uses), the fp32 masters of mixed precision, and
        the step of top-k's --sparsity-warmup."""
        return {"compressor_step": self.compressor.step,
                "shards": [u.shard.detach().clone() for u in self.units] if self.stage == 3
                else [],
                "masters": [u.master.detach().clone() for u in self.units
                            if u.master is not None]}

    def load_state_dict(self, state):
        self.compressor.set_step(state["compressor_step"])
        with torch.no_grad():
            for unit, shard in zip(self.units, state["shards"]):
                unit.shard.copy_(shard)
            for unit, master in zip([u for u in self.units if u.master is not None],
                                    state["masters"]):
                unit.master.copy_(master)

    def close(self):
        for h in self._hooks:
            h.remove()
        if self.thread is not None:
            self.thread.close()
