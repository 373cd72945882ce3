"""RoPE: Triton kernels, launchers and the autograd Function, for any point of the RoPE lattice;
the same forward and backward as custom ops (``emulator::rope``, for torch.compile).

Semantics: :func:`engineprofiles.regions.rope.rope_ref` (read it side by side; each rounding site
is marked ``# site: <name>`` in both). RoPE has no transcendentals inside (cos/sin come in as FP32
tensors), so the kernel is bit-exact against the reference in both math modes.

Backward: the gradient of the FP32 function with every rounding treated as identity, i.e. the
transposed rotation with the FP32 (unrounded) cos/sin: dx1 = g1*c + g2*s, dx2 = g2*c - g1*s;
lanes past the rotary dim pass the gradient through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engineprofiles.regions import ROUNDED, Point, rope_ref

from . import _backend, tl_rounding
from ._utils import LAUNCH, cast_like, gpu_tiles, is_fp16, kind, kview, next_pow2, owned, point_from_key

FMA_MODES = {"none": 0, "cos": 1, "sin": 2}


@triton.jit
def fma_rn(a, b, c):
    """a*b + c with a single rounding to FP32: a mirror of engineprofiles.regions.rope.fma.

    The product is exact in FP64; the FP64 sum is rounded to odd (TwoSum error term, then the
    neighbour with an odd last bit), after which one rounding to FP32 is correctly rounded.
    """
    p = a.to(tl.float64) * b.to(tl.float64)
    cd = c.to(tl.float64)
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    bits = s.to(tl.int64, bitcast=True)
    # nextafter(s, sign(err) * inf) on the bit pattern: s != 0 whenever err != 0, and adding 1
    # to the integer moves away from zero, subtracting 1 toward it, for either sign.
    nxt = tl.where((err > 0) == (s > 0), bits + 1, bits - 1)
    odd = tl.where((bits & 1) == 1, bits, nxt)
    finite = (bits & 0x7FF0000000000000) != 0x7FF0000000000000
    s = tl.where((err != 0) & finite, odd, bits).to(tl.float64, bitcast=True)
    return s.to(tl.float32)


@triton.jit
def _rope_fwd_kernel(
    X, COS, SIN, Y,
    T, H,
    sx_t, sx_h, sx_d,
    sc_t, sc_h, ss_t, ss_h,
    sy_t, sy_h,
    HALF: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COS_SIN_ROUNDED: tl.constexpr, PRODUCTS_ROUNDED: tl.constexpr, FMA: tl.constexpr,
    ACT_FP16: tl.constexpr, X_KIND: tl.constexpr, Y_KIND: tl.constexpr,
):
    # A tile of BLOCK_T tokens x BLOCK_H heads x BLOCK_HALF rotary pairs; t, h, j broadcast.
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    j = tl.arange(0, BLOCK_HALF)[None, None, :]
    th = (t < T) & (h < H)
    m = th & (j < HALF)
    c = tl.load(COS + t * sc_t + h * sc_h + j, mask=m, other=0.0)
    s = tl.load(SIN + t * ss_t + h * ss_h + j, mask=m, other=0.0)
    if COS_SIN_ROUNDED:  # site: cos_sin
        c = tl_rounding.rne(c, ACT_FP16)
        s = tl_rounding.rne(s, ACT_FP16)
    if INTERLEAVED:
        d1 = 2 * j
        d2 = 2 * j + 1
    else:
        d1 = j
        d2 = j + HALF
    xrow = X + t * sx_t + h* sx_h
    x1 = tl_rounding.load(xrow + d1 * sx_d, m, X_KIND)
    x2 = tl_rounding.load(xrow + d2 * sx_d, m, X_KIND)
    if PRODUCTS_ROUNDED:  # site: products
        o1 = tl_rounding.rne(x1 * c, ACT_FP16) - tl_rounding.rne(x2 * s, ACT_FP16)
        o2 = tl_rounding.rne(x2 * c, ACT_FP16) + tl_rounding.rne(x1 * s, ACT_FP16)
    elif FMA == 1:
        o1 = fma_rn(x1, c, -(x2 * s))
        o2 = fma_rn(x2, c, x1 * s)
    elif FMA == 2:
        o1 = fma_rn(-x2, s, x1 * c)
        o2 = fma_rn(x1, s, x2 * c)
    else:
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
    yrow = Y + t * sy_t + h* sy_h
    tl_rounding.store(yrow + d1, tl_rounding.rne(o1, ACT_FP16), m, Y_KIND)  # region output
    tl_rounding.store(yrow + d2, tl_rounding.rne(o2, ACT_FP16), m, Y_KIND)
    if D > 2 * HALF:  # lanes past the rotary dim pass through (rounded, for an FP32 input)
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, None, :]
        pm = th & (p < D)
        xp = tl_rounding.load(xrow + p * sx_d, pm, X_KIND)
        tl_rounding.store(yrow + p, tl_rounding.rne(xp, ACT_FP16), pm, Y_KIND)


@triton.jit
def _rope_bwd_kernel(
    G, COS, SIN, DX,
    T, H,
    sg_t, sg_h, sg_d,
    sc_t, sc_h, ss_t, ss_h,
    sd_t, sd_h,
    HALF: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr, G_KIND: tl.constexpr, DX_KIND: tl.constexpr,
):
    # A tile of BLOCK_T tokens x BLOCK_H heads x BLOCK_HALF rotary pairs; t, h, j broadcast.
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    j = tl.arange(0, BLOCK_HALF)[None, None, :]
    th = (t < T) & (h < H)
    m = th & (j < HALF)
    c = tl.load(COS + t * sc_t + h * sc_h + j, mask=m, other=0.0)
    s = tl.load(SIN + t * ss_t + h * ss_h + j, mask=m, other=0.0)
    if INTERLEAVED:
        d1 = 2 * j
        d2 = 2 * j + 1
    else:
        d1 = j
        d2 = j + HALF
    grow = G + t * sg_t + h* sg_h
    g1 = tl_rounding.load(grow + d1 * sg_d, m, G_KIND)
    g2 = tl_rounding.load(grow + d2 * sg_d, m, G_KIND)
    dx1 = g1 * c + g2 * s
    dx2 = g2 * c - g1 * s
    drow = DX + t * sd_t + h* sd_h
    tl_rounding.round_store(drow + d1, dx1, m, DX_KIND)
    tl_rounding.round_store(drow + d2, dx2, m, DX_KIND)
    if D > 2 * HALF:
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, None, :]
        pm = th & (p < D)
        gp = tl_rounding.load(grow + p * sg_d, pm, G_KIND)
        tl_rounding.round_store(drow + p, gp, pm, DX_KIND)


# -- launchers ----------------------------------------------------------------------------------
# x3: [T, H, D] (any strides); cs3/sn3: FP32 [T, 1 or H, HALF] (any strides, last one 1).


def _blocks(x3: torch.Tensor, t: int, h: int, half: int, d: int) -> dict[str, int]:
    bh, bhalf = next_pow2(h), next_pow2(half)
    # Tokens per program: a tile of about 4096 rotary pairs on a GPU; in the interpreter, where
    # each program costs milliseconds of Python, as many as fit in 2**16 elements.
    target = 4096 if gpu_tiles(x3) else 1 << 16
    bt = max(1, min(next_pow2(t), target // (bh * bhalf)))
    return {
        "BLOCK_T": bt,
        "BLOCK_H": bh,
        "BLOCK_HALF": bhalf,
        "BLOCK_PASS": next_pow2(d - 2 * half),
        "num_warps": 4,
    }


def _cs_strides(cs3: torch.Tensor) -> tuple[int, int]:
    return cs3.stride(0), (cs3.stride(1) if cs3.shape[1] > 1 else 0)


def rope_fwd(x3: torch.Tensor, cs3: torch.Tensor, sn3: torch.Tensor, point: Point, style: str, act: torch.dtype) -> torch.Tensor:
    t, h, d = x3.shape
    half = cs3.shape[-1]
    y = torch.empty((t, h, d), dtype=act, device=x3.device)
    if t == 0 or h == 0:
        return y
    blocks = _blocks(x3, t, h, half, d)
    _rope_fwd_kernel[(triton.cdiv(t, blocks["BLOCK_T"]),)](
        kview(x3), cs3, sn3, kview(y),
        t, h,
        *x3.stride(),
        *_cs_strides(cs3), *_cs_strides(sn3),
        y.stride(0), y.stride(1),
        HALF=half, D=d,
        INTERLEAVED=style == "interleaved",
        COS_SIN_ROUNDED=point["cos_sin"] == ROUNDED,
        PRODUCTS_ROUNDED=point["products"] == ROUNDED,
        FMA=FMA_MODES[point["fma"]],
        ACT_FP16=is_fp16(act), X_KIND=kind(x3), Y_KIND=kind(y),
        **blocks, **LAUNCH,
    )
    return y


def rope_bwd(g3: torch.Tensor, cs3: torch.Tensor, sn3: torch.Tensor, style: str, dx_dtype: torch.dtype) -> torch.Tensor:
    t, h, d = g3.shape
    half = cs3.shape[-1]
    dx = torch.empty((t, h, d), dtype=dx_dtype, device=g3.device)
    if t == 0 or h == 0:
        return dx
    blocks = _blocks(g3, t, h, half, d)
    _rope_bwd_kernel[(triton.cdiv(t, blocks["BLOCK_T"]),)](
        kview(g3), cs3, sn3, kview(dx),
        t, h,
        *g3.stride(),
        *_cs_strides(cs3), *_cs_strides(sn3),
        dx.stride(0), dx.stride(1),
        HALF=half, D=d,
        INTERLEAVED=style == "interleaved", G_KIND=kind(g3), DX_KIND=kind(dx),
        **blocks, **LAUNCH,
    )
    return dx


def rope_bwd_torch(g3: torch.Tensor, cs3: torch.Tensor, sn3: torch.Tensor, style: str, dx_dtype: torch.dtype) -> torch.Tensor:
    """The backward in torch (the CPU reference path), the same operations as the kernel."""
    half = cs3.shape[-1]
    gf = g3.float()
    gr, gp = gf[..., : 2 * half], gf[..., 2 * half:]
    if style == "neox":
        g1, g2 = gr[..., :half], gr[..., half:]
    else:
        g1, g2 = gr[..., 0::2], gr[..., 1::2]
    c, s = cs3.float(), sn3.float()
    dx1 = g1 * c + g2 * s
    dx2 = g2 * c - g1 * s
    if style == "neox":
        dx = torch.cat((dx1, dx2), dim=-1)
    else:
        dx = torch.stack((dx1, dx2), dim=-1).flatten(-2)
    if gp.shape[-1]:
        dx = torch.cat((dx, gp), dim=-1)
    return cast_like(dx, dx_dtype)


def rope_forward(x3, cs3, sn3, point: Point, style: str, act: torch.dtype, backend: str) -> torch.Tensor:
    """The forward on ``backend``: "triton" (the kernel), or "reference"/"reference-portable"
    (rope_ref; RoPE's math does not depend on the math mode)."""
    if backend == "triton":
        return rope_fwd(x3, cs3, sn3, point, style, act)
    return rope_ref(x3, cs3, sn3, point, style=style, dtype=act)


def rope_backward(gy, cs3, sn3, style: str, x_dtype: torch.dtype, backend: str) -> torch.Tensor:
    if backend == "triton":
        return rope_bwd(gy, cs3, sn3, style, x_dtype)
    return rope_bwd_torch(gy, cs3, sn3, style, x_dtype)


class RoPEFunction(torch.autograd.Function):
    """y = rope(x) at ``point``; x3 [T, H, D], cos/sin FP32 [T, 1 or H, D_rot/2]; ``backend`` as
    in rope_forward."""

    @staticmethod
    def forward(ctx, x3, cs3, sn3, point: Point, style: str, act: torch.dtype, backend: str):
        y = rope_forward(x3, cs3, sn3, point, style, act, backend)
        ctx.save_for_backward(cs3, sn3)
        ctx.style, ctx.backend, ctx.x_dtype = style, backend, x3.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        cs3, sn3 = ctx.saved_tensors
        dx = rope_backward(gy, cs3, sn3, ctx.style, ctx.x_dtype, ctx.backend)
        return dx, None, None, None, None, None, None


# -- torch.compile: the same forward and backward as opaque custom ops (see _utils.point_key) ---


@torch.library.custom_op("emulator::rope", mutates_args=())
def rope_op(x3: torch.Tensor, cs3: torch.Tensor, sn3: torch.Tensor, point: str, style: str, act: torch.dtype,
            backend: str) -> torch.Tensor:
    _backend.check_traced(backend, x3.device)
    return owned(rope_forward(x3, cs3, sn3, point_from_key(point), style, act, backend), x3, cs3, sn3)


@rope_op.register_fake
def _rope_fake(x3, cs3, sn3, point, style, act, backend):
    return x3.new_empty(x3.shape, dtype=act)


@torch.library.custom_op("emulator::rope_bwd", mutates_args=())
def rope_bwd_op(gy: torch.Tensor, cs3: torch.Tensor, sn3: torch.Tensor, style: str, x_dtype: torch.dtype,
                backend: str) -> torch.Tensor:
    return owned(rope_backward(gy, cs3, sn3, style, x_dtype, backend), gy, cs3, sn3)


@rope_bwd_op.register_fake
def _rope_bwd_fake(gy, cs3, sn3, style, x_dtype, backend):
    return gy.new_empty(gy.shape, dtype=x_dtype)


def _rope_setup(ctx, inputs, output):
    x3, cs3, sn3, _, style, _, backend = inputs
    ctx.save_for_backward(cs3, sn3)
    ctx.style, ctx.backend, ctx.x_dtype = style, backend, x3.dtype


def _rope_op_backward(ctx, gy):
    cs3, sn3 = ctx.saved_tensors
    return rope_bwd_op(gy, cs3, sn3, ctx.style, ctx.x_dtype, ctx.backend), None, None, None, None, None, None


rope_op.register_autograd(_rope_op_backward, setup_context=_rope_setup)
