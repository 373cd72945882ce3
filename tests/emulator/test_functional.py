"""The public functional API: dispatch between backends, profiles in every form, the inputs users
have (any leading shape, strided views, zero tokens, GQA, long positions, BF16 and FP16), errors
that say what to do, and the measured residual between torch math and portable math."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from emulator import functional as F
from emulator.errors import BackendError, EmulatorError, InputError, ProfileMismatch, RegionUnavailable
from engineprofiles.errors import EngineProfilesError
from engineprofiles.regions import (
    ADD_SPEC, PLAIN_SPEC, REGIONS, ROPE_SPEC, SWIGLU_SPEC, add_rmsnorm_ref, rmsnorm_ref, rope_cos_sin, rope_ref,
    swiglu_ref,
)
from engineprofiles.regions.swiglu import silu_fp32
from engineprofiles.rounding import ulp_distance
from engineprofiles.store import shipped_names

from ..conftest import synthetic_profile
from .conftest import DTYPES
from .helpers import activations, assert_same_bits

EPS = 1e-6
ROOT = Path(__file__).resolve().parents[2]


def _grads(outputs, inputs, seed=0):
    """Backpropagate fixed random cotangents; the gradients of ``inputs`` (None where none)."""
    g = torch.Generator().manual_seed(seed)
    outs = [o for o in outputs if o.requires_grad]
    cots = [activations(o.shape, o.dtype, g, scale=1.0, specials=False) for o in outs]
    grads = torch.autograd.grad(outs, [i for i in inputs], cots, allow_unused=True)
    return list(grads)


def _run(backend, fn, inputs):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    with F.use_backend(backend):
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = _grads(outs, [t for t in leaves if t.requires_grad])
    return outs, grads


def _assert_backends_agree(fn, inputs, what):
    """The Triton kernels and the portable torch reference: same bits, forward and backward."""
    o1, g1 = _run("triton", fn, inputs)
    o2, g2 = _run("reference-portable", fn, inputs)
    for i, (a, b) in enumerate(zip(o1, o2)):
        assert_same_bits(a, b, f"{what}: output {i}")
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert_same_bits(a, b, f"{what}: gradient {i}")


# -- the inputs users have --------------------------------------------------------------------------


def _leaf(t, grad=True):
    return t.requires_grad_(grad) if t.is_floating_point() else t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["3d_lead", "strided_view", "zero_tokens", "hidden_3584", "hidden_5120"])
def test_rmsnorm_backends_agree_bitwise_on_user_shapes(case, dtype):
    g = torch.Generator().manual_seed(1)
    if case == "3d_lead":
        x = activations((2, 3, 2, 151), dtype, g)
    elif case == "strided_view":  # every other token of a batch: rows are not adjacent
        x = activations((2, 6, 896), dtype, g)[:, ::2]
        assert not x.is_contiguous()
    elif case == "zero_tokens":
        x = activations((0, 896), dtype, g)
    else:
        x = activations((1, int(case.split("_")[1])), dtype, g)
    r = activations(x.shape, dtype, g, scale=10.0)
    w = (1 + 0.1 * torch.randn(x.shape[-1], generator=g)).to(dtype)
    for p in (PLAIN_SPEC.all_points()[0], PLAIN_SPEC.all_points()[-1]):
        _assert_backends_agree(lambda x, w: F.rmsnorm(x, w, EPS, p), [_leaf(x), _leaf(w)], f"rmsnorm {p.label()}")
    for p in (ADD_SPEC.all_points()[0], ADD_SPEC.all_points()[-1]):
        for res in (r, r.float()):
            _assert_backends_agree(
                lambda x, r, w: F.add_rmsnorm(x, r, w, EPS, p), [_leaf(x), _leaf(res), _leaf(w)], f"add_rmsnorm {p.label()}"
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["3d_lead", "fused_gate_up", "zero_tokens"])
def test_swiglu_backends_agree_bitwise_on_user_shapes(case, dtype):
    g = torch.Generator().manual_seed(2)
    if case == "3d_lead":
        gate, up = activations((2, 3, 151), dtype, g), activations((2, 3, 151), dtype, g)
    elif case == "fused_gate_up":
        gu = activations((2, 5, 2 * 896), dtype, g)
        gate, up = gu[..., :896], gu[..., 896:]
    else:
        gate, up = activations((0, 3, 151), dtype, g), activations((0, 3, 151), dtype, g)
    for p in SWIGLU_SPEC.all_points():
        _assert_backends_agree(lambda a, b: F.swiglu(a, b, p), [_leaf(gate.detach()), _leaf(up.detach())], p.label())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_backends_agree_bitwise_for_gqa_heads_long_positions_and_broadcast_cos_sin(style, dtype):
    g = torch.Generator().manual_seed(3)
    b, s, d = 2, 3, 64
    q = activations((b, s, 14, d), dtype, g)
    k = activations((b, s, 2, d), dtype, g)
    pos = torch.tensor([5, 33_000, 131_000])  # one sequence's positions, shared by the batch
    cos, sin = rope_cos_sin(pos, d)  # [s, d/2]: broadcast over the batch
    for p in ROPE_SPEC.all_points():
        for x in (q, k):
            _assert_backends_agree(lambda x: F.rope(x, cos, sin, p, style=style), [_leaf(x.detach())], p.label())
    zero = activations((0, 14, d), dtype, g)
    _assert_backends_agree(lambda x: F.rope(x, cos[:0], sin[:0], p, style=style), [_leaf(zero)], "zero tokens")


def test_gradients_flow_to_every_input_and_not_to_cos_sin():
    g = torch.Generator().manual_seed(4)
    x, r = activations((3, 151), torch.bfloat16, g).requires_grad_(), activations((3, 151), torch.bfloat16, g).requires_grad_()
    w = torch.ones(151, dtype=torch.bfloat16, requires_grad=True)
    with F.use_backend("triton"):
        out, res = F.add_rmsnorm(x, r, w, EPS, ADD_SPEC.all_points()[3])
        (out.float().sum() + res.float().sum()).backward()
        assert x.grad is not None and r.grad is not None and w.grad is not None
        assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
        cos, sin = rope_cos_sin(torch.arange(3), 64)
        cos.requires_grad_()
        q = activations((3, 2, 64), torch.bfloat16, g).requires_grad_()
        F.rope(q, cos, sin, ROPE_SPEC.all_points()[0]).float().sum().backward()
        assert q.grad is not None and cos.grad is None


# -- dispatch ---------------------------------------------------------------------------------------


def test_default_backend_on_cpu_is_the_torch_math_reference():
    g = torch.Generator().manual_seed(5)
    x = activations((4, 151), torch.bfloat16, g)
    r = activations((4, 151), torch.bfloat16, g)
    w = (1 + 0.1 * torch.randn(151, generator=g)).bfloat16()
    p_add, p_plain, p_sw = ADD_SPEC.all_points()[7], PLAIN_SPEC.all_points()[5], SWIGLU_SPEC.all_points()[0]
    assert F.current_backend() == "auto"
    assert_same_bits(F.rmsnorm(x, w, EPS, p_plain), rmsnorm_ref(x, w, EPS, p_plain, math="torch"))
    for got, want in zip(F.add_rmsnorm(x, r, w, EPS, p_add), add_rmsnorm_ref(x, r, w, EPS, p_add, math="torch")):
        assert_same_bits(got, want)
    assert_same_bits(F.swiglu(x, r, p_sw), swiglu_ref(x, r, p_sw, math="torch"))
    cos, sin = rope_cos_sin(torch.arange(4), 64)
    q = activations((4, 2, 64), torch.bfloat16, g)
    assert_same_bits(F.rope(q, cos, sin, ROPE_SPEC.all_points()[1]), rope_ref(q, cos, sin, ROPE_SPEC.all_points()[1]))


def test_environment_variable_selects_the_backend_and_use_backend_overrides_it(monkeypatch):
    g = torch.Generator().manual_seed(6)
    gate, up = activations((3, 151), torch.bfloat16, g), activations((3, 151), torch.bfloat16, g)
    p = SWIGLU_SPEC.point(silu="fp32", silu_formula="fused")
    portable = swiglu_ref(gate, up, p, math="portable")
    torch_math = swiglu_ref(gate, up, p, math="torch")
    assert not torch.equal(portable, torch_math), "inputs must tell the two math modes apart"
    monkeypatch.setenv("EMULATOR_BACKEND", "reference-portable")
    assert F.current_backend() == "reference-portable"
    assert_same_bits(F.swiglu(gate, up, p), portable)
    with F.use_backend("reference"):
        assert_same_bits(F.swiglu(gate, up, p), torch_math)
    monkeypatch.setenv("EMULATOR_BACKEND", "triton")
    assert_same_bits(F.swiglu(gate, up, p), portable)


def test_unknown_backend_names_are_refused():
    with pytest.raises(BackendError, match="choose one of"):
        with F.use_backend("cuda"):
            pass


def test_unknown_backend_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("EMULATOR_BACKEND", "fast")
    with pytest.raises(BackendError, match=r"\$EMULATOR_BACKEND"):
        F.swiglu(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.bfloat16), SWIGLU_SPEC.all_points()[0])


def test_forcing_triton_on_cpu_without_the_interpreter_says_how():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["EMULATOR_BACKEND"] = "triton"
    code = (
        "import torch\n"
        "from emulator import BackendError, functional as F\n"
        "from engineprofiles.regions import SWIGLU_SPEC\n"
        "x = torch.zeros(2, 8, dtype=torch.bfloat16)\n"
        "try:\n"
        "    F.swiglu(x, x, SWIGLU_SPEC.all_points()[0])\n"
        "except BackendError as e:\n"
        "    print('REFUSED:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "REFUSED:" in out.stdout, out.stderr[-2000:]
    assert "TRITON_INTERPRET=1" in out.stdout


# -- profiles ---------------------------------------------------------------------------------------


def test_profile_object_path_shipped_name_and_point_give_the_same_result(tmp_path):
    names = shipped_names()
    assert names, "profiles/ ships profiles"
    name = next(n for n in names if n.endswith("bfloat16"))
    from engineprofiles.store import get_profile

    prof = get_profile(name)
    path = tmp_path / "p.yaml"
    prof.save(path)
    g = torch.Generator().manual_seed(7)
    x, r = activations((3, 151), torch.bfloat16, g), activations((3, 151), torch.bfloat16, g)
    w = torch.ones(151, dtype=torch.bfloat16)
    results = []
    for form in (prof, str(path), path, name, prof.point("add_rmsnorm")):
        out, res = F.add_rmsnorm(x, r, w, EPS, form)
        results.append((out, res))
    for out, res in results[1:]:
        assert_same_bits(out, results[0][0])
        assert_same_bits(res, results[0][1])


def test_a_region_the_profile_records_as_unavailable_is_refused_with_the_reason():
    points = {n: s.all_points()[0] for n, s in REGIONS.items()}
    points["swiglu"] = None
    from engineprofiles.schema import make_profile

    prof = make_profile(
        engine=dict(name="synthetic", version="0", backend="cpu", device="cpu", torch_version="2", execution_mode="eager"),
        dtype="bfloat16",
        points=points,
        evidence={"swiglu": {"status": "unavailable", "reason": "SiluAndMul has no CPU kernel in this build"}},
        provenance=dict(date="2026-12-02T00:00:00Z", probe_version="1", package_version="0.1.0", method="synthetic", command="test"),
    )
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RegionUnavailable, match="no CPU kernel in this build") as e:
        F.swiglu(x, x, prof)
    assert isinstance(e.value, EngineProfilesError)
    assert "swiglu" in str(e.value)


def test_mismatched_points_dtypes_and_shapes_are_refused_with_typed_errors():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ProfileMismatch, match="region 'rmsnorm'"):
        F.rmsnorm(x, w, EPS, ADD_SPEC.all_points()[0])
    prof = synthetic_profile()  # measured in bfloat16
    with pytest.raises(ProfileMismatch, match="bfloat16"):
        F.rmsnorm(x.half(), w.half(), EPS, prof)
    with pytest.raises(InputError, match="weight must have shape"):
        F.rmsnorm(x, torch.ones(7, dtype=torch.bfloat16), EPS, prof)
    with pytest.raises(InputError, match="dtype=torch.bfloat16"):
        F.rmsnorm(x.float(), w, EPS, PLAIN_SPEC.all_points()[0])
    with pytest.raises(InputError, match="cos/sin cover"):
        F.rope(x.view(2, 1, 8), *rope_cos_sin(torch.arange(2), 16), prof)
    with pytest.raises(EmulatorError):
        F.swiglu(x, x[:1], prof)
    with pytest.raises(EngineProfilesError, match="no profile file or shipped profile"):
        F.swiglu(x, x, "no-such-engine-1.0")


@pytest.mark.parametrize("op", ["rope", "swiglu", "rmsnorm", "add_rmsnorm"])
def test_a_list_instead_of_a_tensor_is_an_input_error(op):
    x = torch.zeros(2, 1, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(2), 8)
    prof = synthetic_profile()
    calls = {
        "rope": [lambda: F.rope(x.tolist(), cos, sin, prof), lambda: F.rope(x, cos.tolist(), sin, prof)],
        "swiglu": [lambda: F.swiglu(x.tolist(), x, prof), lambda: F.swiglu(x, x.tolist(), prof)],
        "rmsnorm": [lambda: F.rmsnorm(x.tolist(), w, EPS, prof), lambda: F.rmsnorm(x, w.tolist(), EPS, prof)],
        "add_rmsnorm": [lambda: F.add_rmsnorm(x, x.tolist(), w, EPS, prof), lambda: F.add_rmsnorm(x.tolist(), x, w, EPS, prof)],
    }[op]
    for call in calls:
        with pytest.raises(InputError, match="must be a tensor, got list"):
            call()


@pytest.mark.parametrize("bad", [None, 5, 2.0, ["rope"]], ids=["None", "int", "float", "list"])
def test_a_profile_argument_of_the_wrong_type_is_a_typed_error(bad):
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(EmulatorError, match="a Profile, a path, a shipped name or a lattice Point"):
        F.swiglu(x, x, bad)


@pytest.mark.parametrize("backend", ["reference", "reference-portable", "triton"])
def test_hidden_zero_gives_empty_outputs_on_every_backend(backend):
    # Zero-width rows normalize nothing: every backend returns empty outputs (the portable one
    # used to raise IndexError).
    prof = synthetic_profile()
    x = torch.zeros(3, 0, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(0, dtype=torch.bfloat16, requires_grad=True)
    with F.use_backend(backend):
        y = F.rmsnorm(x, w, EPS, prof)
        out, res = F.add_rmsnorm(x, x, w, EPS, prof)
        s = F.swiglu(x, x, prof)
        (y.float().sum() + out.float().sum() + res.float().sum() + s.float().sum()).backward()
    assert y.shape == out.shape == res.shape == s.shape == (3, 0)
    assert x.grad.shape == (3, 0) and w.grad.shape == (0,)


def test_fp32_input_with_an_explicit_activation_dtype():
    """q/k handed on in FP32 by a q/k norm whose output site is fp32, then RoPE rounds once."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 4, 151, generator=g)
    w = torch.ones(151)
    p_norm = PLAIN_SPEC.point(normalized="rounded", output="fp32")
    y = F.rmsnorm(x.bfloat16(), w.bfloat16(), EPS, p_norm)
    assert y.dtype == torch.float32
    q = torch.randn(3, 2, 64, generator=g)
    cos, sin = rope_cos_sin(torch.arange(3), 64)
    p = ROPE_SPEC.all_points()[0]
    with F.use_backend("triton"):
        got = F.rope(q, cos, sin, p, dtype=torch.bfloat16)
    assert_same_bits(got, rope_ref(q, cos, sin, p, dtype=torch.bfloat16))


