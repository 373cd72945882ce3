"""SwiGLU: Triton kernels, launchers and the autograd Function, for any point of the SwiGLU lattice;
the same forward and backward as custom ops (``emulator::swiglu``, for torch.compile).

Semantics: :func:`engineprofiles.regions.swiglu.swiglu_ref` with ``math="portable"`` (read it side
by side; the rounding site is marked ``# site: silu`` in both). The kernel computes silu with the
portable exp, with no contraction, so it is bit-exact to that reference on every backend. The
``fused`` formula (a device library's silu) has no portable definition: like the reference in
portable mode, the kernel computes it as gate / (1 + exp(-gate)).

Backward: the gradient of the FP32 function with rounding treated as identity (every silu
formula is the same function): with sig = 1 / (1 + exp(-g)),
d_up = dy * g*sig and d_gate = (dy * up) * (sig * (1 + g * (1 - sig))).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engineprofiles import portable
from engineprofiles.regions import ROUNDED, Point, swiglu_ref

from . import _backend, tl_portable, tl_rounding
from ._utils import LAUNCH, cast_like, gpu_tiles, is_fp16, kind, kview, next_pow2, owned, point_from_key

SILU_FORMULAS = {"fused": 0, "x_sigmoid": 1, "x_div_1p_exp": 2}


@triton.jit
def _swiglu_fwd_kernel(
    GATE, UP, Y,
    M, N,
    sg_m, sg_n, su_m, su_n, sy_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SILU_ROUNDED: tl.constexpr, SILU_FORMULA: tl.constexpr,
    ACT_FP16: tl.constexpr, G_KIND: tl.constexpr, U_KIND: tl.constexpr, Y_KIND: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    c = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[None, :]
    m = (r < M) & (c < N)
    g = tl_rounding.load(GATE + r * sg_m + c * sg_n, m, G_KIND)
    u = tl_rounding.load(UP + r * su_m + c * su_n, m, U_KIND)
    if SILU_FORMULA == 1:
        a = g * tl_portable.sigmoid(g)
    else:  # fused and x_div_1p_exp
        a = tl.div_rn(g, 1.0 + tl_portable.exp(-g))
    if SILU_ROUNDED:  # site: silu
        a = tl_rounding.rne(a, ACT_FP16)
    tl_rounding.store(Y + r * sy_m + c, tl_rounding.rne(a * u, ACT_FP16), m, Y_KIND)  # region output


@triton.jit
def _swiglu_bwd_kernel(
    GATE, UP, DY, DG, DU,
    M, N,
    sg_m, sg_n, su_m, su_n, sdy_m, sdy_n, sdg_m, sdu_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    G_KIND: tl.constexpr, U_KIND: tl.constexpr, DY_KIND: tl.constexpr, DG_KIND: tl.constexpr,
    DU_KIND: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    c = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[None, :]
    m = (r < M) & (c < N)
    g = tl_rounding.load(GATE + r * sg_m + c * sg_n, m, G_KIND)
    u = tl_rounding.load(UP + r * su_m + c * su_n, m, U_KIND)
    dy = tl_rounding.load(DY + r * sdy_m + c * sdy_n, m, DY_KIND)
    sig = tl_portable.sigmoid(g)
    du = dy * (g * sig)
    dg = (dy * u) * (sig * (1.0 + g * (1.0 - sig)))
    tl_rounding.round_store(DG + r * sdg_m + c, dg, m, DG_KIND)
    tl_rounding.round_store(DU + r * sdu_m + c, du, m, DU_KIND)


# -- launchers ----------------------------------------------------------------------------------
# gate2/up2: [M, N], any strides.


def _grid(x2: torch.Tensor, m: int, n: int) -> tuple[tuple[int, int], dict[str, int]]:
    if gpu_tiles(x2):
        bn = min(next_pow2(n), 1024)
        bm = max(1, 2048 // bn)
    else:  # interpreter: few, large programs
        bn = min(next_pow2(n), 1 << 14)
        bm = max(1, min(next_pow2(m), (1 << 16) // bn))
    return (triton.cdiv(m, bm), triton.cdiv(n, bn)), {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4}


def swiglu_fwd(gate2: torch.Tensor, up2: torch.Tensor, point: Point, act: torch.dtype) -> torch.Tensor:
    m, n = gate2.shape
    y = torch.empty((m, n), dtype=act, device=gate2.device)
    if m == 0 or n == 0:
        return y
    grid, blocks = _grid(gate2, m, n)
    _swiglu_fwd_kernel[grid](
        kview(gate2), kview(up2), kview(y),
        m, n,
        *gate2.stride(), *up2.stride(), y.stride(0),
        SILU_ROUNDED=point["silu"] == ROUNDED, SILU_FORMULA=SILU_FORMULAS[point["silu_formula"]],
        ACT_FP16=is_fp16(act), G_KIND=kind(gate2), U_KIND=kind(up2), Y_KIND=kind(y),
        **blocks, **LAUNCH,
    )
    return y


def swiglu_bwd(gate2: torch.Tensor, up2: torch.Tensor, dy2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = gate2.shape
    dg = torch.empty((m, n), dtype=gate2.dtype, device=gate2.device)
    du = torch.empty((m, n), dtype=up2.dtype, device=up2.device)
    if m == 0 or n == 0:
        return dg, du
    grid, blocks = _grid(gate2, m, n)
    _swiglu_bwd_kernel[grid](
        kview(gate2), kview(up2), kview(dy2), kview(dg), kview(du),
        m, n,
        *gate2.stride(), *up2.stride(), *dy2.stride(), dg.stride(0), du.stride(0),
        G_KIND=kind(gate2), U_KIND=kind(up2), DY_KIND=kind(dy2), DG_KIND=kind(dg), DU_KIND=kind(du),
        **blocks, **LAUNCH,
    )
    return dg, du


def swiglu_bwd_torch(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, math: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward in torch (the CPU reference path). With ``math="portable"`` it is the
    kernel's sequence of operations, bit for bit; with ``"torch"`` the sigmoid is torch's."""
    g, u, d = gate.float(), up.float(), dy.float()
    sig = portable.sigmoid(g) if math == "portable" else torch.sigmoid(g)
    du = d * (g * sig)
    dg = (d * u) * (sig * (1.0 + g * (1.0 - sig)))
    return cast_like(dg, gate.dtype), cast_like(du, up.dtype)


