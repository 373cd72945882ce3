"""The kernels' rounding helper and their loads/stores: bit for bit what engineprofiles.rounding
and torch's casts compute, on every special value, in the Triton interpreter."""

import pytest
import torch
import triton
import triton.language as tl

from emulator.ops import tl_rounding
from emulator.ops._utils import kind, kview
from engineprofiles.rounding import round_to

from ..conftest import DTYPES
from ..helpers import assert_same_bits, interpreted_kernel


@interpreted_kernel
def _round_kernel(X, Y_F32, Y_ACT, n, FP16: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl_rounding.rne(tl.load(X + offs, mask=m, other=0.0), FP16)
    tl.store(Y_F32 + offs, y, mask=m)
    tl_rounding.store(Y_ACT + offs, y, m, KIND)


@interpreted_kernel
def _copy_kernel(X, Y, n, X_KIND: tl.constexpr, Y_KIND: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl_rounding.load(X + offs, m, X_KIND)
    if ROUND:
        tl_rounding.round_store(Y + offs, v, m, Y_KIND)
    else:
        tl_rounding.store(Y + offs, v, m, Y_KIND)


def _special_fp32() -> torch.Tensor:
    base = [0.0, 1.0, 65504.0, 65519.99, 65520.0, 3.3895313892515355e38, 3.3961775292304e38, 3.4028234663852886e38,
            2.0**-14, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 3 * 2.0**-25, 1.5 * 2.0**-24, 2.0**-126, 2.0**-133,
            2.0**-134, 1.5 * 2.0**-134, 2.0**-149, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11, float("inf"), float("nan")]
    x = torch.tensor(base, dtype=torch.float32)
    # Every tie and near-tie around them: the FP32 neighbours of each value.
    bits = x.view(torch.int32)
    near = torch.cat([bits + d for d in (-1, 1)]).view(torch.float32)
    x = torch.cat([x, near])
    return torch.cat([x, -x])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rne_kernel_matches_round_to_on_special_values_and_random_bit_patterns(dtype):
    g = torch.Generator().manual_seed(0)
    rand_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 17,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([_special_fp32(), rand_bits.view(torch.float32), torch.randn(1 << 14, generator=g) * 100])
    n = x.numel()
    y32 = torch.empty_like(x)
    yact = torch.empty(n, dtype=dtype)
    _round_kernel[(triton.cdiv(n, 1 << 14),)](x, y32, kview(yact), n, FP16=dtype == torch.float16, KIND=kind(dtype), BLOCK=1 << 14)
    want = round_to(x, dtype)
    assert_same_bits(y32, want, "rne as FP32")
    assert_same_bits(yact, want.to(dtype), "rne stored in the activation dtype")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loads_and_stores_of_every_16_bit_pattern_are_exact(dtype):
    """Widening every BF16/FP16 bit pattern to FP32 and narrowing it back is exact (the
    interpreter's own BF16 conversions get subnormals wrong; tl_rounding.load/store do not)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    n = x.numel()
    wide = torch.empty(n, dtype=torch.float32)
    back = torch.empty(n, dtype=dtype)
    _copy_kernel[(1,)](kview(x), wide, n, X_KIND=kind(dtype), Y_KIND=0, ROUND=False, BLOCK=1 << 16)
    _copy_kernel[(1,)](wide, kview(back), n, X_KIND=0, Y_KIND=kind(dtype), ROUND=False, BLOCK=1 << 16)
    assert_same_bits(wide, x.float(), "widened")
    assert_same_bits(back, x, "narrowed back")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_store_of_fp32_values_equals_torch_cast(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.cat([_special_fp32(), torch.randn(1 << 14, generator=g) * 1000])
    out = torch.empty(x.numel(), dtype=dtype)
    _copy_kernel[(1,)](x, kview(out), x.numel(), X_KIND=0, Y_KIND=kind(dtype), ROUND=True, BLOCK=1 << 15)
    assert_same_bits(out, x.to(dtype), "round_store")
