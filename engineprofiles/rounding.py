"""Round-to-nearest-even to an activation dtype, done with integer arithmetic.

Every rounding site of every region goes through :func:`round_to`. It takes an FP32 tensor and
returns an FP32 tensor whose values are exactly representable in the activation dtype (BF16 or
FP16), rounded to nearest, ties to even, with NaN kept NaN, +-Inf kept, overflow to +-Inf and
subnormals of the target format handled. The arithmetic is on the FP32 bit pattern, so the result
does not depend on how a device (or the Triton interpreter) implements its float casts.
"""

from __future__ import annotations

import torch

from .errors import UnsupportedDtype
from .names import ACT_DTYPE_NAMES, check_dtype_name

ACT_DTYPES = {name: getattr(torch, name) for name in ACT_DTYPE_NAMES}

# FP16: mantissa bits, minimum normal exponent, largest finite value. (BF16 has FP32's exponent
# range, so it needs none: dropping 16 bits is the whole rounding.) emulator/ops/tl_rounding.py
# takes these constants from here.
FP16_MANT, FP16_EMIN, FP16_MAX = 10, -14, 65504.0
DTYPE_NAMES = {v: k for k, v in ACT_DTYPES.items()}


def act_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype for an activation dtype given as a torch dtype or its name."""
    if isinstance(dtype, str):
        return ACT_DTYPES[check_dtype_name(dtype)]
    if dtype not in DTYPE_NAMES:
        raise UnsupportedDtype(f"activation dtype {dtype} is not supported; use torch.bfloat16 or torch.float16")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[act_dtype(dtype)]


def round_to(x: torch.Tensor, dtype: torch.dtype | str) -> torch.Tensor:
    """Round FP32 values to the nearest value of ``dtype`` (ties to even); the result stays FP32."""
    dtype = act_dtype(dtype)
    if x.dtype != torch.float32:
        raise TypeError(f"round_to expects a float32 tensor, got {x.dtype}")
    if dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.compiler.is_compiling() and _fast_bf16():
        # torch's CPU conversion to BF16 is this rounding (round to nearest even, the carry into the
        # exponent, Inf past the largest value), equal bit for bit to the integer form below on every
        # pattern tests/engineprofiles/test_rounding.py tries, and about 10x faster on small tensors (the
        # probe's MoE reference rounds ~90,000 times). Traced, the integer form: Inductor may drop a
        # conversion round trip unless emulate_precision_casts is on.
        # NaN kept as it came: only where there is one (a NaN makes the sum NaN; the sum is about 1/80 of
        # the cost of isnan + where over every element, which was most of a patched forward's rounding).
        y = x.to(torch.bfloat16).float()
        return torch.where(torch.isnan(x), x, y) if bool(torch.isnan(x.sum())) else y
    return round_bits(x, dtype)


_FAST_BF16: list[bool] = []


def _fast_bf16() -> bool:
    """Whether this CPU's torch conversion to BF16 is :func:`round_bits` on the patterns where an
    implementation could differ (subnormals, which a hardware conversion may flush; ties; the carry into
    the exponent and to Inf; the largest values): checked once per process, else the integer form."""
    if not _FAST_BF16:
        lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
        highs = torch.tensor([0x0000, 0x0001, 0x0040, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x7F7F, 0x7F80,
                              0x8000, 0x8001, 0x807F, 0xBF80, 0xFF7F], dtype=torch.int64)
        pats = ((highs[:, None] << 16) | lows[None, :]).flatten()
        x = torch.where(pats >= 1 << 31, pats - (1 << 32), pats).to(torch.int32).view(torch.float32)
        fast = torch.where(torch.isnan(x), x, x.to(torch.bfloat16).float())  # NaN kept as it came, as round_to does
        _FAST_BF16.append(bool(torch.equal(fast.view(torch.int32), round_bits(x, torch.bfloat16).view(torch.int32))))
    return _FAST_BF16[0]


def round_bits(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`round_to` in integer arithmetic on the FP32 bit pattern (the definition; the Triton kernels'
    tl_rounding is its translation)."""
    bits = x.contiguous().view(torch.int32)
    if dtype == torch.bfloat16:
        # Same exponent range as FP32: add half an ULP minus one plus the kept LSB, then drop the
        # low 16 bits. The carry rounds up into the exponent (and to Inf past the largest value).
        out = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)
        return torch.where(torch.isnan(x), x, out)
    out = _round_fixed_shift(bits, 23 - FP16_MANT)
    exp = ((bits >> 23) & 0xFF) - 127
    special = (exp < FP16_EMIN) | (exp > 15) | (out.abs() > FP16_MAX)  # subnormals, overflow, Inf/NaN
    if bool(special.any()):
        out = torch.where(special, _round_general(x, bits, FP16_MANT, FP16_EMIN, FP16_MAX), out)
    return out


