"""RMSNorm and residual-add RMSNorm kernels in the Triton interpreter: the forward is the portable
reference bit for bit at every point of both lattices; the backward is the FP32 gradient within
its FP32 error bound of FP64 autograd, with deterministic weight gradients."""

import math

import pytest
import torch

from emulator.ops._utils import row_groups
from emulator.ops.rmsnorm import add_rmsnorm_fwd, rmsnorm_bwd, rmsnorm_bwd_torch, rmsnorm_fwd
from engineprofiles.regions import ADD_SPEC, PLAIN_SPEC, add_rmsnorm_ref, rmsnorm_ref
from engineprofiles.rounding import round_to, to_act

from ..conftest import DTYPES
from ..error_bounds import Bounded, check_within, lane_depth
from ..helpers import activations, assert_same_bits

EPS = 1e-6
# (rows, hidden): an odd hidden size, Qwen2.5-0.5B's 896, zero tokens. Hidden 16384 (one row) is
# checked at the lattice's extreme points below: the kernels' column loop does not depend on the
# site choices, which the full lattice exercises at the smaller sizes.
SHAPES = [(5, 151), (3, 896), (0, 896)]


def _inputs(m, n, dtype, seed, specials=True):
    g = torch.Generator().manual_seed(seed)
    x = activations((m, n), dtype, g, specials=specials)
    r = activations((m, n), dtype, g, scale=10.0, specials=specials)
    w = (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    return x, r, w


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_kernel_matches_reference_for_every_site_choice(dtype, shape):
    x, _, w = _inputs(*shape, dtype, seed=sum(shape))
    points = PLAIN_SPEC.all_points()
    assert len(points) == 12
    for p in points:
        assert_same_bits(rmsnorm_fwd(x, w, EPS, p, dtype), rmsnorm_ref(x, w, EPS, p, math="portable"), p.label())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_kernel_matches_reference_for_every_site_choice(dtype, shape):
    """Both outputs (the normalized output and the residual passed on), with the residual coming
    in in the activation dtype and, for an FP32 residual stream, in FP32."""
    x, r, w = _inputs(*shape, dtype, seed=sum(shape) + 1)
    r32 = r.float() * (1 + 2.0**-12)  # not representable in the activation dtype
    points = ADD_SPEC.all_points()
    assert len(points) == 48
    for p in points:
        for res in (r, r32):
            out, res_out = add_rmsnorm_fwd(x, res, w, EPS, p, dtype)
            want_out, want_res = add_rmsnorm_ref(x, res, w, EPS, p, math="portable")
            assert_same_bits(out, want_out, f"output {p.label()} residual {res.dtype}")
            assert_same_bits(res_out, want_res, f"residual out {p.label()} residual {res.dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_kernels_match_reference_on_one_row_of_hidden_16384(dtype):
    x, r, w = _inputs(1, 16384, dtype, seed=16384)
    for spec in (PLAIN_SPEC, ADD_SPEC):
        pts = spec.all_points()
        for p in (pts[0], pts[-1], pts[len(pts) // 2]):
            if spec is PLAIN_SPEC:
                assert_same_bits(rmsnorm_fwd(x, w, EPS, p, dtype), rmsnorm_ref(x, w, EPS, p, math="portable"), p.label())
            else:
                got = add_rmsnorm_fwd(x, r, w, EPS, p, dtype)
                want = add_rmsnorm_ref(x, r, w, EPS, p, math="portable")
                assert_same_bits(got[0], want[0], p.label())
                assert_same_bits(got[1], want[1], p.label())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_kernel_takes_fp32_input_and_fp32_weight(dtype):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 151, generator=g)
    w = 1.0 + 0.1 * torch.randn(151, generator=g)
    for p in PLAIN_SPEC.all_points():
        want = rmsnorm_ref(x, w, EPS, p, math="portable", dtype=dtype)
        assert_same_bits(rmsnorm_fwd(x, w, EPS, p, dtype), want, p.label())


# -- backward ---------------------------------------------------------------------------------------

BWD_EPS = 2.0**-20  # exact in FP32, so FP64 and FP32 add the same eps


def _rms64(x, r, w, eps):
    s = x if r is None else x + r
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w, s


def _bounds(x, r, w, dy, dro, eps):
    """The kernels' backward formulas op by op in Bounded arithmetic (see error_bounds)."""
    m, n = x.shape
    s = Bounded.exact(x) if r is None else Bounded.exact(x) + Bounded.exact(r)
    dyb, wb = Bounded.exact(dy), Bounded.exact(w)
    gw = dyb * wb
    depth = lane_depth(n)
    ss = (s * s).sum(-1, depth).unsqueeze(-1)
    gs = (gw * s).sum(-1, depth).unsqueeze(-1)
    rstd = 1.0 / ((ss / float(n) + eps).sqrt())
    c = (gs / float(n)) * rstd
    xhat = s * rstd
    ds = (gw - xhat * c) * rstd
    if dro is not None:
        ds = ds + Bounded.exact(dro)
    g, p = row_groups(m)
    dw = (dyb * xhat).sum(0, g + p)
    return ds.e, dw.e


@pytest.mark.parametrize("form", ["plain", "add", "add_fp32_residual_out"])
@pytest.mark.parametrize("shape", [(5, 151), (3, 896), (300, 64)], ids=lambda s: "x".join(map(str, s)))
def test_rmsnorm_backward_matches_fp64_autograd_within_the_fp32_error_bound(shape, form):
    """(300 rows make two rows per weight-gradient group, so the group order is exercised.)"""
    m, n = shape
    x, r, w = _inputs(m, n, torch.bfloat16, seed=31, specials=False)
    gen = torch.Generator().manual_seed(32)
    dy = activations(shape, torch.bfloat16, gen, specials=False)
    r = None if form == "plain" else r
    dro = None if form == "plain" else (activations(shape, torch.bfloat16, gen, specials=False).float() * 0.5)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    dx, dr, dw = rmsnorm_bwd(x.float(), f32(r), w.float(), BWD_EPS, dy.float(), dro)  # FP32 in and out
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    r64 = None if r is None else r.double().requires_grad_()
    y, s = _rms64(x64, r64, w64, BWD_EPS)
    loss = (y * dy.double()).sum() + (0 if dro is None else (s * dro.double()).sum())
    loss.backward()
    eds, edw = _bounds(x.float(), f32(r), w.float(), dy.float(), dro, BWD_EPS)
    worst = [check_within(dx, x64.grad, eds, "dx"), check_within(dw, w64.grad, edw, "dw")]
    if r is not None:
        worst.append(check_within(dr, r64.grad, eds, "d_residual"))
    print(f"rmsnorm {form} {shape}: worst error / bound {[round(v, 3) for v in worst]}")
    # Tight enough to see a rounding site: the gradient of the function with s rounded to BF16
    # (the forward's variance_input/normalize_input sites kept in the backward) is outside.
    if r is not None:
        s_r = round_to(x.float() + r.float(), torch.bfloat16)
        wrong, _, _ = rmsnorm_bwd(s_r, None, w.float(), BWD_EPS, dy.float(), None)
        with pytest.raises(AssertionError):
            check_within(wrong + dro, x64.grad, eds, "dx with a rounded residual sum")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["plain", "add", "add_fp32_residual"])
def test_rmsnorm_backward_in_input_dtypes_is_the_rounded_fp32_gradient_and_the_portable_torch_backward(form, dtype):
    m, n = 7, 151
    x, r, w = _inputs(m, n, dtype, seed=41)
    gen = torch.Generator().manual_seed(42)
    dy = activations((m, n), dtype, gen)
    r = {"plain": None, "add": r, "add_fp32_residual": r.float()}[form]
    dro = None if r is None else activations((m, n), dtype, gen).to(r.dtype)
    got = rmsnorm_bwd(x, r, w, EPS, dy, dro)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    ref32 = rmsnorm_bwd(x.float(), f32(r), w.float(), EPS, dy.float(), f32(dro))
    want = rmsnorm_bwd_torch(x, r, w, EPS, dy, dro, "portable")
    for i, name in enumerate(("dx", "d_residual", "dw")):
        if got[i] is None:
            continue
        assert_same_bits(got[i], want[i], f"{name} vs torch")
        target = got[i].dtype
        assert_same_bits(got[i], to_act(ref32[i], target) if target != torch.float32 else ref32[i], f"{name} rounded")


def test_weight_gradient_order_depends_on_the_row_count_only():
    """dw is summed over rows in groups fixed by the row count (row_groups), never by the device
    or the launch: the same inputs give the same bits, and the torch mirror of that order agrees."""
    m, n = 520, 64  # 3 rows per group
    assert row_groups(m) == (math.ceil(m / 256), math.ceil(m / math.ceil(m / 256)))
    x, r, w = _inputs(m, n, torch.bfloat16, seed=51, specials=False)
    dy = activations((m, n), torch.bfloat16, torch.Generator().manual_seed(52), specials=False)
    a = rmsnorm_bwd(x, r, w, EPS, dy, None)[2]
    b = rmsnorm_bwd(x, r, w, EPS, dy, None)[2]
    assert_same_bits(a, b, "run to run")
    assert_same_bits(a, rmsnorm_bwd_torch(x, r, w, EPS, dy, None, "portable")[2], "torch mirror")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_tiles_give_the_same_bits_as_the_interpreter_tiles(dtype, monkeypatch):
    """A GPU launch uses other tiles (one chunk of lanes per load, see rmsnorm._tiles); the
    interpreter runs them too when told to, and they must change no bit of forward or backward.
    (Fails on a tiling that reorders a row's sum: e.g. U > 1 with acc += t instead of extraction.)"""
    from emulator.ops import _utils

    m, n = 9, 600  # more than one row block of 8, a partial last chunk of lanes
    x, r, w = _inputs(m, n, dtype, seed=7)
    dy = activations((m, n), dtype, torch.Generator().manual_seed(8), specials=False)
    ends = [PLAIN_SPEC.all_points()[0], PLAIN_SPEC.all_points()[-1]]
    add_ends = [ADD_SPEC.all_points()[0], ADD_SPEC.all_points()[-1]]

    def run():
        outs = [rmsnorm_fwd(x, w, EPS, p, dtype) for p in ends]
        for p in add_ends:
            outs.extend(add_rmsnorm_fwd(x, r, w, EPS, p, dtype))
        outs.extend(t for t in rmsnorm_bwd(x, r, w, EPS, dy, dy) if t is not None)
        return outs

    want = run()
    monkeypatch.setattr(_utils, "FORCE_GPU_TILES", True)
    got = run()
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same_bits(a, b, f"output {i} with GPU tiles")
