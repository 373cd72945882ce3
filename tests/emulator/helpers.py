"""Shared checks of the emulator tests: bitwise equality and inputs that exercise the kernels."""

from __future__ import annotations

import torch

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal dtypes and shapes, NaN in the same places, every other element bit for bit equal
    (so +0 and -0 differ; NaN payloads are not part of the semantics)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN in {int((gn != wn).sum())} different places"
    gi = got.detach().contiguous().view(_INT[got.dtype])[~gn]
    wi = want.detach().contiguous().view(_INT[want.dtype])[~wn]
    bad = (gi != wi).nonzero().flatten()
    if len(bad):
        g, w = got.detach()[~gn][bad[:5]].tolist(), want.detach()[~wn][bad[:5]].tolist()
        raise AssertionError(f"{what}: {len(bad)} of {gi.numel()} elements differ, e.g. got {g}, want {w}")


def model_state(model):
    """Everything apply_profile could change: per-instance forwards, hooks, classes, parameter bits."""
    mods = {
        n: (m.__dict__.get("forward"), type(m), tuple(m._forward_pre_hooks.items()), tuple(m._forward_hooks.items()),
            sorted(k for k in m.__dict__ if k.startswith("_emulator")))
        for n, m in model.named_modules()
    }
    params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return mods, params


def assert_untouched(model, before):
    mods, params = model_state(model)
    assert mods == before[0], "apply_profile changed a module although it refused the model"
    for n in params:
        assert_same_bits(params[n], before[1][n], n)


def activations(shape, dtype, gen: torch.Generator, scale: float = 3.0, specials: bool = True) -> torch.Tensor:
    """Realistic values plus, when ``specials``, NaN, +-Inf, zeros of both signs, values that
    overflow to Inf when summed or squared, subnormals, and exact rounding ties."""
    x = torch.randn(shape, generator=gen) * scale
    flat = x.view(-1)
    if specials and flat.numel() >= 12:
        big = 6.0e4 if dtype == torch.float16 else 3.0e38
        tiny = 2.0**-20 if dtype == torch.float16 else 2.0**-130
        idx = torch.randperm(flat.numel(), generator=gen)[:12]
        vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, big, -big, tiny, -tiny, 1.0 + 2**-8, 1e-3, 255.5]
        flat[idx] = torch.tensor(vals)
    return x.to(dtype)


def interpreted_kernel(fn):
    """``@triton.jit`` for test-only kernels, always in the interpreter (test modules are
    imported after conftest has put TRITON_INTERPRET back, so plain @triton.jit would compile)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 2.0**-17) -> None:
    """FP32 precision (a gradient, not a rounding claim): within a few FP32 ulps of the tensor's largest
    magnitude (one BF16 ulp is 2**-8), against an FP64 ``want``."""
    err = float((got.double() - want).abs().max())
    scale = float(want.abs().max())
    assert scale > 0, what
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:.3g} * {scale:.3g}"


def on_this_machine(profile, **change):
    """``profile`` (a Profile or a name) as if probed on this machine (engineprofiles.machine), with
    ``change`` (machine fields) applied: exact mode's emulation is then tested on any machine, and its
    refusal of other machines with a field changed."""
    from engineprofiles.machine import this_machine
    from engineprofiles.store import get_profile

    prof = get_profile(profile) if isinstance(profile, str) else profile
    settings = {**prof.engine.settings, **this_machine().settings(), **change}
    return prof.model_copy(update={"engine": prof.engine.model_copy(update={"settings": settings})})
