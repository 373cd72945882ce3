"""Math that computes the same bits on every backend.

A region's reference runs in one of two math modes:

* ``torch``: transcendentals (exp, sigmoid, silu, rsqrt) and reductions are torch's own ops on
  the tensor's device. This is what HF transformers and engines running torch code compute on
  that device, so the probe and the CPU fallback use it.
* ``portable``: every value is a fixed sequence of correctly rounded IEEE FP32 additions,
  multiplications, divisions and square roots, with no multiply-add contraction, plus exact
  bit manipulation. The emulator's Triton kernels implement the same sequence, so kernel and
  reference agree bit for bit in the Triton interpreter and on a GPU. What separates the two modes
  is the residual of transcendentals and summation order, which is measured, not hidden.

The functions here are written so that each line has a counterpart in the kernels.
"""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634
LN2_HI = 0.693359375  # 355/512: n * LN2_HI is exact for |n| < 2**15
LN2_LO = -2.12194440e-4
# Taylor coefficients 1/k! for k = 7..2 (Horner order); enough for ~1 ulp on |r| <= ln2/2.
EXP_COEFFS = (1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5)
EXP_MAX = 88.72283935546875  # above: +inf
EXP_MIN = -103.97208404541016  # below: 0

# Width of the lane vector a sum of squares is accumulated in: lane j sums elements j, j+W, ...
# in order, then the W lanes are added pairwise (lanes 2i and 2i+1) until one is left.
REDUCE_LANES = 256


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as FP32 for integer k in [-126, 127], built from its bit pattern."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in FP32: Cody-Waite reduction, degree-7 polynomial, exact scaling by 2**n."""
    nan = torch.isnan(x)
    xs = torch.where(nan, torch.zeros_like(x), x).clamp(EXP_MIN, EXP_MAX)
    n = torch.floor(xs * _f32(LOG2E, x) + _f32(0.5, x))
    r = (xs - n * _f32(LN2_HI, x)) - n * _f32(LN2_LO, x)
    p = torch.full_like(x, EXP_COEFFS[0])
    for c in EXP_COEFFS[1:]:
        p = p * r + _f32(c, x)
    p = p * r + _f32(1.0, x)
    p = p * r + _f32(1.0, x)
    n1 = torch.floor(n * _f32(0.5, x))
    n2 = n - n1
    out = (p * pow2(n1)) * pow2(n2)
    out = torch.where(x > EXP_MAX, torch.full_like(x, float("inf")), out)
    out = torch.where(x < EXP_MIN, torch.zeros_like(x), out)
    return torch.where(nan, x, out)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _f32(1.0, x) / (_f32(1.0, x) + exp(-x))


