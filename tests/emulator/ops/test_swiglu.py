"""SwiGLU kernels in the Triton interpreter: the forward is the portable reference bit for bit at
every point of the lattice; the backward is the FP32 gradient within its FP32 error bound."""

import pytest
import torch

from emulator.ops.swiglu import swiglu_bwd, swiglu_bwd_torch, swiglu_fwd
from engineprofiles.regions import SWIGLU_SPEC, swiglu_ref
from engineprofiles.rounding import round_to, to_act

from ..conftest import DTYPES
from ..error_bounds import Bounded, check_within
from ..helpers import activations, assert_same_bits

# (rows, intermediate size): odd and Qwen-like widths, a single wide row, zero tokens.
SHAPES = [(5, 151), (3, 896), (1, 16384), (0, 64)]


def _inputs(m, n, dtype, seed, specials=True):
    g = torch.Generator().manual_seed(seed)
    gate = activations((m, n), dtype, g, scale=4.0, specials=specials)
    up = activations((m, n), dtype, g, scale=1.0, specials=specials)
    return gate, up


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_kernel_matches_reference_for_every_site_choice(dtype, shape):
    gate, up = _inputs(*shape, dtype, seed=sum(shape))
    points = SWIGLU_SPEC.all_points()
    assert len(points) == 6
    for p in points:
        want = swiglu_ref(gate, up, p, math="portable")
        assert_same_bits(swiglu_fwd(gate, up, p, dtype), want, p.label())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_kernel_reads_the_halves_of_a_fused_gate_up_projection(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = activations((2, 3, 2 * 151), dtype, g).reshape(6, 302)
    gate, up = gate_up[:, :151], gate_up[:, 151:]
    assert not gate.is_contiguous()
    p = SWIGLU_SPEC.point(silu="rounded", silu_formula="x_sigmoid")
    assert_same_bits(swiglu_fwd(gate, up, p, dtype), swiglu_ref(gate, up, p, math="portable"))


def _swiglu64(gate, up):
    return gate * torch.sigmoid(gate) * up


def _bounds(gate, up, dy):
    g, u, d = Bounded.exact(gate), Bounded.exact(up), Bounded.exact(dy)
    sig = 1.0 / (1.0 + (-g).exp())  # the kernel's formulas, op by op
    du = d * (g * sig)
    dg = (d * u) * (sig * (1.0 + g * (1.0 - sig)))
    return dg.e, du.e


@pytest.mark.parametrize("shape", [(5, 151), (3, 896)], ids=lambda s: "x".join(map(str, s)))
def test_swiglu_backward_matches_fp64_autograd_within_the_fp32_error_bound(shape):
    gate, up = _inputs(*shape, torch.bfloat16, seed=21, specials=False)
    gate[0, :4] = torch.tensor([-30.0, 30.0, -88.0, 15.0])  # saturated sigmoid, exp near its range end
    dy = activations(shape, torch.bfloat16, torch.Generator().manual_seed(22), specials=False)
    dg, du = swiglu_bwd(gate.float(), up.float(), dy.float())  # FP32 in, FP32 out: unrounded
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    (_swiglu64(g64, u64) * dy.double()).sum().backward()
    eg, eu = _bounds(gate.float(), up.float(), dy.float())
    wg = check_within(dg, g64.grad, eg, "swiglu d_gate")
    wu = check_within(du, u64.grad, eu, "swiglu d_up")
    print(f"swiglu {shape}: worst error / bound: d_gate {wg:.3f}, d_up {wu:.3f}")
    # Tight enough to see a rounding site: silu(gate) rounded to BF16 in the backward is outside.
    sig = torch.sigmoid(gate.float())
    du_wrong = dy.float() * round_to(gate.float() * sig, torch.bfloat16)
    with pytest.raises(AssertionError):
        check_within(du_wrong, u64.grad, eu, "swiglu d_up with a rounded silu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_backward_in_the_activation_dtype_is_the_rounded_fp32_gradient_and_the_portable_torch_backward(dtype):
    gate, up = _inputs(5, 151, dtype, seed=23)
    dy = activations((5, 151), dtype, torch.Generator().manual_seed(24))
    dg, du = swiglu_bwd(gate, up, dy)
    dg32, du32 = swiglu_bwd(gate.float(), up.float(), dy.float())
    assert_same_bits(dg, to_act(dg32, dtype), "d_gate rounded")
    assert_same_bits(du, to_act(du32, dtype), "d_up rounded")
    tg, tu = swiglu_bwd_torch(gate, up, dy, "portable")
    assert_same_bits(dg, tg, "d_gate vs torch")
    assert_same_bits(du, tu, "d_up vs torch")