# -- torch math vs portable math: measured, not hidden ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_math_and_portable_math_residual_is_measured(dtype, capsys):
    """On CPU the default reference uses torch's exp/sigmoid/rsqrt/mean (what torch-based engines
    compute); the kernels use portable math. The difference is measured here and printed: the
    share of output elements that differ and the largest distance in activation-dtype ulps."""
    g = torch.Generator().manual_seed(9)
    m, n = 64, 896
    gate, up = activations((m, n), dtype, g, specials=False), activations((m, n), dtype, g, specials=False)
    x, r = activations((m, n), dtype, g, specials=False), activations((m, n), dtype, g, scale=10, specials=False)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    lines = []

    def measure(name, a, b):
        d = ulp_distance(a, b)
        count, worst = int((d > 0).sum()), int(d.max())
        unit = "FP32 ulp" if a.dtype == torch.float32 else "ulp"
        lines.append(f"{dtype} {name}: {count} of {d.numel()} elements differ ({count / d.numel():.3%}), max {worst} {unit}")
        return worst

    worst = []
    for formula in ("fused", "x_sigmoid", "x_div_1p_exp"):
        # In FP32 first (silu itself), then at the region output.
        measure(f"silu {formula} in FP32", silu_fp32(gate.float(), formula), silu_fp32(gate.float(), formula, "portable"))
        p = SWIGLU_SPEC.point(silu="fp32", silu_formula=formula)
        worst.append(measure(f"swiglu silu=fp32 {formula}", swiglu_ref(gate, up, p), swiglu_ref(gate, up, p, math="portable")))
    for rstd in ("rsqrt", "reciprocal_sqrt", "divide"):
        p = PLAIN_SPEC.point(normalized="fp32", output="fp32", rstd=rstd)
        measure(f"rmsnorm rstd={rstd} in FP32 (output=fp32)", rmsnorm_ref(x, w, EPS, p), rmsnorm_ref(x, w, EPS, p, math="portable"))
        p = PLAIN_SPEC.point(normalized="fp32", output="rounded", rstd=rstd)
        worst.append(measure(f"rmsnorm normalized=fp32 rstd={rstd}", rmsnorm_ref(x, w, EPS, p), rmsnorm_ref(x, w, EPS, p, math="portable")))
        p = ADD_SPEC.point(variance_input="fp32", normalize_input="fp32", normalized="fp32", residual_out="fp32", rstd=rstd)
        worst.append(
            measure(f"add_rmsnorm all fp32 rstd={rstd}", add_rmsnorm_ref(x, r, w, EPS, p)[0], add_rmsnorm_ref(x, r, w, EPS, p, math="portable")[0])
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    # A few FP32 ulps before one final rounding move an output by at most one activation ulp.
    assert max(worst) <= 1
