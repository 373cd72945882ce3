"""The kernels' portable math is engineprofiles.portable, bit for bit: exp, sigmoid, rsqrt,
correctly rounded division and square root, and the fixed-order lane sums."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from emulator.ops import tl_portable
from emulator.ops._utils import LANES, LOG2_LANES, lane_sum
from engineprofiles import portable

from ..helpers import assert_same_bits, interpreted_kernel


@interpreted_kernel
def _math_kernel(X, Y, E, S, RS, SQ, DV, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + offs, mask=m, other=1.0)
    y = tl.load(Y + offs, mask=m, other=1.0)
    tl.store(E + offs, tl_portable.exp(x), mask=m)
    tl.store(S + offs, tl_portable.sigmoid(x), mask=m)
    tl.store(RS + offs, tl_portable.rsqrt(x), mask=m)
    tl.store(SQ + offs, tl.sqrt_rn(x), mask=m)
    tl.store(DV + offs, tl.div_rn(x, y), mask=m)


@interpreted_kernel
def _mean_sq_kernel(X, OUT, M, N, BLOCK_M: tl.constexpr, U: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r2 = rows[:, None]
    offs = tl.arange(0, U * LANES)[None, :]
    acc = tl.zeros((BLOCK_M, LANES), tl.float32)
    for k in range(0, N, U * LANES):
        cols = k + offs
        x = tl.load(X + r2 * N + cols, mask=(r2 < M) & (cols < N), other=0.0)
        acc = tl_portable.lane_accumulate(acc, x, BLOCK_M, U, LANES)
    tl.store(OUT + rows, tl_portable.lane_tree_sum(acc, BLOCK_M, LANES, LOG2_LANES), mask=rows < M)


def _inputs(n_random: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.72283935546875, 88.7228394,
                             -103.97208404541016, -103.972084, 1e-45, -1e-45, 2.0**-126, 1e3, -1e3, 0.5, -0.5])
    bits = torch.randint(-(2**31), 2**31 - 1, (n_random,), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.cat([specials, torch.randn(n_random, generator=g) * 30, torch.rand(n_random, generator=g) * 1e-3,
                      bits.view(torch.float32)])


def test_kernel_transcendentals_match_portable_math_bit_for_bit():
    x = _inputs(1 << 14, 0)
    y = _inputs(1 << 14, 1)
    n = x.numel()
    e, s, rs, sq, dv = (torch.empty_like(x) for _ in range(5))
    _math_kernel[(triton.cdiv(n, 1 << 15),)](x, y, e, s, rs, sq, dv, n, BLOCK=1 << 15)
    assert_same_bits(e, portable.exp(x), "exp")
    assert_same_bits(s, portable.sigmoid(x), "sigmoid")
    assert_same_bits(rs, portable.rsqrt(x), "rsqrt")
    assert_same_bits(sq, portable.sqrt(x), "sqrt_rn vs portable.sqrt")
    # Correctly rounded: numpy's FP32 sqrt and division are IEEE operations.
    assert_same_bits(sq, torch.from_numpy(np.sqrt(x.numpy())), "sqrt_rn vs IEEE")
    assert_same_bits(dv, torch.from_numpy(x.numpy() / y.numpy()), "div_rn vs IEEE")


def test_portable_exp_is_within_two_ulp_of_exp():
    """Not a kernel property but the premise of the backward tolerances: measured, not assumed."""
    x = torch.linspace(-87.0, 88.0, 200001)
    got = portable.exp(x).double()
    want = torch.exp(x.double())
    ulp = torch.finfo(torch.float32).eps * want.abs()
    assert ((got - want).abs() / ulp).max() < 2.0


@pytest.mark.parametrize("m,n,u", [(3, 1, 1), (5, 151, 1), (3, 896, 2), (2, 896, 4), (1, 3584, 16), (4, 1000, 8)])
def test_lane_sums_are_portable_mean_of_squares_order_for_any_unroll(m, n, u):
    """The lanes hold the same partial sums however many chunks an iteration loads (U), so the
    launchers may pick U freely; the torch mirror lane_sum computes the same bits."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, n, generator=g) * torch.logspace(-3, 3, n)
    sq = x * x
    out = torch.empty(m)
    _mean_sq_kernel[(triton.cdiv(m, 2),)](sq, out, m, n, BLOCK_M=2, U=u, LANES=LANES, LOG2_LANES=LOG2_LANES)
    assert_same_bits(out, lane_sum(sq)[:, 0], "kernel vs lane_sum mirror")
    assert_same_bits((out / torch.tensor(float(n))), portable.mean_of_squares(x)[:, 0], "kernel vs portable.mean_of_squares")