def sqrt(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 square root.

    ``torch.sqrt`` is not correctly rounded on every device: on x86 CPUs its vectorized kernels
    are off by one ulp for about 15% of FP32 inputs (and 1% of FP64 ones). So: the FP64 root
    rounded to FP32 (within one ulp), then an exact fix-up: the result r is correct iff v lies
    between the squares of the midpoints on either side of r; a midpoint has 25 significant bits,
    so its square is exact in FP64, and v can never equal one (no ties).
    """
    r = torch.sqrt(v.double()).float()
    inf = torch.full_like(r, float("inf"))
    up = torch.nextafter(r, inf)
    down = torch.nextafter(r, -inf)
    hi = (r.double() + up.double()) * 0.5
    lo = (r.double() + down.double()) * 0.5
    vd = v.double()
    fix = (v > 0) & (v < inf)  # zeros, negatives, Inf and NaN are exact already
    r = torch.where(fix & (vd > hi * hi), up, r)
    return torch.where(fix & (vd < lo * lo), down, r)


def rsqrt(v: torch.Tensor) -> torch.Tensor:
    return _f32(1.0, v) / sqrt(v)


def mean_of_squares(x: torch.Tensor) -> torch.Tensor:
    """mean(x*x) over the last dim, kept with size 1, summed in the order described at REDUCE_LANES."""
    n = x.shape[-1]
    if n == 0:  # the mean of nothing: NaN, as torch's mean gives (the rows it scales are empty)
        return (x * x).sum(-1, keepdim=True) / _f32(0.0, x)
    pad = (-n) % REDUCE_LANES
    sq = x * x
    if pad:
        sq = torch.nn.functional.pad(sq, (0, pad))
    chunks = sq.reshape(*sq.shape[:-1], (n + pad) // REDUCE_LANES, REDUCE_LANES)  # explicit: rows may be 0
    acc = chunks[..., 0, :]
    for k in range(1, chunks.shape[-2]):
        acc = acc + chunks[..., k, :]
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2]
    return acc / _f32(float(n), x)


# An FP64 sum rounded to FP32 can round twice (wrongly) only where it lands exactly on an FP32 midpoint (the
# low 29 bits of its significand are 1 followed by zeros) or where the result is an FP32 subnormal: those
# elements take the careful path (zero, below the subnormal bound too, is exact: dot_fma lets it take the path,
# harmlessly, which saves a pass).
_MIDPOINT_MASK, _MIDPOINT = 0x1FFFFFFF, 0x10000000
_ABS_BITS = 0x7FFFFFFFFFFFFFFF
_TINY_BITS = 898 << 52  # 2**-125 as FP64 bits


def _fma_fast(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP64 product and sum, the sum rounded to FP32, and where that may round twice: an FP32
    midpoint or an FP32 subnormal (see _MIDPOINT_MASK)."""
    p = a.double() * b.double()
    s = p + c.double()
    bits = s.view(torch.int64)
    careful = ((bits & _MIDPOINT_MASK) == _MIDPOINT) | (((bits & _ABS_BITS) < _TINY_BITS) & (s != 0))
    return s.float(), careful


def _settle(r: torch.Tensor, careful: torch.Tensor, p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``r`` (the FP64 sum ``p + c`` rounded to FP32; ``p``, ``c`` FP64, broadcastable to ``r``) with its
    ``careful`` elements correctly rounded: where the FP64 sum was an FP32 midpoint but the exact sum is not,
    the sum's error ``e`` (TwoSum, exact) moves it one FP64 ulp toward the exact value (round to odd) before
    the final rounding."""
    idx = careful.nonzero(as_tuple=True)
    shape = r.shape
    pp = p.expand(shape)[idx]
    cc = c.expand(shape)[idx]
    ss = pp + cc
    bp = ss - cc
    e = (pp - bp) + (cc - (ss - bp))
    sb = ss.view(torch.int64)
    inexact_even = torch.isfinite(ss) & (e != 0) & ((sb & 1) == 0)
    if not bool(inexact_even.any()):
        return r  # exact midpoints (and zeros): rounding s once was right
    away = (e > 0) == (ss > 0)  # moving toward e increases |s|
    sb = torch.where(inexact_even, sb + torch.where(away, 1, -1), sb)
    r = r.clone()
    r[idx] = sb.view(torch.float64).float()
    return r


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 fused multiply-add ``a*b + c`` (one rounding), on any device.

    The product of two FP32 values is exact in FP64, and ``s = p + c`` in FP64 is the FP64 value
    nearest the exact sum. Rounding ``s`` to FP32 gives the correct result unless ``s`` is exactly
    halfway between two FP32 values while the exact sum is not (rounding twice): only then is the
    sum's error needed (:func:`_settle`). FP32 subnormal results take the same careful path.
    """
    r, careful = _fma_fast(a, b, c)
    if not bool(careful.any()):
        return r
    return _settle(r, careful, a.double() * b.double(), c.double())


def dot_fma(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_k a[..., i, k] * b[..., k, j]`` in FP32 as a chain of fused multiply-adds from k = 0 and zero:
    ``acc = fma(a[..., i, k], b[..., k, j], acc)``, the bits of :func:`fma` step by step (FP32 ``a``, ``b``),
    in fewer passes: the operands converted to FP64 once, and each step's FP64 sum, careful-path test and
    rounding written into buffers allocated once (about 5x faster than calling :func:`fma` per step on CPU)."""
    ad, bd = a.double(), b.double()
    shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    acc = torch.zeros(shape, dtype=torch.float32, device=a.device)
    s = torch.empty(shape, dtype=torch.float64, device=a.device)
    bits = s.view(torch.int64)
    masked = torch.empty(shape, dtype=torch.int64, device=a.device)
    careful = torch.empty(shape, dtype=torch.bool, device=a.device)
    tiny = torch.empty(shape, dtype=torch.bool, device=a.device)
    for k in range(a.shape[-1]):
        x, y = ad[..., :, k:k + 1], bd[..., k:k + 1, :]
        torch.mul(x, y, out=s)  # exact: the product of two FP32 values fits FP64's significand
        s.add_(acc)  # the FP64 sum, rounded once
        torch.bitwise_and(bits, _MIDPOINT_MASK, out=masked)
        torch.eq(masked, _MIDPOINT, out=careful)
        torch.bitwise_and(bits, _ABS_BITS, out=masked)
        torch.lt(masked, _TINY_BITS, out=tiny)
        careful.logical_or_(tiny)
        if bool(careful.any()):
            acc = _settle(s.float(), careful, x * y, acc.double())
        else:
            acc.copy_(s)
    return acc
