"""Mixed precision: 16-bit compute, fp32 master weights, and dynamic loss scaling for fp16.

Micikevicius et al., "Mixed Precision Training" (ICLR 2018); for bfloat16,
Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training" (2019).

    --precision fp32   everything in fp32 (the reference)
    --precision bf16   forward and backward under torch.autocast(bfloat16); bf16 has
                       fp32's 8 exponent bits, so gradients neither overflow nor
                       underflow where fp32's would not: no loss scaling (Kalamkar)
    --precision fp16   the same in float16, whose 5 exponent bits flush small
                       gradients to zero: the loss is multiplied by a scale S before
                       backward, and the gradients divided by S before the update
    --precision fp8    the linear layers' matmuls in 8-bit floats (fp8_linear.py:
                       e4m3 forward, e5m2 gradients, a scale per tensor), everything
                       else as bf16: this class is bf16's, the model's nn.Linear
                       layers are swapped for fp8's (parallelize.py)

One step (Micikevicius, Figure 1 and section 3.2), with a dynamic scale S:

    step  what                                             dtype
    1     forward under autocast                           matmuls in 16 bit,
                                                           reductions / losses in fp32
    2     backward of S x loss                             gradients of 16-bit tensors
    3     synchronise the gradients (all-reduce, ZeRO)     as the gradients are stored
    4     any inf or NaN in the synchronised gradients?    -
          yes: skip the update, S = S / 2, overflow_skips += 1
          no:  gradients / S, the optimizer's step on the fp32 master weights;
               after `window` clean steps in a row S = 2 S
    5     the 16-bit copies (ZeRO's buffers) := the fp32 master weights

The overflow check (4) reads the *synchronised* gradients: after an all-reduce
every rank holds the same values, so every rank sees the same inf and skips
the same steps.  A rank of ZeRO stages 1-3 holds only its shard: there one
all-reduce(max) of a flag makes the ranks agree (`agree`).

Where the scale lives (loss_scaling.py): on the host for a CPU run, as Python
numbers; on the GPU for a CUDA run, as tensors, so that step 4 is decided by
kernels and the CPU does not wait for backward to learn whether to step.

Where the master weights are:
  the data-parallel loop (train.py)  the model's parameters stay fp32: they are the
                                     master weights; autocast casts them for each matmul
  ZeRO (zero.py)                     parameters and gradients are 16-bit buffers, the
                                     fp32 master copy lives beside Adam's state: the
                                     paper's 2Ψ + 2Ψ + 12Ψ = 16Ψ (memory.py, zero_memory)
  pipeline and tensor parallel       as ZeRO on each rank; what crosses ranks goes as
  (pipeline.py, tensor_parallel.py,  fp32: a stage's activations and their gradients,
  sequence_parallel.py)              the tp axis's partial sums; fp16's overflow vote
                                     spans every rank (engine/parallelize.py, any_rank_of)
  expert parallel                    as the data-parallel loop; the tokens cross the
  (expert_parallel.py)               all-to-alls as fp32; a rank holds its own experts'
                                     gradients, so fp16's vote spans every rank too
"""
from contextlib import nullcontext

import torch

from ..config.choices import PRECISIONS, ConfigError
from .loss_scaling import DeviceLossScaler, LossScaler, SkipWhereFound