def _round_fixed_shift(bits: torch.Tensor, shift: int) -> torch.Tensor:
    half_minus_one = (1 << (shift - 1)) - 1
    return ((bits + (half_minus_one + ((bits >> shift) & 1))) & ~((1 << shift) - 1)).view(torch.float32)


def _round_general(x: torch.Tensor, bits: torch.Tensor, mant: int, emin: int, fmax: float) -> torch.Tensor:
    """Any FP32 value to a format with ``mant`` mantissa bits and minimum normal exponent ``emin``."""
    sign = bits & torch.tensor(-0x80000000, dtype=torch.int32, device=x.device)
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23) - 127  # unbiased exponent; -127 for FP32 zeros and subnormals
    exp = torch.clamp(exp, min=-126)  # FP32 subnormals share the exponent of the smallest normal
    # Number of low bits of the FP32 pattern dropped: 23 - mant in the normal range of the
    # target, more below it (target subnormals have a fixed quantum 2**(emin - mant)).
    shift = (23 - mant) + torch.clamp(emin - exp, min=0)
    # Beyond 23 dropped bits the implicit bit itself is gone: handled separately below.
    s = torch.clamp(shift, max=23)
    one = torch.ones_like(mag)
    lsb = (mag >> s) & 1
    half_minus_one = (one << (s - 1)) - 1
    rounded = (mag + half_minus_one + lsb) & ~((one << s) - 1)
    # |x| < quantum: the result is 0 or the smallest subnormal of the target.
    quantum_exp = emin - mant
    tiny = exp < quantum_exp
    min_sub = torch.tensor(float(2.0**quantum_exp), dtype=torch.float32, device=x.device).view(torch.int32)
    half_quantum = float(2.0 ** (quantum_exp - 1))
    absx = mag.view(torch.float32)
    tiny_val = torch.where(absx > half_quantum, min_sub.expand_as(mag), torch.zeros_like(mag))
    rounded = torch.where(tiny, tiny_val, rounded)
    out = (rounded | sign).view(torch.float32)
    inf = torch.tensor(float("inf"), device=x.device)
    out = torch.where(out.abs() > fmax, torch.copysign(inf, out), out)
    return torch.where(torch.isnan(x), x, out)  # NaN stays NaN (Inf is handled by the line above)


def to_act(x: torch.Tensor, dtype: torch.dtype | str) -> torch.Tensor:
    """Round FP32 values to ``dtype`` and return a tensor of that dtype (exact conversion)."""
    dtype = act_dtype(dtype)
    return round_to(x.float(), dtype).to(dtype)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two tensors of the same activation dtype.

    Computed on the ordered integer encoding of the values, so it is exact across binades and
    signs. NaN against NaN is 0, NaN against a number is reported as a very large distance.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance needs equal dtypes, got {a.dtype} and {b.dtype}")
    width = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    ia = a.contiguous().view(width).to(torch.int64)
    ib = b.contiguous().view(width).to(torch.int64)
    top = 1 << (16 if width == torch.int16 else 32) - 1
    # Map sign-magnitude to a monotone integer line.
    oa = torch.where(ia < 0, -(ia + top), ia)
    ob = torch.where(ib < 0, -(ib + top), ib)
    d = (oa - ob).abs()
    na, nb = torch.isnan(a), torch.isnan(b)
    d = torch.where(na & nb, torch.zeros_like(d), d)
    d = torch.where(na ^ nb, torch.full_like(d, 1 << 40), d)
    return d
