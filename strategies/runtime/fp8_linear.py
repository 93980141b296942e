"""--precision fp8: the linear layers' matmuls in 8-bit floats, through torch._scaled_mm.

Micikevicius et al., "FP8 Formats for Deep Learning" (2022), and NVIDIA Transformer
Engine's per-tensor scaling.  Two 8-bit formats, each for what it carries:

    format  exponent  mantissa  largest   relative rounding error (2^-(mantissa+1))
    e4m3    4         3         448       2^-4 = 6.25 %     weights and activations
    e5m2    5         2         57344     2^-3 = 12.5 %     gradients (wider range)

One linear layer y = x W^T + b, x of M rows (tokens) by K features, W of N by K:

    pass       matmul              operands            output
    forward    y    = x W^T        x, W in e4m3        autocast's dtype (bf16)
    backward   dx   = dy W         dy in e5m2, W e4m3  x's dtype
               dW   = dy^T x       dy in e5m2, x e4m3  W's dtype (the fp32 master)

Each operand gets one scale of its own, from its *current* amax (the largest
magnitude in the tensor now; fp8_formats.py, which the wire's fp8 compression shares):
q = fp8(t * s), s = FP8_MAX / amax(t), so the largest
value lands on the format's largest (448 for e4m3, 57344 for e5m2) and the smallest
ones stay clear of the format's underflow; _scaled_mm multiplies the product back
by 1 / (s_a s_b).  Transformer Engine's default is *delayed* scaling (s from the
amax history of earlier steps), which saves a pass over the tensor before its cast
but needs a history per tensor, kept in checkpoints and agreed across replicas;
current scaling (Transformer Engine's Float8CurrentScaling) has no state and cannot
overflow when a tensor grows between steps, which is why it is the rule here.

Everything that is not one of these matmuls runs as under --precision bf16
(precision.py's autocast): embeddings, LayerNorms, attention's softmax and its own
matmuls, the loss.  The master weights stay fp32 (the model's parameters, or ZeRO's
fp32 masters beside its 16-bit buffers); the 8-bit copies live for one step only.

The swap: `to_fp8(model)` turns each nn.Linear into an Fp8Linear in place (the same
parameters, names and state_dict); tensor parallelism's column- and row-parallel
layers, built from an Fp8Linear, take its function (tensor_parallel.py).  A mixture
of experts' router (its gate) stays bf16, as DeepSeek-V3's fp8 recipe keeps it
(DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.3.1): its logits pick
each token's experts, a discrete choice a rounding can flip, and it is a small
matrix, d_model x experts, whose fp8 saves little.

Where it runs: torch._scaled_mm on the CPU (torch 2.13 has CPU kernels for it), and on
NVIDIA GPUs of compute capability 8.9 or later (Ada, Hopper), whose tensor cores
multiply fp8; `check_device` refuses an older GPU before training.  The GPU's
cuBLASLt also wants the second operand column-major and the two matmul dimensions
multiples of 16 (`scaled_mm` pads them with zeros).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config.choices import ConfigError
from ..model.moe import MoE
# the formats' figures (FP8_MAX, MANTISSA_BITS) named here too: the docstring's table
from .fp8_formats import E4M3, E5M2, FP8_MAX, MANTISSA_BITS, quantize

ALIGN = 16                  # cuBLASLt's fp8 matmul: K and N multiples of 16


def quantize_operand(t, fp8):
    """t in the 8-bit format `fp8`, current scaling (fp8_formats.py): (q, 1 / s), the
    inverse being what _scaled_mm multiplies the product by."""
    q, scale = quantize(t, fp8)
    # row-major whatever t's strides were (a transposed or broadcast gradient)
    return q.contiguous(), scale.reciprocal()


def _pad(t, rows, cols):
    """t with zero rows and columns added to `rows` x `cols` (itself where it fits)."""
    if t.shape == (rows, cols):
        return t
    # fp8 has few kernels: pad the bytes, whose zero is the format's +0
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=t.device)
    out[:t.shape[0], :t.shape[1]] = t.view(torch.uint8)
    return out.view(t.dtype)


def _up(n):
    return -(-n // ALIGN) * ALIGN


def scaled_mm(a, a_inv, b, b_inv, out_dtype):
    """(a / s_a) @ (b / s_b)^T for fp8 a (M x K) and b (N x K), in out_dtype.  b^T goes
    in column-major (b row-major, transposed by a view), as cuBLASLt asks; K and N are
    padded to multiples of 16 with zeros, which add nothing to the sums."""
    (M, K), N = a.shape, b.shape[0]
    a, b = _pad(a, M, _up(K)), _pad(b, _up(N), _up(K))
    out = torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    return out[:, :N]


def _transposed(q):
    """q^T, contiguous: fp8's transpose copied as bytes (its kernels are few)."""
    return q.view(torch.uint8).t().contiguous().view(q.dtype)


