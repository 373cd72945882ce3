"""RoPE kernels in the Triton interpreter: the forward is the reference bit for bit at every point
of the lattice; the backward is the FP32 gradient within its FP32 error bound of FP64 autograd."""

import pytest
import torch
import triton.language as tl

from emulator.ops.rope import fma_rn, rope_bwd, rope_bwd_torch, rope_fwd
from engineprofiles.regions import ROPE_SPEC, STYLES, rope_cos_sin, rope_ref
from engineprofiles.regions.rope import fma
from engineprofiles.rounding import round_to, to_act

from ..conftest import DTYPES
from ..error_bounds import Bounded, check_within
from ..helpers import activations, assert_same_bits, interpreted_kernel

# (tokens, heads, head_dim, rotary dim): Qwen2.5-like q (14 heads) and GQA k (2 heads) with
# head_dim 64; a partial rotary dim with pass-through lanes (head_dim 128, rot 96); zero tokens.
SHAPES = [(5, 14, 64, 64), (3, 2, 128, 96), (0, 2, 64, 64)]


def _inputs(t, h, d, rot, dtype, seed, specials=True):
    g = torch.Generator().manual_seed(seed)
    x = activations((t, h, d), dtype, g, specials=specials)
    pos = torch.randint(0, 70_000, (t,), generator=g)  # positions beyond 32k
    cos, sin = rope_cos_sin(pos, rot)
    return x, cos, sin


