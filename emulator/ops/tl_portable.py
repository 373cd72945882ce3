"""Portable FP32 math inside Triton kernels: a line-by-line mirror of :mod:`engineprofiles.portable`.

Not a second home of the math: it is its Triton translation (Triton code cannot call torch), with
every constant taken from there, and tests/emulator/ops/test_portable.py checks the two bit for bit.

Every value is a fixed sequence of correctly rounded FP32 additions, multiplications, divisions
(``tl.div_rn``) and square roots (``tl.sqrt_rn``), plus exact bit manipulation. Kernels are
launched with multiply-add contraction disabled (``enable_fp_fusion=False``), so a GPU computes
the same bits as the Triton interpreter and as the torch reference with ``math="portable"``.
Plain ``/``, ``tl.sqrt``, ``tl.rsqrt`` and ``tl.exp`` are approximate on GPUs: never use them here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engineprofiles import portable as _p

LOG2E: tl.constexpr = tl.constexpr(_p.LOG2E)
LN2_HI: tl.constexpr = tl.constexpr(_p.LN2_HI)
LN2_LO: tl.constexpr = tl.constexpr(_p.LN2_LO)
C7: tl.constexpr = tl.constexpr(_p.EXP_COEFFS[0])
C6: tl.constexpr = tl.constexpr(_p.EXP_COEFFS[1])
C5: tl.constexpr = tl.constexpr(_p.EXP_COEFFS[2])
C4: tl.constexpr = tl.constexpr(_p.EXP_COEFFS[3])
C3: tl.constexpr = tl.constexpr(_p.EXP_COEFFS[4])
C2: tl.constexpr = tl.constexpr(_p.EXP_COEFFS[5])
EXP_MAX: tl.constexpr = tl.constexpr(_p.EXP_MAX)
EXP_MIN: tl.constexpr = tl.constexpr(_p.EXP_MIN)
REDUCE_LANES: tl.constexpr = tl.constexpr(_p.REDUCE_LANES)
assert len(_p.EXP_COEFFS) == 6, "portable.exp changed its polynomial: update emulator/ops/tl_portable.py"


@triton.jit
def pow2(k):
    """2**k as FP32 for integral FP32 k in [-126, 127], built from its bit pattern."""
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """portable.exp: Cody-Waite reduction, degree-7 polynomial, exact scaling by 2**n."""
    nan = x != x
    xs = tl.where(nan, 0.0, x)
    xs = tl.minimum(tl.maximum(xs, EXP_MIN), EXP_MAX)
    # tl.floor compiles to cvt.rmi.ftz.f32 on NVIDIA GPUs (subnormals flushed): harmless here,
    # as neither argument of a floor can be subnormal: xs*LOG2E + 0.5 is 0.5, or a multiple of
    # 2**-26 (an FP32 value near -0.5 plus 0.5), or large; n*0.5 is a multiple of 0.5.
    n = tl.floor(xs * LOG2E + 0.5)
    r = (xs - n * LN2_HI) - n * LN2_LO
    p = tl.full(r.shape, C7, tl.float32)
    p = p * r + C6
    p = p * r + C5
    p = p * r + C4
    p = p * r + C3
    p = p * r + C2
    p = p * r + 1.0
    p = p * r + 1.0
    n1 = tl.floor(n * 0.5)
    n2 = n - n1
    out = (p * pow2(n1)) * pow2(n2)
    out = tl.where(x > EXP_MAX, float("inf"), out)
    out = tl.where(x < EXP_MIN, 0.0, out)
    return tl.where(nan, x, out)


@triton.jit
def sigmoid(x):
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp(-x))


@triton.jit
def rsqrt(v):
    """portable.rsqrt: 1 / sqrt(v), both correctly rounded."""
    return tl.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.sqrt_rn(v))


@triton.jit
def lane_accumulate(acc, t, BLOCK_M: tl.constexpr, U: tl.constexpr, LANES: tl.constexpr):
    """acc + chunk 0 + chunk 1 + ... + chunk U-1, in that order, for ``t`` a [BLOCK_M, U*LANES]
    tile of U consecutive chunks of LANES columns and ``acc`` [BLOCK_M, LANES] lane accumulators.

    Loading U chunks at once makes one iteration do U chunks' work (the interpreter's cost is
    per operation, a GPU's per memory transaction). Chunk u is extracted exactly by a sum over
    the U axis of a tile that is zero except at u: x + 0 + ... + 0 == x for every x but -0, and
    acc never is -0 (it starts at +0, and a sum is -0 only when both terms are), so
    acc + x is unchanged either way.
    """
    if U == 1:  # a GPU's tiles (see rmsnorm._tiles): one chunk per load, no extraction
        return acc + t
    t3 = tl.reshape(t, (BLOCK_M, U, LANES))
    u_idx = tl.arange(0, U)[None, :, None]
    for u in tl.static_range(U):
        acc += tl.sum(tl.where(u_idx == u, t3, 0.0), axis=1)
    return acc


@triton.jit
def lane_tree_sum(acc, BLOCK_M: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr):
    """[BLOCK_M, LANES] -> [BLOCK_M]: lanes 2i and 2i+1 added pairwise until one is left.

    With ``acc`` the lane accumulators of portable.mean_of_squares (lane j holds elements j,
    j + LANES, ... added in order, see lane_accumulate) this is its final tree, in the same order.
    """
    for i in tl.static_range(LOG2_LANES):  # unrolled at compile time; the width halves each step
        a, b = tl.split(tl.reshape(acc, (BLOCK_M, LANES >> (i + 1), 2)))
        acc = a + b
    return tl.reshape(acc, (BLOCK_M,))