def swiglu_forward(gate2, up2, point: Point, act: torch.dtype, backend: str) -> torch.Tensor:
    """The forward on ``backend``: "triton", "reference" (swiglu_ref with torch math) or
    "reference-portable" (portable math; bit-exact to the kernels)."""
    if backend == "triton":
        return swiglu_fwd(gate2, up2, point, act)
    return swiglu_ref(gate2, up2, point, math="portable" if backend == "reference-portable" else "torch")


def swiglu_backward(gate2, up2, dy, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        return swiglu_bwd(gate2, up2, dy)
    return swiglu_bwd_torch(gate2, up2, dy, "portable" if backend == "reference-portable" else "torch")


class SwiGLUFunction(torch.autograd.Function):
    """y = swiglu(gate, up) at ``point``; gate2/up2 [M, N]; ``backend`` as in swiglu_forward."""

    @staticmethod
    def forward(ctx, gate2, up2, point: Point, act: torch.dtype, backend: str):
        y = swiglu_forward(gate2, up2, point, act, backend)
        ctx.save_for_backward(gate2, up2)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, dy):
        gate2, up2 = ctx.saved_tensors
        dg, du = swiglu_backward(gate2, up2, dy, ctx.backend)
        return dg, du, None, None, None


# -- torch.compile: the same forward and backward as opaque custom ops (see _utils.point_key) ---


@torch.library.custom_op("emulator::swiglu", mutates_args=())
def swiglu_op(gate2: torch.Tensor, up2: torch.Tensor, point: str, act: torch.dtype, backend: str) -> torch.Tensor:
    _backend.check_traced(backend, gate2.device)
    return owned(swiglu_forward(gate2, up2, point_from_key(point), act, backend), gate2, up2)


@swiglu_op.register_fake
def _swiglu_fake(gate2, up2, point, act, backend):
    return gate2.new_empty(gate2.shape, dtype=act)


@torch.library.custom_op("emulator::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(gate2: torch.Tensor, up2: torch.Tensor, dy: torch.Tensor,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = swiglu_backward(gate2, up2, dy, backend)
    return owned(dg, gate2, up2, dy), owned(du, gate2, up2, dy)


@swiglu_bwd_op.register_fake
def _swiglu_bwd_fake(gate2, up2, dy, backend):
    return gate2.new_empty(gate2.shape), up2.new_empty(up2.shape)


def _swiglu_setup(ctx, inputs, output):
    gate2, up2, _, _, backend = inputs
    ctx.save_for_backward(gate2, up2)
    ctx.backend = backend


def _swiglu_op_backward(ctx, dy):
    gate2, up2 = ctx.saved_tensors
    dg, du = swiglu_bwd_op(gate2, up2, dy, ctx.backend)
    return dg, du, None, None, None


swiglu_op.register_autograd(_swiglu_op_backward, setup_context=_swiglu_setup)