def _split3(cos, sin):
    return cos.unsqueeze(1), sin.unsqueeze(1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_kernel_matches_reference_for_every_site_choice(dtype, style, shape):
    t, h, d, rot = shape
    x, cos, sin = _inputs(t, h, d, rot, dtype, seed=sum(shape))
    cs3, sn3 = _split3(cos, sin)
    points = ROPE_SPEC.all_points()
    assert len(points) == 6
    for p in points:
        assert_same_bits(rope_fwd(x, cs3, sn3, p, style, dtype), rope_ref(x, cos, sin, p, style=style), p.label())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_kernel_takes_an_fp32_input_handed_on_by_a_fused_qk_norm(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, 64, generator=g) * 2  # FP32, not representable in the activation dtype
    cos, sin = rope_cos_sin(torch.tensor([0, 1, 40_000, 131_071]), 64)
    for p in ROPE_SPEC.all_points():
        want = rope_ref(x, cos, sin, p, dtype=dtype)
        assert_same_bits(rope_fwd(x, *_split3(cos, sin), p, "neox", dtype), want, p.label())


@interpreted_kernel
def _fma_kernel(A, B, C, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(A + offs, mask=m)
    b = tl.load(B + offs, mask=m)
    c = tl.load(C + offs, mask=m)
    tl.store(OUT + offs, fma_rn(a, b, c), mask=m)


def test_kernel_fma_is_the_references_single_rounding_fma_including_traps():
    """fma_rn (FP64 product, round-to-odd sum, one rounding to FP32) against the reference's fma
    on random triples, near-cancellations (c = -a*b rounded) and ties of the final rounding."""
    g = torch.Generator().manual_seed(3)
    n = 1 << 14
    a = torch.randn(n, generator=g) * torch.logspace(-20, 20, n)
    b = torch.randn(n, generator=g)
    c = torch.randn(n, generator=g) * 1e3
    c[: n // 4] = -(a[: n // 4] * b[: n // 4])  # cancellation: the result is the product's rounding error
    # Ties: a*b exactly halfway between two FP32 values once c is added (a, b with 12-bit mantissas).
    ia = torch.randint(2**11, 2**12, (n // 4,), generator=g).float()
    ib = torch.randint(2**11, 2**12, (n // 4,), generator=g).float()
    a[n // 4: n // 2], b[n // 4: n // 2], c[n // 4: n // 2] = ia, ib, 2.0**25
    special = torch.tensor([float("inf"), float("nan"), 0.0, -0.0, 3.4e38, 1e-45])
    a[-6:], b[-6:], c[-6:] = special, special.flip(0), special
    out = torch.empty(n)
    _fma_kernel[(1,)](a, b, c, out, n, BLOCK=n)
    assert_same_bits(out, fma(a, b, c), "fma_rn")
    # The traps are real: somewhere the single rounding differs from rounding the product first.
    assert not torch.equal(out[: n // 2], (a * b + c)[: n // 2])


def _rope64(x, cos, sin, style):
    half = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    xr, xp = x[..., : 2 * half], x[..., 2 * half:]
    x1, x2 = (xr[..., :half], xr[..., half:]) if style == "neox" else (xr[..., 0::2], xr[..., 1::2])
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    o = torch.cat((o1, o2), -1) if style == "neox" else torch.stack((o1, o2), -1).flatten(-2)
    return torch.cat((o, xp), -1)


def _bound(g, cos, sin, style):
    half = cos.shape[-1]
    c, s = Bounded.exact(cos.unsqueeze(1)), Bounded.exact(sin.unsqueeze(1))
    gr = g[..., : 2 * half]
    g1, g2 = (gr[..., :half], gr[..., half:]) if style == "neox" else (gr[..., 0::2], gr[..., 1::2])
    g1, g2 = Bounded.exact(g1), Bounded.exact(g2)
    d1, d2 = g1 * c + g2 * s, g2 * c - g1 * s  # the kernel's formula
    e = torch.cat((d1.e, d2.e), -1) if style == "neox" else torch.stack((d1.e, d2.e), -1).flatten(-2)
    return torch.cat((e, torch.zeros_like(g[..., 2 * half:], dtype=torch.float64)), -1)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_rope_backward_matches_fp64_autograd_within_the_fp32_error_bound(shape, style):
    t, h, d, rot = shape
    x, cos, sin = _inputs(t, h, d, rot, torch.bfloat16, seed=11, specials=False)
    gy = activations((t, h, d), torch.bfloat16, torch.Generator().manual_seed(12), specials=False)
    got = rope_bwd(gy.float(), *_split3(cos, sin), style, torch.float32)  # FP32 in, FP32 out: unrounded
    x64 = x.double().requires_grad_()
    (_rope64(x64, cos.double(), sin.double(), style) * gy.double()).sum().backward()
    bound = _bound(gy.float(), cos, sin, style)
    worst = check_within(got, x64.grad, bound, "rope dx")
    print(f"rope {style} {shape}: worst error / bound = {worst:.3f}")
    # The bound is tight enough to see a rounding site: the gradient with BF16-rounded cos/sin
    # (the forward's cos_sin site kept in the backward) falls outside it.
    cs_r, sn_r = round_to(cos, torch.bfloat16), round_to(sin, torch.bfloat16)
    wrong = rope_bwd(gy.float(), *_split3(cs_r, sn_r), style, torch.float32)
    with pytest.raises(AssertionError):
        check_within(wrong, x64.grad, bound, "rope dx with rounded cos/sin")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", STYLES)
def test_rope_backward_in_the_activation_dtype_is_the_rounded_fp32_gradient_and_the_torch_backward(style, dtype):
    t, h, d, rot = SHAPES[1]
    x, cos, sin = _inputs(t, h, d, rot, dtype, seed=13)
    gy = activations((t, h, d), dtype, torch.Generator().manual_seed(14))
    cs3, sn3 = _split3(cos, sin)
    got = rope_bwd(gy, cs3, sn3, style, dtype)
    assert_same_bits(got, to_act(rope_bwd(gy.float(), cs3, sn3, style, torch.float32), dtype), "rounded FP32 gradient")
    assert_same_bits(got, rope_bwd_torch(gy, cs3, sn3, style, dtype), "torch backward")


def test_rope_kernel_reads_per_head_cos_sin_and_strided_inputs():
    """cos/sin given per head ([T, H, rot/2]) and x a non-contiguous view (k sliced out of a
    fused qkv projection): the kernel reads strides, no copies."""
    g = torch.Generator().manual_seed(5)
    qkv = activations((6, 3 * 2 * 64), torch.bfloat16, g, specials=False)
    k = qkv[:, 128:256].view(6, 2, 64)
    assert not k.is_contiguous()
    cos, sin = rope_cos_sin(torch.arange(6 * 2).view(6, 2), 64)
    p = ROPE_SPEC.point(cos_sin="fp32", products="fp32", fma="cos")
    assert_same_bits(rope_fwd(k, cos, sin, p, "interleaved", torch.bfloat16), rope_ref(k, cos, sin, p, style="interleaved"))
