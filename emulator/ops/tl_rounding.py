"""Round-to-nearest-even inside Triton kernels, with integer arithmetic on the FP32 bit pattern.

Not a second home of the rounding: it is the Triton translation of
:func:`engineprofiles.rounding.round_to` (Triton code cannot call torch), line by line, with the
format constants taken from there, and tests/emulator/ops/test_rne.py checks the two bit for bit on
every special value. Like ``round_to``: the result is an FP32 value
exactly representable in the activation dtype (BF16 or FP16), ties to even, NaN kept NaN, +-Inf
kept, overflow to +-Inf and the target's subnormals handled. Because the rounding is done on
integers, it does not depend on how the device or the Triton interpreter converts floats (the
interpreter *truncates* on ``.to(tl.bfloat16)``). A kernel stores only values that went through
:func:`rne`; converting them to the activation dtype is then exact on every backend.

The only deliberate difference from ``round_to``: a NaN comes out quiet (its quiet bit set), so
that converting it to the activation dtype by truncation (the interpreter) or by ``cvt.rn`` (a
GPU) gives a NaN on both, never an Inf. NaN payloads are not part of the semantics.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from engineprofiles.rounding import FP16_EMIN, FP16_MANT, FP16_MAX


def _bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


# FP16 as FP32 bit patterns: the largest finite value, the smallest subnormal, half of it.
FP16_MANT_C: tl.constexpr = tl.constexpr(FP16_MANT)
FP16_EMIN_C: tl.constexpr = tl.constexpr(FP16_EMIN)
FP16_MAX_BITS: tl.constexpr = tl.constexpr(_bits(FP16_MAX))
FP16_MIN_SUB_BITS: tl.constexpr = tl.constexpr(_bits(2.0 ** (FP16_EMIN - FP16_MANT)))
FP16_HALF_SUB_BITS: tl.constexpr = tl.constexpr(_bits(2.0 ** (FP16_EMIN - FP16_MANT - 1)))


@triton.jit
def _round_to_format(
    x,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    FMAX_BITS: tl.constexpr,
    MIN_SUB_BITS: tl.constexpr,
    HALF_QUANTUM_BITS: tl.constexpr,
):
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23) - 127  # unbiased exponent; -127 for FP32 zeros and subnormals
    exp = tl.maximum(exp, -126)  # FP32 subnormals share the exponent of the smallest normal
    # Low bits of the FP32 pattern dropped: 23 - MANT in the target's normal range, more below.
    shift = (23 - MANT) + tl.maximum(EMIN - exp, 0)
    s = tl.minimum(shift, 23)
    lsb = (mag >> s) & 1
    half_minus_one = (1 << (s - 1)) - 1
    rounded = (mag + half_minus_one + lsb) & ~((1 << s) - 1)
    # |x| below the target's quantum: 0 or the smallest subnormal of the target.
    tiny = exp < (EMIN - MANT)
    tiny_val = tl.where(mag > HALF_QUANTUM_BITS, MIN_SUB_BITS, 0)
    rounded = tl.where(tiny, tiny_val, rounded)
    rounded = tl.where(rounded > FMAX_BITS, 0x7F800000, rounded)  # overflow to Inf (Inf stays Inf)
    out = (rounded | sign).to(tl.float32, bitcast=True)
    quiet = (bits | 0x00400000).to(tl.float32, bitcast=True)
    return tl.where(x != x, quiet, out)  # NaN stays NaN


@triton.jit
def _round_to_bf16(x):
    # _round_to_format with BF16's constants folded. BF16 has FP32's exponent range, so the
    # shift is always 16, nothing is "tiny" (BF16 subnormals are FP32 subnormals with 16 low bits
    # dropped), and overflow needs no test: rounding the largest finite value up carries into
    # the exponent and gives exactly Inf's pattern. The sign bit is never reached by the carry
    # (|pattern| + 0x8000 < 2**31 for non-NaN), so the sign needs no separate handling either.
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    quiet = (bits | 0x00400000).to(tl.float32, bitcast=True)
    return tl.where(x != x, quiet, rounded.to(tl.float32, bitcast=True))


@triton.jit
def rne(x, FP16: tl.constexpr):
    """Round FP32 ``x`` to the nearest BF16 (``FP16`` false) or FP16 value; the result is FP32."""
    if FP16:
        return _round_to_format(x, FP16_MANT_C, FP16_EMIN_C, FP16_MAX_BITS, FP16_MIN_SUB_BITS, FP16_HALF_SUB_BITS)
    else:
        return _round_to_bf16(x)


# -- loads and stores ---------------------------------------------------------------------------
# The interpreter's FP32<->BF16 conversions are wrong for BF16 subnormals (and truncate instead of
# rounding), so BF16 tensors are handed to kernels as int16 views of their bits (see
# ``_utils.kview``) and widened or narrowed here with shifts. FP16 and FP32 tensors are loaded and
# stored as they are: the interpreter converts those with numpy, exactly, and a GPU does too.
# KIND (a constexpr, see ``_utils.kind``): 0 FP32, 1 BF16 (as int16 bits), 2 FP16.


@triton.jit
def load(ptrs, mask, KIND: tl.constexpr):
    """Load and widen to FP32, exactly."""
    if KIND == 1:
        v = tl.load(ptrs, mask=mask, other=0)
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store(ptrs, y, mask, KIND: tl.constexpr):
    """Store an FP32 value that is exactly representable in the destination (already rounded by
    :func:`rne`, or an FP32 destination): the narrowing is exact on every backend."""
    if KIND == 1:
        tl.store(ptrs, (y.to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=mask)
    elif KIND == 2:
        tl.store(ptrs, y.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, y, mask=mask)


@triton.jit
def round_store(ptrs, y, mask, KIND: tl.constexpr):
    """Round an FP32 value to the destination's dtype (RNE) and store it: what a torch cast does."""
    if KIND == 1:
        store(ptrs, rne(y, False), mask, KIND)
    elif KIND == 2:
        store(ptrs, rne(y, True), mask, KIND)
    else:
        store(ptrs, y, mask, KIND)
