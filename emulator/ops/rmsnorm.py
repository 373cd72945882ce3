"""RMSNorm and residual-add RMSNorm: Triton kernels, launchers and one autograd Function per form;
the same forwards and backwards as custom ops (``emulator::rmsnorm``, ``emulator::add_rmsnorm``, for
torch.compile).

Semantics: :func:`engineprofiles.regions.rmsnorm.rmsnorm_ref` and ``add_rmsnorm_ref`` with
``math="portable"`` (read them side by side; each rounding site is marked ``# site: <name>`` in
both). The sum of squares is accumulated in portable.REDUCE_LANES lanes (lane j adds elements j,
j + LANES, ... in order) and the lanes are added pairwise; 1/sqrt and x/sqrt are correctly rounded
(``tl.div_rn``, ``tl.sqrt_rn``), so the kernels are bit-exact to that reference on every backend.
``rstd="rsqrt"`` and ``"reciprocal_sqrt"`` are the same in portable math (1 / sqrt_rn).

Backward: the gradient of the FP32 function with every rounding treated as identity (so no site
and no rstd variant changes it). With s = x (+ residual) in FP32, gw = dy * w,
rstd = 1 / sqrt(mean(s*s) + eps), xhat = s * rstd and c = mean(gw * s) * rstd:

    ds = (gw - xhat * c) * rstd  (+ d_residual_out)   -> dx (and d_residual)
    dw = sum over rows of dy * xhat

Row sums use the forward's lane order; dw is summed over rows in the fixed order of
``_utils.row_groups`` (per-program partials, then a sequential sum over programs; no atomics), so
gradients are deterministic and the same on every GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engineprofiles import portable
from engineprofiles.regions import ROUNDED, Point, add_rmsnorm_ref, rmsnorm_ref
from engineprofiles.regions.rmsnorm import _normalize
from engineprofiles.rounding import act_dtype, round_to

from . import _backend, tl_portable, tl_rounding
from ._utils import (
    LANES, LAUNCH, LOG2_LANES, cast_like, gpu_tiles, grouped_row_sum, is_fp16, kind, kview, lane_sum, next_pow2, owned,
    point_from_key, row_groups,
)

RSTD_MODES = {"rsqrt": 0, "reciprocal_sqrt": 1, "divide": 2}


@triton.jit
def _rmsnorm_fwd_kernel(
    X, R, W, Y, RO,
    M, N,
    sx, sr, sy, sro,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    VARIANCE_INPUT_ROUNDED: tl.constexpr, NORMALIZE_INPUT_ROUNDED: tl.constexpr,
    NORMALIZED_ROUNDED: tl.constexpr, OUTPUT_ROUNDED: tl.constexpr, RESIDUAL_OUT_ROUNDED: tl.constexpr,
    RSTD_MODE: tl.constexpr,
    ACT_FP16: tl.constexpr, X_KIND: tl.constexpr, R_KIND: tl.constexpr, W_KIND: tl.constexpr,
    Y_KIND: tl.constexpr, RO_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, U: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr,
):
    r2 = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    offs = tl.arange(0, U * LANES)[None, :]
    # Pass 1: mean of squares; lane j accumulates columns j, j + LANES, ... in order (U chunks
    # of LANES columns per iteration), then the lanes are added pairwise.
    acc = tl.zeros((BLOCK_M, LANES), tl.float32)
    for k in range(0, N, U * LANES):
        cols = k + offs
        m = (r2 < M) & (cols < N)
        x = tl_rounding.load(X + r2 * sx + cols, m, X_KIND)
        if HAS_RESIDUAL:
            s = x + tl_rounding.load(R + r2 * sr + cols, m, R_KIND)
            s_r = tl_rounding.rne(s, ACT_FP16)
            if RESIDUAL_OUT_ROUNDED:  # site: residual_out
                tl_rounding.store(RO + r2 * sro + cols, s_r, m, RO_KIND)
            else:
                tl_rounding.store(RO + r2 * sro + cols, s, m, RO_KIND)
            if VARIANCE_INPUT_ROUNDED:  # site: variance_input
                v = s_r
            else:
                v = s
        else:
            v = x
        acc = tl_portable.lane_accumulate(acc, v * v, BLOCK_M, U, LANES)
    var = tl.div_rn(tl_portable.lane_tree_sum(acc, BLOCK_M, LANES, LOG2_LANES), N.to(tl.float32))
    ve = (var + eps)[:, None]
    if RSTD_MODE == 2:
        den = tl.sqrt_rn(ve)
    else:
        rinv = tl_portable.rsqrt(ve)
    # Pass 2: normalize, scale, round, store.
    for k in range(0, N, U * LANES):
        cols = k + offs
        m = (r2 < M) & (cols < N)
        x = tl_rounding.load(X + r2 * sx + cols, m, X_KIND)
        if HAS_RESIDUAL:
            s = x + tl_rounding.load(R + r2 * sr + cols, m, R_KIND)
            if NORMALIZE_INPUT_ROUNDED:  # site: normalize_input
                u = tl_rounding.rne(s, ACT_FP16)
            else:
                u = s
        else:
            u = x
        if RSTD_MODE == 2:
            n = tl.div_rn(u, den)
        else:
            n = u * rinv
        if NORMALIZED_ROUNDED:  # site: normalized
            n = tl_rounding.rne(n, ACT_FP16)
        y = n * tl_rounding.load(W + cols, cols < N, W_KIND)
        if OUTPUT_ROUNDED:  # site: output (plain form; the add form's output is always rounded)
            y = tl_rounding.rne(y, ACT_FP16)
        tl_rounding.store(Y + r2 * sy + cols, y, m, Y_KIND)


@triton.jit
def _rmsnorm_bwd_stats_kernel(
    X, R, W, DY, RSTD, C,
    M, N,
    sx, sr, sdy,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    X_KIND: tl.constexpr, R_KIND: tl.constexpr, W_KIND: tl.constexpr, DY_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, U: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr,
):
    """Per row: rstd of the FP32 sum s, and c = mean(dy * w * s) * rstd."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    r2 = rows[:, None]
    offs = tl.arange(0, U * LANES)[None, :]
    acc_ss = tl.zeros((BLOCK_M, LANES), tl.float32)
    acc_gs = tl.zeros((BLOCK_M, LANES), tl.float32)
    for k in range(0, N, U * LANES):
        cols = k + offs
        m = (r2 < M) & (cols < N)
        s = tl_rounding.load(X + r2 * sx + cols, m, X_KIND)
        if HAS_RESIDUAL:
            s = s + tl_rounding.load(R + r2 * sr + cols, m, R_KIND)
        gw = tl_rounding.load(DY + r2 * sdy + cols, m, DY_KIND) * tl_rounding.load(W + cols, cols < N, W_KIND)
        acc_ss = tl_portable.lane_accumulate(acc_ss, s * s, BLOCK_M, U, LANES)
        acc_gs = tl_portable.lane_accumulate(acc_gs, gw * s, BLOCK_M, U, LANES)
    nf = N.to(tl.float32)
    ss = tl_portable.lane_tree_sum(acc_ss, BLOCK_M, LANES, LOG2_LANES)
    gs = tl_portable.lane_tree_sum(acc_gs, BLOCK_M, LANES, LOG2_LANES)
    rstd = tl_portable.rsqrt(tl.div_rn(ss, nf) + eps)
    c = tl.div_rn(gs, nf) * rstd
    tl.store(RSTD + rows, rstd, mask=rows < M)
    tl.store(C + rows, c, mask=rows < M)


