"""The two 8-bit float formats: their largest values, the scale a tensor's amax asks
for, the saturating cast and its inverse.  One home for both users of fp8:

    fp8_linear.py         the matmuls' operands (e4m3, e5m2) for torch._scaled_mm
    compression/fp8.py    a gradient bucket in e4m3 on the wire, its scale beside it

Micikevicius et al., "FP8 Formats for Deep Learning" (2022):

    format  exponent  mantissa  largest   relative rounding error (2^-(mantissa+1))
    e4m3    4         3         448       2^-4 = 6.25 %   (the "fn" variant: no infinities)
    e5m2    5         2         57344     2^-3 = 12.5 %

A tensor t travels scaled: q = fp8(t * s) with s = FP8_MAX / amax(t), so its largest
magnitude lands on the format's largest value and its small ones stay clear of the
format's underflow; t is q / s within the rounding above.  The scale comes from t's
*current* amax (no history of earlier steps to keep or agree on), computed where t
lives: no wait for the host.
"""
import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}   # 448, 57344
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
FLOAT32_MAX = torch.finfo(torch.float32).max


def scale_of(amax, fp8):
    """s = FP8_MAX / amax as a float32 tensor on amax's device, Transformer Engine's rule
    (its compute_scale_from_amax): 1 where amax is 0, inf or NaN (q is zeros or not
    finite whatever s is, and 1 is a scale every reader takes: the servers refuse one
    that is not finite and positive, psrv/protocol.py; an inf amax would give s = 0,
    and q / s NaN even where t was finite), float32's largest where the quotient
    overflows (amax below FP8_MAX / 3.4e38, about 1e-36: an infinite s would turn t * s
    into inf and NaN)."""
    amax = amax.float()
    return torch.where(torch.isfinite(amax) & (amax > 0),
                       (FP8_MAX[fp8] / amax).clamp(max=FLOAT32_MAX), torch.ones_like(amax))


def cast(t, scale, fp8):
    """fp8(t * s), saturating: float32's rounding of t * s may land just past the
    format's largest value, where e5m2's cast gives inf (and e4m3fn has none).  What
    was not finite stays so (NaN): torch's cast to e4m3fn would saturate an inf to 448,
    and a gradient's overflow would travel on as a finite value that fp16's vote
    (runtime/precision.py) never sees."""
    scaled = t.float() * scale
    return torch.where(scaled.isfinite(), scaled.clamp(-FP8_MAX[fp8], FP8_MAX[fp8]),
                       float("nan")).to(fp8)


def quantize(t, fp8):
    """(q, s): t in the format `fp8`, scaled by its current amax."""
    scale = scale_of(t.detach().abs().amax(), fp8)
    return cast(t, scale, fp8), scale


def dequantize(q, scale):
    """q / s in float32: what q stands for."""
    return q.float() / scale