# fp8 computes what is not a linear layer's matmul in bf16, and keeps bf16's
# 16-bit buffers (ZeRO) and its wire: its MixedPrecision is bf16's
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class MixedPrecision:
    """The precision of a run: its autocast, its scaled backward and its guarded update.

    precision: fp32, bf16, fp16 or fp8 (bf16's autocast; the swap of the linear
    layers is fp8_linear.to_fp8's); device_type: "cpu" or "cuda"; on_device: fp16's
    scale kept as tensors on device_type (default: on a GPU, not on the CPU)."""

    def __init__(self, precision="fp32", device_type="cpu", loss_scale=2.0**16,
                 loss_scale_window=2000, on_device=None):
        if precision not in PRECISIONS:
            raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}",
                              field="precision")
        self.name, self.device_type = precision, device_type
        self.half = HALF_DTYPES.get(precision)        # None: fp32
        self.scaler = None
        if precision == "fp16":
            on_device = device_type != "cpu" if on_device is None else on_device
            self.scaler = DeviceLossScaler(loss_scale, loss_scale_window, device_type) \
                if on_device else LossScaler(loss_scale, loss_scale_window)

    @property
    def mixed(self):
        return self.half is not None

    def autocast(self):
        """Step 1: the forward's matmuls in 16 bit, what needs the range in fp32."""
        if not self.mixed:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.half)

    def backward(self, loss, *outputs_and_grads):
        """Step 2: backward of S x loss (fp16), of the loss itself otherwise.  A pipeline
        stage's own loss term (a mixture of experts' balance loss) goes with its output
        and that output's gradient, received already scaled: (output, gradient)."""
        scaled = loss if self.scaler is None else loss * self.scaler.multiplier
        if not outputs_and_grads:
            scaled.backward()
            return
        out, grad = outputs_and_grads
        torch.autograd.backward([out, scaled], [grad, torch.ones_like(scaled)])

    def step(self, grads, update, agree=None, kept=None):
        """Steps 4-5 on the synchronised `grads`: skip (fp16 overflow) or unscale them
        and run `update()`.  agree(found_inf) -> found_inf: every rank's vote (ZeRO's
        shards), over a one-element tensor (a bool on the host's path); None where
        every rank holds the same gradients.  kept: the sync's lossy compressor's state
        of the step's start (compression/skipped_step.py), told the vote's outcome, or
        None.  Returns whether it stepped: a bool, or on the device's path a bool tensor
        (reading it is a host read, the caller's; kept's, where there is one)."""
        if self.scaler is None:
            update()
            return True
        if isinstance(self.scaler, DeviceLossScaler):
            return self._device_step(grads, update, agree, kept)
        overflow = self.scaler.overflowed(grads)
        if agree is not None:
            overflow = bool(agree(overflow))
        scale = self.scaler.scale
        stepped = self.scaler.update(overflow)
        if kept is not None:
            kept.decided(stepped, self.scaler.scale / scale)
        if not stepped:
            return False
        with torch.no_grad():
            for g in grads:
                if g is not None:
                    g.mul_(1.0 / scale)
        update()
        return True

    def _device_step(self, grads, update, agree, kept):
        """loss_scaling.py's steps 1-4: no host read where the optimizers allow."""
        with torch.no_grad():
            found_inf = self.scaler.unscale(grads)          # unscaled even where skipped
        if agree is not None:
            voted = agree(found_inf)
            if not torch.is_tensor(voted):
                found_inf.fill_(float(voted))
            elif voted is not found_inf:
                found_inf.copy_(voted)
        with SkipWhereFound(found_inf):
            update()
        before = self.scaler.multiplier.clone() if kept is not None else None
        self.scaler.update(found_inf)
        stepped = found_inf.view(()) == 0
        if kept is not None:                                # a host read
            kept.decided(stepped, self.scaler.multiplier / before)
        return stepped

    def state_dict(self):
        """fp16's loss scale and counters, for checkpoints ({} without a scaler)."""
        return {} if self.scaler is None else self.scaler.snapshot()

    def load_state_dict(self, state):
        if self.scaler is not None and state:
            self.scaler.restore(state)

    def scalars(self):
        """What record() reports, where it lives on the GPU (the scale and the skips of
        the device's path): for the step to read with its loss, in one copy
        (StepClock.read).  () where the host holds them, or there is no scaler."""
        if isinstance(self.scaler, DeviceLossScaler):
            return self.scaler.multiplier, self.scaler.skips
        return ()

    def record(self, read=()):
        """The step record's fields: the scale and the skips so far (fp16 only).  `read`:
        the values of scalars(), read by the caller; else read here (on the device's
        path a host read)."""
        if self.scaler is None:
            return {}
        if read:
            scale, skips = read
            return {"loss_scale": scale, "overflow_skips": int(skips)}
        state = self.scaler.snapshot()
        return {"loss_scale": state["scale"], "overflow_skips": state["overflow_skips"]}


def as_wire(t, copy=False):
    """t as it crosses ranks: 16-bit compute still sends, and adds, in fp32 (the table
    above); contiguous; t itself where it is both already, unless `copy`."""
    # to() hands back t itself, whatever its layout, where t is fp32 and copy is False
    return t.to(torch.float32, memory_format=torch.contiguous_format, copy=copy).contiguous()


def any_rank(coll):
    """agree() for MixedPrecision.step over an allreduce/ collective: whether any rank
    saw an overflow (ZeRO stages 1-3, whose ranks each check their own shard).  A
    found_inf tensor is reduced where it is (a CUDA one through NCCL, or staged
    through host memory for MPI); a bool, on the host."""
    def agree(found):
        flag = found if torch.is_tensor(found) else torch.tensor([float(found)])
        if coll.size > 1:
            coll.allreduce(flag, op="max")
        return flag if torch.is_tensor(found) else bool(flag.item())
    return agree


def any_rank_of(comm):
    """agree() over a mesh's communicator (mpi4py's, or torchrun's TorchComm): the grid's
    vote over every rank, the largest of every rank's 0 or 1.  Their Python objects live
    on the host: a found_inf tensor is read there (on a GPU the one host read of fp16's
    step where pp, tp or ep split the gradients)."""

    def agree(found):
        voted = max(comm.allgather(int(bool(found))))
        return found.fill_(voted) if torch.is_tensor(found) else bool(voted)
    return agree


def of_config(cfg, device_type="cpu"):
    """The MixedPrecision a TrainConfig (or a PrecisionOptions) asks for."""
    return MixedPrecision(cfg.precision, device_type, cfg.loss_scale, cfg.loss_scale_window)
