"""Memory accounting per rank, measured from the tensors that exist, not from formulas.

    state_bytes(params, grads, optimizer)    # {"params", "grads", "optimizer"} in bytes
    zero_memory(psi, N, stage, precision)    # the ZeRO paper's formula for the same
    meter = ActivationMeter(params_of)       # bytes autograd saved for the backward
    with meter:                              # (saved-tensor hooks)
        loss = model(x) ...                  # meter.live_bytes grows
    loss.backward()                          # ... and falls as the graph is freed

Counting is by storage: a tensor and its views (a parameter's `.t()`, the
slices of a flat ZeRO buffer) share one storage and are counted once, at the
storage's full size.  This is what the allocator holds, so a ZeRO-1 shard view
into the full parameter buffer costs nothing extra, while a ZeRO-3 shard that
is its own tensor costs its own bytes.

The formula beside the measurement, `zero_memory(psi, N, stage, precision,
optimizer)`: the ZeRO paper (Rajbhandari et al., 2020, section 3.1 and
Figure 1) counts 2Ψ + 2Ψ + KΨ bytes for mixed precision: 16-bit parameters
and gradients, and K = 12 bytes of optimizer state for Adam (fp32 master
weights, momentum and variance, 4 + 4 + 4).  Per parameter:

    precision        params  grads  optimizer K                      Adam total
    fp32             4       4      Adam 8 (m, v), momentum 4, SGD 0  16
    bf16, fp16, fp8  2       2      4 (master) + the same:           16
                                    Adam 12, momentum 8, SGD 4

fp8 holds bf16's states: its buffers are 16-bit and its masters fp32 (see
bytes_per_parameter); its 8-bit copies are activations, not states.

In pure fp32 the master copy is the parameters themselves, so Adam's 16 bytes
split 4 + 4 + 8 (not 2 + 2 + 12) and the stages come to
0: 16Ψ   1: 8Ψ + 8Ψ/N   2: 4Ψ + 12Ψ/N   3: 16Ψ/N;
with mixed precision they are the paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
"""
import weakref

import torch

from ..config.choices import PRECISIONS
from .precision import HALF_DTYPES

# optimizer state in fp32 bytes per parameter: Adam's m and v, SGD's momentum buffer
OPTIMIZER_STATE_BYTES = {"adam": 8, "momentum": 4, "sgd": 0}


def bytes_per_parameter(precision="fp32", optimizer="adam"):
    """{"params", "grads", "optimizer"}: bytes per parameter (the table above).
    optimizer: adam, momentum (SGD with a momentum buffer) or sgd (none)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, "
                         f"got {optimizer!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return {"params": 4, "grads": 4, "optimizer": OPTIMIZER_STATE_BYTES[optimizer]}
    # Mixed: the 16-bit buffers of precision.HALF_DTYPES + the fp32 master weights.  Under
    # fp8 those buffers are bf16 (HALF_DTYPES["fp8"]): ZeRO's flat parameter and gradient
    # buffers and its fp32 master shards are bf16's (sync/zero.py's ZeroUnit), and
    # fp8_linear.py's 8-bit copies of a linear layer's input and weight are made in its
    # forward and kept only for its backward: activations, not model states.
    half = HALF_DTYPES[precision].itemsize
    return {"params": half, "grads": half, "optimizer": 4 + OPTIMIZER_STATE_BYTES[optimizer]}


def zero_memory(psi, N, stage, precision="fp32", optimizer="adam"):
    """Bytes per rank {"params", "grads", "optimizer"} of ZeRO stage 0-3 for Ψ = psi
    parameters over N data-parallel ranks (Rajbhandari et al., Figure 1): stage 1
    shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too.
    fp32 Adam: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N;
    mixed Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
    shard = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    return {part: psi * b / (N if shard[part] else 1)
            for part, b in bytes_per_parameter(precision, optimizer).items()}


def _storage(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def storage_bytes(tensors, seen=None):
    """Bytes of the distinct storages behind `tensors` (None and empty ones ignored)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        ptr, nbytes = _storage(t)
        if ptr not in seen:
            seen.add(ptr)
            total += nbytes
    return total


def optimizer_tensors(optimizer):
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values()
            if torch.is_tensor(v)]


def state_bytes(params, grads, optimizer_state):
    """Params, grads and optimizer state of this rank; a storage shared between two
    kinds (never the case here) would count in the first only."""
    seen = set()
    return {"params": storage_bytes(params, seen), "grads": storage_bytes(grads, seen),
            "optimizer": storage_bytes(optimizer_state, seen)}


class _Saved:
    """What autograd keeps instead of a saved tensor; its death frees the bytes."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ActivationMeter(torch.autograd.graph.saved_tensors_hooks):
    """Live and peak bytes of the tensors autograd saved for backward (activations).

    Parameters are not activations: a saved tensor whose storage is a parameter's
    is passed through uncounted.  `packers` (ZeRO-3) may replace a saved tensor
    by a small token and rebuild it at unpack time: see zero.py."""

    def __init__(self, param_storages=lambda: (), packers=()):
        self.param_storages, self.packers = param_storages, list(packers)
        self.live_bytes = self.peak_bytes = 0
        self._live = {}                 # storage ptr -> [bytes, references]
        self._params = set()
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        self._params = set(self.param_storages())
        return super().__enter__()

    def reset_peak(self):
        self.peak_bytes = self.live_bytes

    def _pack(self, t):
        for packer in self.packers:
            token = packer.pack(t)
            if token is not None:
                return (packer, token)
        ptr, nbytes = _storage(t)
        if ptr in self._params or nbytes == 0:
            return t
        entry = self._live.setdefault(ptr, [nbytes, 0])
        if entry[1] == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[1] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, ptr)
        return saved

    def _release(self, ptr):
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._live[ptr]

    @staticmethod
    def _unpack(saved):
        if type(saved) is tuple:
            packer, token = saved
            return packer.unpack(token)
        return saved.tensor if type(saved) is _Saved else saved