@triton.jit
def _rmsnorm_bwd_dx_kernel(
    X, R, W, DY, DRO, RSTD, C, DX, DR, PART,
    M, N, P, ROWS_PER_GROUP,
    sx, sr, sdy, sdro, sdx, sdr,
    HAS_RESIDUAL: tl.constexpr, HAS_DRO: tl.constexpr,
    X_KIND: tl.constexpr, R_KIND: tl.constexpr, W_KIND: tl.constexpr, DY_KIND: tl.constexpr,
    DRO_KIND: tl.constexpr, DX_KIND: tl.constexpr, DR_KIND: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """BLOCK_G groups of ROWS_PER_GROUP rows x BLOCK_N columns: dx (and d_residual) of each row,
    and each group's partial sum of dy * xhat over its rows, in row order."""
    grp = (tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    cm = cols < N
    w = tl_rounding.load(W + cols, cm, W_KIND)
    acc = tl.zeros((BLOCK_G, BLOCK_N), tl.float32)
    for i in range(0, ROWS_PER_GROUP):
        row = grp * ROWS_PER_GROUP + i
        m = cm & (row < M)  # past-the-end rows of the last group contribute zeros
        last = tl.minimum(row, M - 1)
        rstd = tl.load(RSTD + last)
        c = tl.load(C + last)
        s = tl_rounding.load(X + row * sx + cols, m, X_KIND)
        if HAS_RESIDUAL:
            s = s + tl_rounding.load(R + row * sr + cols, m, R_KIND)
        dy = tl_rounding.load(DY + row * sdy + cols, m, DY_KIND)
        xhat = s * rstd
        ds = (dy * w - xhat * c) * rstd
        if HAS_DRO:
            ds = ds + tl_rounding.load(DRO + row * sdro + cols, m, DRO_KIND)
        tl_rounding.round_store(DX + row * sdx + cols, ds, m, DX_KIND)
        if HAS_RESIDUAL:
            tl_rounding.round_store(DR + row * sdr + cols, ds, m, DR_KIND)
        acc += dy * xhat
    tl.store(PART + grp * N + cols, acc, mask=cm & (grp < P))


@triton.jit
def _sum_groups_kernel(PART, DW, P, N, DW_KIND: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw = the P group partials added in order, rounded to the weight's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for p in range(0, P):
        acc += tl.load(PART + p * N + cols, mask=cm, other=0.0)
    tl_rounding.round_store(DW + cols, acc, cm, DW_KIND)


# -- launchers ----------------------------------------------------------------------------------
# x2/r2: [M, N] with unit column stride; weight: [N] contiguous.


def _tiles(x2: torch.Tensor, m: int, n: int) -> dict[str, int]:
    """Rows per program and chunks of LANES columns per iteration. Neither changes a bit of the
    result (each row's order is fixed by LANES alone). A GPU gets tiles of 2048 elements; the
    interpreter, where every operation costs ~0.1 ms of Python, the largest tiles that fit."""
    chunks = triton.cdiv(max(n, 1), LANES)
    if gpu_tiles(x2):
        # One chunk of LANES columns per load, 8 rows per program. Extracting chunks from a wider
        # tile (lane_accumulate with U > 1) measured 11x slower forward on an H200
        # (docs/benchmarks.md, "What the first run found").
        u = 1
        bm = max(1, min(next_pow2(m), 2048 // LANES))
    else:
        u = min(next_pow2(chunks), 16)
        bm = max(1, min(next_pow2(m), (1 << 15) // (u * LANES)))
    return {"BLOCK_M": bm, "U": u, "LANES": LANES, "LOG2_LANES": LOG2_LANES}


def _fwd(x2, r2, weight, eps, point: Point, act, has_residual: bool):
    m, n = x2.shape
    if has_residual:
        out_rounded = True
        res_dtype = act if point["residual_out"] == ROUNDED else torch.float32
    else:
        out_rounded = point["output"] == ROUNDED
        res_dtype = None
    y = torch.empty((m, n), dtype=act if out_rounded else torch.float32, device=x2.device)
    ro = torch.empty((m, n), dtype=res_dtype, device=x2.device) if has_residual else None
    if m == 0 or n == 0:
        return y, ro
    tiles = _tiles(x2, m, n)
    _rmsnorm_fwd_kernel[(triton.cdiv(m, tiles["BLOCK_M"]),)](
        kview(x2), kview(r2) if has_residual else x2, kview(weight), kview(y), kview(ro) if has_residual else y,
        m, n,
        x2.stride(0), r2.stride(0) if has_residual else 0, y.stride(0), ro.stride(0) if has_residual else 0,
        eps,
        HAS_RESIDUAL=has_residual,
        VARIANCE_INPUT_ROUNDED=has_residual and point["variance_input"] == ROUNDED,
        NORMALIZE_INPUT_ROUNDED=has_residual and point["normalize_input"] == ROUNDED,
        NORMALIZED_ROUNDED=point["normalized"] == ROUNDED,
        OUTPUT_ROUNDED=out_rounded,
        RESIDUAL_OUT_ROUNDED=has_residual and point["residual_out"] == ROUNDED,
        RSTD_MODE=RSTD_MODES[point["rstd"]],
        ACT_FP16=is_fp16(act), X_KIND=kind(x2), R_KIND=kind(r2) if has_residual else 0, W_KIND=kind(weight),
        Y_KIND=kind(y), RO_KIND=kind(ro) if has_residual else 0,
        **tiles, num_warps=4, **LAUNCH,
    )
    return y, ro


def rmsnorm_fwd(x2, weight, eps: float, point: Point, act: torch.dtype) -> torch.Tensor:
    return _fwd(x2, None, weight, eps, point, act, False)[0]


def add_rmsnorm_fwd(x2, r2, weight, eps: float, point: Point, act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd(x2, r2, weight, eps, point, act, True)


def rmsnorm_bwd(x2, r2, weight, eps: float, dy2, dro2) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dx, d_residual or None, dw) in the dtypes of x, residual and weight."""
    m, n = x2.shape
    has_residual = r2 is not None
    dev = x2.device
    dx = torch.empty((m, n), dtype=x2.dtype, device=dev)
    dr = torch.empty((m, n), dtype=r2.dtype, device=dev) if has_residual else None
    if m == 0 or n == 0:
        return dx, dr, torch.zeros_like(weight)
    rstd = torch.empty(m, dtype=torch.float32, device=dev)
    c = torch.empty(m, dtype=torch.float32, device=dev)
    tiles = _tiles(x2, m, n)
    _rmsnorm_bwd_stats_kernel[(triton.cdiv(m, tiles["BLOCK_M"]),)](
        kview(x2), kview(r2) if has_residual else x2, kview(weight), kview(dy2), rstd, c,
        m, n,
        x2.stride(0), r2.stride(0) if has_residual else 0, dy2.stride(0),
        eps,
        HAS_RESIDUAL=has_residual,
        X_KIND=kind(x2), R_KIND=kind(r2) if has_residual else 0, W_KIND=kind(weight), DY_KIND=kind(dy2),
        **tiles, num_warps=4, **LAUNCH,
    )
    g, p = row_groups(m)
    # Tiles: BLOCK_G groups x BLOCK_N columns; neither changes a bit (see row_groups).
    if gpu_tiles(x2):
        bn, bg = min(next_pow2(n), 1024), 1
    else:
        bn = min(next_pow2(n), 1 << 14)
        bg = max(1, min(next_pow2(p), (1 << 15) // bn))
    part = torch.empty((p, n), dtype=torch.float32, device=dev)
    has_dro = dro2 is not None
    _rmsnorm_bwd_dx_kernel[(triton.cdiv(p, bg), triton.cdiv(n, bn))](
        kview(x2), kview(r2) if has_residual else x2, kview(weight), kview(dy2), kview(dro2) if has_dro else dy2,
        rstd, c, kview(dx), kview(dr) if has_residual else dx, part,
        m, n, p, g,
        x2.stride(0), r2.stride(0) if has_residual else 0, dy2.stride(0), dro2.stride(0) if has_dro else 0,
        dx.stride(0), dr.stride(0) if has_residual else 0,
        HAS_RESIDUAL=has_residual, HAS_DRO=has_dro,
        X_KIND=kind(x2), R_KIND=kind(r2) if has_residual else 0, W_KIND=kind(weight), DY_KIND=kind(dy2),
        DRO_KIND=kind(dro2) if has_dro else 0, DX_KIND=kind(dx), DR_KIND=kind(dr) if has_residual else 0,
        BLOCK_G=bg, BLOCK_N=bn, num_warps=4, **LAUNCH,
    )
    dw = torch.empty_like(weight)
    _sum_groups_kernel[(triton.cdiv(n, bn),)](part, kview(dw), p, n, DW_KIND=kind(dw), BLOCK_N=bn, num_warps=4, **LAUNCH)
    return dx, dr, dw


def rmsnorm_bwd_torch(x2, r2, weight, eps: float, dy2, dro2, math: str):
    """The backward in torch (the CPU reference path). With ``math="portable"`` it is the
    kernels' sequence of operations and summation orders, bit for bit; with ``"torch"`` the
    reductions and rsqrt are torch's."""
    s = x2.float() if r2 is None else x2.float() + r2.float()
    dy = dy2.float()
    w = weight.float()
    gw = dy * w
    if math == "portable":
        nf = torch.tensor(float(s.shape[-1]), dtype=torch.float32, device=s.device)
        eps_t = torch.tensor(eps, dtype=torch.float32, device=s.device)
        rstd = portable.rsqrt(lane_sum(s * s) / nf + eps_t)
        c = (lane_sum(gw * s) / nf) * rstd
    else:
        rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
        c = (gw * s).mean(-1, keepdim=True) * rstd
    xhat = s * rstd
    ds = (gw - xhat * c) * rstd
    if dro2 is not None:
        ds = ds + dro2.float()
    gx = dy * xhat
    dw = grouped_row_sum(gx) if math == "portable" else gx.sum(0)
    dr = cast_like(ds, r2.dtype) if r2 is not None else None
    return cast_like(ds, x2.dtype), dr, cast_like(dw, weight.dtype)


def _math(backend: str) -> str:
    return "portable" if backend == "reference-portable" else "torch"


_COMPILED: dict[str, object] = {}


def rmsnorm_traced(x, weight, eps: float, point: Point, *, math: str = "torch", dtype=None):
    """``rmsnorm_ref`` (torch math) written as an engine writes it for Inductor: each rounding an
    explicit cast (``.to(dtype)``, exact under Inductor's ``emulate_precision_casts``, which a patch
    holds on), not the reference's bit arithmetic. Same values eagerly; traced, Inductor sees the
    engine's graph (a handful of pointwise ops around the reduction), so it fuses and realizes
    buffers as in the engine's graph. Used when a whole patched stack is compiled (exact mode)."""
    dt = dtype if dtype is not None else x.dtype
    xf = x.float()
    n = _normalize(xf, xf, eps, point["rstd"], "torch")  # the reference's own
    if point["normalized"] == ROUNDED:  # site: normalized
        n = n.to(dt).float()
    y = n * weight.float()
    return y.to(dt) if point["output"] == ROUNDED else y  # site: output


def add_rmsnorm_traced(x, residual, weight, eps: float, point: Point, *, math: str = "torch", dtype=None):
    """``add_rmsnorm_ref`` (torch math) in the engine's idiom, as :func:`rmsnorm_traced`."""
    dt = dtype if dtype is not None else x.dtype
    s = x.float() + residual.float()
    s_r = s.to(dt)
    v = s_r.float() if point["variance_input"] == ROUNDED else s  # site: variance_input
    u = s_r.float() if point["normalize_input"] == ROUNDED else s  # site: normalize_input
    n = _normalize(u, v, eps, point["rstd"], "torch")
    if point["normalized"] == ROUNDED:  # site: normalized
        n = n.to(dt).float()
    out = (n * weight.float()).to(dt)
    return out, (s_r if point["residual_out"] == ROUNDED else s)  # site: residual_out


_TRACED = {"rmsnorm_ref": rmsnorm_traced, "add_rmsnorm_ref": add_rmsnorm_traced}


# The references with their FP32/rounded sites as a bool tensor (``flags``) instead of constants, for
# torch.compile: one graph serves every point that shares the constants left (rstd, and the sites that
# change an output's dtype), where the references compile once per point (an in-situ fit tries dozens:
# most of its time was Dynamo and Inductor compiling). Each site is ``torch.where(flag, rounded, fp32)``,
# which selects exactly; Inductor sums the squares in the same order either way, so the bits equal the
# reference compiled at that point (tests/emulator/test_compile.py checks points and widths drawn at random).
def _rmsnorm_flagged(x, weight, eps: float, flags, rstd: str, output: str, dtype):
    xf = x.float()
    n = _normalize(xf, xf, eps, rstd, "torch")
    n = torch.where(flags[0], round_to(n, dtype), n)  # site: normalized
    y = n * weight.float()
    return round_to(y, dtype).to(dtype) if output == ROUNDED else y  # site: output


def _add_rmsnorm_flagged(x, residual, weight, eps: float, flags, rstd: str, residual_out: str, dtype):
    s = x.float() + residual.float()
    s_r = round_to(s, dtype)
    v = torch.where(flags[0], s_r, s)  # site: variance_input
    u = torch.where(flags[1], s_r, s)  # site: normalize_input
    n = _normalize(u, v, eps, rstd, "torch")
    n = torch.where(flags[2], round_to(n, dtype), n)  # site: normalized
    out = round_to(n * weight.float(), dtype).to(dtype)
    return out, (s_r.to(dtype) if residual_out == ROUNDED else s)  # site: residual_out


def _flags(point: Point, sites: tuple[str, ...], device) -> torch.Tensor:
    return torch.tensor([point[s] == ROUNDED for s in sites], dtype=torch.bool, device=device)


def _rmsnorm_compiled(fn):
    def run(x, weight, eps, point, *, math="torch", dtype=None):
        dt = act_dtype(dtype if dtype is not None else x.dtype)
        return fn(x, weight, eps, _flags(point, ("normalized",), x.device), point["rstd"], point["output"], dt)

    return run


def _add_rmsnorm_compiled(fn):
    def run(x, residual, weight, eps, point, *, math="torch", dtype=None):
        dt = act_dtype(dtype if dtype is not None else x.dtype)
        flags = _flags(point, ("variance_input", "normalize_input", "normalized"), x.device)
        return fn(x, residual, weight, eps, flags, point["rstd"], point["residual_out"], dt)

    return run


# reference name: (its flagged form, the call that turns a point into flags and constants)
_FLAGGED = {"rmsnorm_ref": (_rmsnorm_flagged, _rmsnorm_compiled),
            "add_rmsnorm_ref": (_add_rmsnorm_flagged, _add_rmsnorm_compiled)}


def _ref(fn, backend: str):
    """The reference ``fn``, or for backend ``reference-inductor`` the same reference compiled by
    torch.compile (Inductor, dynamic shapes): its FP32 reductions (the mean of squares) then run in
    the order Inductor's generated code sums them, which is what an engine that compiles the model
    with Inductor computes (measured in situ against vLLM's CPU build: docs/mismatch.md). While
    torch.compile traces a whole patched stack (exact mode, see ``patching.forwards.compiled_stack``),
    the reference in the engine's idiom inline, for Inductor to fuse with the rest of the graph."""
    if backend != "reference-inductor":
        return fn
    if torch.compiler.is_compiling():
        return _TRACED[fn.__name__]
    if fn.__name__ not in _COMPILED:
        flagged, call = _FLAGGED[fn.__name__]
        _COMPILED[fn.__name__] = call(torch.compile(flagged, dynamic=True, fullgraph=True))
    compiled = _COMPILED[fn.__name__]

    def run(*args, **kwargs):
        from torch._dynamo import config as dynamo_config

        # one graph per (rstd, dtype-changing sites, eps, dtypes): more than Dynamo's default of 8
        with dynamo_config.patch(cache_size_limit=1024, accumulated_cache_size_limit=4096):
            return compiled(*args, **kwargs)

    return run


def rmsnorm_forward(x2, weight, eps: float, point: Point, act: torch.dtype, backend: str) -> torch.Tensor:
    """The plain form's forward on ``backend``: "triton", "reference" (rmsnorm_ref with torch math)
    or "reference-portable" (portable math; bit-exact to the kernels)."""
    if backend == "triton":
        return rmsnorm_fwd(x2, weight, eps, point, act)
    return _ref(rmsnorm_ref, backend)(x2, weight, eps, point, math=_math(backend), dtype=act)


def add_rmsnorm_forward(x2, r2, weight, eps: float, point: Point, act: torch.dtype,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        return add_rmsnorm_fwd(x2, r2, weight, eps, point, act)
    return _ref(add_rmsnorm_ref, backend)(x2, r2, weight, eps, point, math=_math(backend), dtype=act)


def norm_backward(x2, r2, weight, eps: float, dy, dro, backend: str):
    """(dx, d_residual or None, dw) of either form (r2 None: plain); ``dy`` None: the output got
    no gradient; ``dro`` None: the residual passed on got none."""
    if dy is None:
        dy = torch.zeros(x2.shape, dtype=torch.float32, device=x2.device)
    if backend == "triton":
        return rmsnorm_bwd(x2, r2, weight, eps, dy, dro)
    return rmsnorm_bwd_torch(x2, r2, weight, eps, dy, dro, _math(backend))


class RMSNormFunction(torch.autograd.Function):
    """y = rmsnorm(x) * weight at ``point`` (plain form); x2 [M, N], weight [N]; ``backend`` as in
    rmsnorm_forward."""

    @staticmethod
    def forward(ctx, x2, weight, eps: float, point: Point, act: torch.dtype, backend: str):
        y = rmsnorm_forward(x2, weight, eps, point, act, backend)
        ctx.save_for_backward(x2, weight)
        ctx.eps, ctx.backend = eps, backend
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dx, _, dw = norm_backward(x2, None, weight, ctx.eps, dy, None, ctx.backend)
        return dx, dw, None, None, None, None


class AddRMSNormFunction(torch.autograd.Function):
    """(y, residual_out) = add_rmsnorm(x, residual) at ``point``; x2/r2 [M, N], weight [N]."""

    @staticmethod
    def forward(ctx, x2, r2, weight, eps: float, point: Point, act: torch.dtype, backend: str):
        y, ro = add_rmsnorm_forward(x2, r2, weight, eps, point, act, backend)
        ctx.save_for_backward(x2, r2, weight)
        ctx.eps, ctx.backend = eps, backend
        ctx.set_materialize_grads(False)
        return y, ro

    @staticmethod
    def backward(ctx, dy, dro):
        x2, r2, weight = ctx.saved_tensors
        dx, dr, dw = norm_backward(x2, r2, weight, ctx.eps, dy, dro, ctx.backend)
        return dx, dr, dw, None, None, None, None


# -- torch.compile: the same forwards and backwards as opaque custom ops (see _utils.point_key) -


def _out_dtype(point: Point, act: torch.dtype, site: str) -> torch.dtype:
    return act if point[site] == ROUNDED else torch.float32


@torch.library.custom_op("emulator::rmsnorm", mutates_args=())
def rmsnorm_op(x2: torch.Tensor, weight: torch.Tensor, eps: float, point: str, act: torch.dtype,
               backend: str) -> torch.Tensor:
    _backend.check_traced(backend, x2.device)
    return owned(rmsnorm_forward(x2, weight, eps, point_from_key(point), act, backend), x2, weight)


@rmsnorm_op.register_fake
def _rmsnorm_fake(x2, weight, eps, point, act, backend):
    return x2.new_empty(x2.shape, dtype=_out_dtype(point_from_key(point), act, "output"))


@torch.library.custom_op("emulator::add_rmsnorm", mutates_args=())
def add_rmsnorm_op(x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, eps: float, point: str,
                   act: torch.dtype, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    _backend.check_traced(backend, x2.device)
    y, ro = add_rmsnorm_forward(x2, r2, weight, eps, point_from_key(point), act, backend)
    return owned(y, x2, r2, weight), owned(ro, x2, r2, weight)


@add_rmsnorm_op.register_fake
def _add_rmsnorm_fake(x2, r2, weight, eps, point, act, backend):
    res_dtype = _out_dtype(point_from_key(point), act, "residual_out")
    return x2.new_empty(x2.shape, dtype=act), x2.new_empty(x2.shape, dtype=res_dtype)


@torch.library.custom_op("emulator::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd_op(x2: torch.Tensor, r2: torch.Tensor | None, weight: torch.Tensor, eps: float, dy: torch.Tensor | None,
                   dro: torch.Tensor | None, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both forms' backward: (dx, d_residual, dw); d_residual is an empty tensor for the plain form."""
    dx, dr, dw = norm_backward(x2, r2, weight, eps, dy, dro, backend)
    ins = (x2, r2, weight, dy, dro)
    return owned(dx, *ins), owned(dr, *ins) if dr is not None else x2.new_empty(0), owned(dw, *ins)


@rmsnorm_bwd_op.register_fake
def _rmsnorm_bwd_fake(x2, r2, weight, eps, dy, dro, backend):
    dr = r2.new_empty(r2.shape) if r2 is not None else x2.new_empty(0)
    return x2.new_empty(x2.shape), dr, weight.new_empty(weight.shape)


def _rmsnorm_setup(ctx, inputs, output):
    x2, weight, eps, _, _, backend = inputs
    ctx.save_for_backward(x2, weight)
    ctx.eps, ctx.backend = eps, backend


def _rmsnorm_op_backward(ctx, dy):
    x2, weight = ctx.saved_tensors
    dx, _, dw = rmsnorm_bwd_op(x2, None, weight, ctx.eps, dy, None, ctx.backend)
    return dx, dw, None, None, None, None


def _add_rmsnorm_setup(ctx, inputs, output):
    x2, r2, weight, eps, _, _, backend = inputs
    ctx.save_for_backward(x2, r2, weight)
    ctx.eps, ctx.backend = eps, backend
    ctx.set_materialize_grads(False)  # as AddRMSNormFunction: an output without a gradient adds nothing


def _add_rmsnorm_op_backward(ctx, dy, dro):
    x2, r2, weight = ctx.saved_tensors
    dx, dr, dw = rmsnorm_bwd_op(x2, r2, weight, ctx.eps, dy, dro, ctx.backend)
    return dx, dr, dw, None, None, None, None


rmsnorm_op.register_autograd(_rmsnorm_op_backward, setup_context=_rmsnorm_setup)
add_rmsnorm_op.register_autograd(_add_rmsnorm_op_backward, setup_context=_add_rmsnorm_setup)
