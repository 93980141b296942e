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
is a *bucket* of the one bucket engine (buckets.py): a run of whole layers (GPT
blocks, an embedding, the linears of the MLP) of at most --bucket-mb, one layer
at stage 3, whose parameters are one flat buffer, cut by `allreduce.shard_bounds`,
the rule that reduce-scatter and all-gather use as well, so rank r's shard of
parameters, gradients and optimizer state are the same elements.  Plain data
parallelism is stage 0 over the same buckets (data_parallel.py builds every run's):
there is one implementation of data parallelism, and ZeRO is a choice of its
collective.

A step, per bucket, in the order backward finishes them:

    stage 0  all-reduce(avg) the bucket's flat gradient           -> every rank updates all
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
says (memory.zero_memory).  The gradients are reduced in 16 bit (--reduce-precision
fp32 widens each bucket for its reduction instead, as Megatron-LM's
grad_reduce_in_fp32 does: twice the bytes, no rounding to 16 bits in the sum); the
optimizer reads them as fp32, unscaled, for its step only, and the updated master
shard is cast back into the 16-bit buffer before the all-gather.

The gradient collectives of stages 0-2 (and stage 3's reduce-scatters) run on
the communication thread (comm_thread.py), through the bucket engine: a bucket's
collective is handed over the moment backward finishes its gradients, and runs
while backward computes the layers before it.  The thread
has a collective of its own, over a duplicate of the dp communicator, because
the main thread keeps talking on dp meanwhile (stage 3's gathers).  The layers
go to the thread in index order, the same on every rank of the dp axis.
--no-overlap runs each collective inside the hook instead.

--compress works on every stage: a bucket is a bucket of the compressor (compression/casts.py, topk.py, powersgd.py), keyed by its
index.  The 16-bit casts halve a reduce-scatter as they halve an all-reduce;
top-k and PowerSGD compress an all-reduce, so stages 1-3 take their shard of
the compressed all-reduce's result (the shard's bytes are the stage's; the
wire carries what the compressor sends).
"""
import torch
import torch.nn as nn

from allreduce.torch_world import under_torchrun

from ..compression.casts import Compressor
from ..compression.skipped_step import kept_state
from ..runtime.checkpoint import on_device
from ..runtime.memory import optimizer_tensors, state_bytes
from ..runtime.precision import MixedPrecision, any_rank
from ..runtime.trace import span
from .buckets import GradBuckets, Layer, Replicas
from .gradient_sync import GradientSync, make_optimizer, total

__all__ = ["Replicas", "ZeRO"]

EMPTY = torch.empty(0)


class ZeroUnit:
    """One bucket's parameters as one flat buffer and this rank's shard of it."""

    def __init__(self, bucket, zero):
        self.bucket, self.zero = bucket, zero
        self.index, self.name, self.params = bucket.index, bucket.name, bucket.params
        self.module = bucket.layers[0].module           # stage 3: one layer a bucket
        self.replicas = replicas = bucket.replicas
        self.shapes, self.sizes, self.numel = bucket.shapes, bucket.sizes, bucket.numel
        self.start, self.stop = bucket.start, bucket.stop
        self.full = self.shard = self.master = None
        # stage 3's parameters between uses: empty, on their device (a GPU's stay there)
        self.empty = EMPTY.to(self.params[0].device)
        full = torch.cat([p.detach().reshape(-1) for p in self.params])
        if replicas.size > 1:            # rank 0's weights win, as in DDP
            replicas.coll.broadcast(full, root=0)
        # mixed precision: the fp32 master weights of this rank's shard (all, at stage 0)
        if zero.precision.mixed:
            mine = full if zero.stage == 0 else full[self.start:self.stop]
            self.master = nn.Parameter(mine.clone())
            full = full.to(zero.precision.half)
        if zero.stage < 3:
            self._bind(full)
        if zero.stage in (1, 2):         # the optimizer's parameter: a view into `full`
            self.shard = nn.Parameter(full[self.start:self.stop])
        elif zero.stage == 3:
            self.shard = nn.Parameter(full[self.start:self.stop].clone())
            self._bind(None)

    def _bind(self, full):
        """Point the parameters at `full`, or at nothing (stage 3 between uses)."""
        self.full = full
        offset = 0
        for p, shape, n in zip(self.params, self.shapes, self.sizes):
            p.data = self.empty if full is None else full[offset:offset + n].view(shape)
            offset += n

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

    # --------------------------------------------------------- the update
    def gradient(self):
        """The synchronised gradient the optimizer steps on (16-bit when mixed)."""
        return self.bucket.target if self.zero.stage == 0 else self.shard.grad

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
    """Data parallelism over the bucket engine: plain (stage 0) or ZeRO stages 1-3, a
    sync of the contract in gradient_sync.py.  The replicas start equal at construction
    (each bucket broadcast from rank 0), and gradients travel from backward's hooks, so
    `synchronize` waits for the last buckets' collectives.

    units: [(name, module, [parameters])] of this rank's layers, in forward order, or
    (name, module, [parameters], Replicas) where a layer has replicas of its own (an
    expert's, expert_parallel.py).
    coll: an allreduce/ collective over the dp communicator; thread_coll: another, over
    a duplicate of it, for the comm thread (None: no thread, every collective in its
    hook); compressor: a compressor of --compress (compression/casts.py), None: float32.
    Buckets never mix replicas; ranks that share an expert hold the same buckets in the
    same order, so every communicator sees its collectives in one order on all of its
    ranks."""
    name = "zero"

    def __init__(self, stage, units, coll, cfg, backwards_per_step=1, tracer=None,
                 precision=None, agree=None, thread_coll=None, compressor=None, overlap=True,
                 device=None):
        super().__init__(cfg, None, device or torch.device("cpu"))
        self.stage, self.coll, self.tracer = stage, coll, tracer
        # a signal ends the run at a step the workers agree on (stopping.py): every wait
        # of a step over MPI is a Python poll that runs its handler; torch.distributed's
        # block in C++
        self.signal_stop = cfg.sync != "torch" and not under_torchrun()
        self.precision = precision or MixedPrecision()
        # fp16: how the ranks agree on an overflow.  Over dp where each holds a shard
        # (stages 1-3); the grid passes a vote over every rank when pp or tp split the
        # model, since a rank then sees its stage's or its piece's gradients only
        self.agree = agree or (any_rank(coll) if stage else None)
        self.backwards_per_step = backwards_per_step
        self.gathered = {}              # storage ptr of a gathered layer -> its ZeroUnit
        self.peak_gathered_bytes = 0
        self.thread_coll = thread_coll or coll
        self.compressor = compressor or Compressor()
        self.kept = kept_state(cfg, self.compressor)      # fp16's skips, undone in it
        # --reduce-precision fp32: 16-bit buckets are reduced as fp32 (Megatron-LM's
        # grad_reduce_in_fp32): twice the bytes, no 16-bit rounding in the sum
        self.reduce_fp32 = cfg.reduce_precision == "fp32"
        self.overlap = overlap and thread_coll is not None
        # a collective on the thread overlaps backward: its own track in the trace
        self.category = "dp-comm" if self.overlap else "comm"
        self.units, self._hooks = [], []
        if units is not None:
            self._build([Layer(*u) for u in units], Replicas(coll, thread_coll))

    def _build(self, layers, replicas):
        """The buckets of `layers` (stage 3: a layer each), and each one's parameter side."""
        cap = 0 if self.stage == 3 else int(self.cfg.bucket_mb * 2**20)
        self.engine = GradBuckets(layers, self._reduce_bucket, cap, self.compressor,
                                  self.overlap, replicas=replicas, keep_flat=self.stage < 2,
                                  backwards_per_step=self.backwards_per_step,
                                  after_backward=self._after_backward if self.stage == 3
                                  else None, name="zero-comm")
        self.units = [ZeroUnit(b, self) for b in self.engine.buckets]
        for unit in self.units if self.stage == 3 else ():
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda m, args, unit=unit: unit.gather("forward")))
            self._hooks.append(unit.module.register_forward_hook(
                lambda m, args, out, unit=unit: self._after_forward(unit, out)))

    # ------------------------------------------------ a bucket's collective
    def _reduce_bucket(self, bucket, flat):
        """Average `flat` over the bucket's replicas: all of it (stage 0), or this rank's
        shard (1-3), which becomes the shard's gradient.  Returns the wire bytes."""
        unit = self.units[bucket.index]
        if self.stage == 0:
            with span(self.tracer, f"all-reduce grads {unit.name}", self.category):
                return self._allreduce_avg(bucket, flat)
        with span(self.tracer, f"reduce-scatter grads {unit.name}", self.category):
            shard, sent = self._reduce_scatter_avg(bucket, flat)
        if self.stage == 1:             # the full gradient stays; its shard is the one read
            flat[unit.start:unit.stop].copy_(shard)
            shard = flat[unit.start:unit.stop]
        unit.shard.grad = shard
        return sent

    def _allreduce_avg(self, bucket, flat):
        """flat := its mean over the replicas, through the compressor.  A compressor other
        than float32's reads fp32: 16-bit buffers go through a copy."""
        replicas = bucket.replicas
        work = flat if flat.dtype == torch.float32 or \
            (type(self.compressor) is Compressor and not self.reduce_fp32) else flat.float()
        # one replica too: --compress means what the gradient goes through, wherever it goes
        sent = self.compressor.reduce_bucket(
            bucket.index, work, bucket.wire if work is flat else None, bucket.shapes,
            lambda t: replicas.thread_coll.allreduce(t, op="avg"), replicas.thread_coll)
        if work is not flat:
            flat.copy_(work)
        if replicas.scale != 1.0:
            flat.mul_(replicas.scale)
        return sent

    def _reduce_scatter_avg(self, bucket, flat):
        """(this rank's shard of flat's mean over the replicas, the wire bytes).  The casts
        travel 16-bit; top-k and PowerSGD compress an all-reduce, whose result the shard
        is cut from."""
        replicas = bucket.replicas
        if self.compressor.lossy or replicas.size == 1:
            sent = self._allreduce_avg(bucket, flat)
            return flat[bucket.start:bucket.stop].clone(), sent
        # float32's identity sends the buffer as it is (16-bit under --precision, unless
        # --reduce-precision fp32 widens it), a cast its own dtype
        if type(self.compressor) is not Compressor:
            wire = flat.to(self.compressor.wire_dtype)
        else:
            wire = flat.float() if self.reduce_fp32 else flat
        shard = replicas.thread_coll.reduce_scatter(wire, op="avg").to(flat.dtype)
        if replicas.scale != 1.0:
            shard.mul_(replicas.scale)
        return shard, wire.numel() * wire.element_size()

    # ---------------------------------------------------- stage 3's gathers
    def _after_forward(self, unit, out):
        unit.release()
        if torch.is_tensor(out) and out.requires_grad:
            # fires when the gradient of the layer's output is ready: just before its backward
            out.register_hook(lambda grad: unit.gather("backward"))

    def _after_backward(self, bucket):
        self.units[bucket.index].release()   # until the next micro-batch's forward or backward

    def note_gathered(self):
        now = sum(u.full.nbytes for u in self.gathered.values())
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)

    def pack(self, t):
        """Saved tensors (stage 3): a view of a gathered layer travels as a token."""
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
        """Over the fp32 masters (mixed) or the shards (stages 1-3); at stage 0 over the
        parameters, in `model`'s order where it is given (a whole model's checkpoint
        then holds the optimizer state of one process's)."""
        if self.precision.mixed:
            params = [u.master for u in self.units]
        elif self.stage == 0:
            params = list(model.parameters()) if model is not None else \
                [p for u in self.units for p in u.params]
        else:
            params = [u.shard for u in self.units]
        return make_optimizer(self.cfg, params)

    def before_backward(self):
        self.engine.zero_()

    def no_sync(self):
        return self.engine.accumulating()  # the hooks hand no bucket over

    def synchronize(self, step):
        self.engine.wait()      # the last buckets' collectives: the exposed part (the
                                # step engine draws this wait: engine/loop.py)
        # The next step's buckets may leave during its backward, before its own
        # synchronize: the compressor learns that step here (top-k's warm-up, a
        # function of the step; the other compressions ignore it).
        self.compressor.set_step(step + 1)

    def gradients(self):
        return [u.gradient() for u in self.units]

    @property
    def scales_itself(self):
        """16-bit buffers: step unscales and votes on an fp16 overflow itself."""
        return self.precision.mixed

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
        return self.precision.step(grads, update, self.agree, self.kept)

    # ------------------------------------------------------ what it holds
    def state_bytes(self, optimizer):
        """Params, grads and optimizer state this rank holds between steps, measured."""
        params = [u.full for u in self.units] + [u.shard for u in self.units if u.shard is not None]
        grads = [u.bucket.target for u in self.units] + \
            [u.shard.grad for u in self.units if u.shard is not None]
        masters = [u.master for u in self.units if u.master is not None]
        # the fp32 master weights count with the optimizer's state, as in the paper's K = 12
        return state_bytes(params, grads, masters + optimizer_tensors(optimizer))

    def param_storages(self):
        return [u.full.untyped_storage().data_ptr() for u in self.units if u.full is not None]

    @property
    def comm_rounds(self):
        return self.engine.reductions if self.units else 0

    @property
    def wire_bytes(self):
        return self.engine.wire_bytes if self.units else 0

    @property
    def dense_bytes(self):
        return self.engine.dense_bytes if self.units else 0

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
        return total(c.bytes_sent for c in self.colls())

    @property
    def bytes_received(self):
        return total(c.bytes_received for c in self.colls())

    def state_dict(self):
        """What the model's state_dict does not hold, where there is any: stage 3's
        parameter shards (the parameters are empty between uses), the fp32 masters of
        mixed precision, and the compressor's state (this rank's residuals, PowerSGD's
        warm starts, top-k's step: compression/casts.py) ({} for plain data parallelism
        in fp32 without a lossy --compress: the model and the optimizer are the whole
        state)."""
        state = {}
        compressor = self.compressor.state_dict()
        if compressor:
            state["compressor"] = compressor
        if self.stage == 3:
            state["shards"] = [u.shard.detach().clone() for u in self.units]
        masters = [u.master.detach().clone() for u in self.units if u.master is not None]
        if masters:
            state["masters"] = masters
        return state

    def load_state_dict(self, state):
        if "compressor" in state:       # back where the buckets' gradients live
            self.compressor.load_state_dict(on_device(state["compressor"], self.device))
            self.kept = kept_state(self.cfg, self.compressor)
        with torch.no_grad():
            for unit, shard in zip(self.units, state.get("shards", [])):
                unit.shard.copy_(shard)
            for unit, master in zip([u for u in self.units if u.master is not None],
                                    state.get("masters", [])):
                unit.master.copy_(master)

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.units:
            self.engine.close()