class Fp8Matmul(torch.autograd.Function):
    """y = x W^T (+ b) with the module docstring's table: e4m3 forward, e5m2 gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_inv = quantize_operand(x2, E4M3)
        wq, w_inv = quantize_operand(weight, E4M3)
        y = scaled_mm(xq, x_inv, wq, w_inv, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        # the 8-bit copies are what backward multiplies: a quarter of fp32's memory
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.shapes = x.shape, x.dtype, weight.dtype, bias is not None and bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyq, dy_inv = quantize_operand(dy2, E5M2)
        # dx = dy W: W^T's rows are W's columns; dW = dy^T x: over the M tokens
        dx = scaled_mm(dyq, dy_inv, _transposed(wq), w_inv, torch.float32)
        dw = scaled_mm(_transposed(dyq), dy_inv, _transposed(xq), x_inv, torch.float32)
        db = dy2.float().sum(0).to(b_dtype) if b_dtype else None
        return dx.to(x_dtype).reshape(x_shape), dw.to(w_dtype), db, None


def fp8_linear(x, weight, bias=None):
    """F.linear's contract through the fp8 matmuls; the output in autocast's dtype (bf16
    under --precision fp8), else in x's."""
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
        else x.dtype
    return Fp8Matmul.apply(x, weight, bias, out_dtype)


class Fp8Linear(nn.Linear):
    """nn.Linear whose matmuls are fp8's; `function` is what tensor parallelism's layers
    built from it call (tensor_parallel.py)."""
    function = staticmethod(fp8_linear)

    def forward(self, x):
        return fp8_linear(x, self.weight, self.bias)


def linear_function(layer):
    """The matmul a layer computes with: fp8_linear for an Fp8Linear, else F.linear."""
    return layer.function if isinstance(layer, Fp8Linear) else F.linear


def to_fp8(model):
    """Every nn.Linear of `model` an Fp8Linear, in place: the same module objects and
    parameters (their names, the optimizer's references, the checkpoints stay); a
    mixture of experts' router excepted (the module docstring)."""
    routers = {id(m.gate) for m in model.modules() if isinstance(m, MoE)}
    for module in model.modules():
        if type(module) is nn.Linear and id(module) not in routers:
            module.__class__ = Fp8Linear
    return model


def check_device(device):
    """A ConfigError where `device` cannot multiply fp8: a GPU older than compute
    capability 8.9, or one (or a CPU build) whose torch._scaled_mm raises."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"--precision fp8 needs a GPU of compute capability 8.9 or "
                              f"later (Ada, Hopper), whose tensor cores multiply fp8; "
                              f"{name} is {major}.{minor}", field="precision")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    try:
        one = torch.ones(ALIGN, ALIGN, device=device).to(E4M3)
        s = torch.ones((), device=device)
        torch._scaled_mm(one, one.t(), scale_a=s, scale_b=s, out_dtype=torch.float32)
    except (RuntimeError, AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--precision fp8: torch._scaled_mm does not run on {where} "
                          f"({first})", field="precision") from None
