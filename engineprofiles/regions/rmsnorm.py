"""Residual RMSNorm and plain RMSNorm.

add_rmsnorm (the residual add fused into the next norm; input and post-attention norms of every
layer after the first, and the final norm):

    s = x + residual                         (FP32)
    s_r = round(s)
    var = mean(v*v), v = s_r or s            # site: variance_input
    n = u * rstd(var + eps), u = s_r or s    # site: normalize_input
    n = round(n)?                            # site: normalized
    out = round(n * weight)                  (region output, feeds a matmul: always rounded)
    residual passed on = s_r or s            # site: residual_out

rmsnorm (no add: the first layer's input norm, Qwen3's q/k norms):

    var = mean(x*x); n = x * rstd(var + eps)
    n = round(n)?                            # site: normalized
    out = n * weight, rounded or handed on in FP32   # site: output
"""

from __future__ import annotations

import torch

from .. import portable
from ..rounding import act_dtype, round_to
from .base import ROUNDED, MathMode, Point, RegionSpec, site, variant

RSTD = variant(
    "rstd",
    ("rsqrt", "reciprocal_sqrt", "divide"),
    "how the normalization divides: x*rsqrt(v), x*(1/sqrt(v)) or x/sqrt(v)",
)

ADD_SPEC = RegionSpec(
    name="add_rmsnorm",
    title="Residual RMSNorm",
    doc="residual add fused into RMSNorm; returns the output and the residual passed on",
    sites=(
        site("variance_input", "the variance is computed from the rounded residual sum (rounded) or the FP32 sum"),
        site("normalize_input", "the normalized output is computed from the rounded residual sum or the FP32 sum"),
        site("normalized", "x*rstd rounded before the weight multiply"),
        site("residual_out", "precision of the residual stream passed on to the next layer"),
    ),
    variants=(RSTD,),
)

PLAIN_SPEC = RegionSpec(
    name="rmsnorm",
    title="RMSNorm (no add)",
    doc="RMSNorm without a residual add (first layer's input norm, Qwen3 q/k norms)",
    sites=(
        site("normalized", "x*rstd rounded before the weight multiply"),
        site("output", "output rounded, or handed on in FP32 to a fused next region (e.g. q/k norm into RoPE)"),
    ),
    variants=(RSTD,),
)


def _normalize(u: torch.Tensor, v: torch.Tensor, eps: float, rstd: str, math: MathMode) -> torch.Tensor:
    if math == "portable":
        var = portable.mean_of_squares(v)  # keeps the reduced dim
        ve = var + torch.tensor(eps, dtype=torch.float32, device=v.device)
        if rstd == "divide":
            return u / portable.sqrt(ve)
        return u * portable.rsqrt(ve)
    var = v.pow(2).mean(-1, keepdim=True)
    ve = var + eps
    if rstd == "rsqrt":
        return u * torch.rsqrt(ve)
    if rstd == "reciprocal_sqrt":
        return u * (1.0 / torch.sqrt(ve))
    return u / torch.sqrt(ve)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape[-1] != x.shape[-1] or weight.dim() != 1:
        raise ValueError(f"weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}")


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, point: Point, *, math: MathMode = "torch",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference RMSNorm (no add) at ``point``. Returns the activation dtype, or FP32 when the
    ``output`` site is fp32."""
    _check(x, weight)
    dt = act_dtype(dtype if dtype is not None else x.dtype)
    xf = x.float()
    n = _normalize(xf, xf, eps, point["rstd"], math)
    if point["normalized"] == ROUNDED:  # site: normalized
        n = round_to(n, dt)
    y = n * weight.float()
    if point["output"] == ROUNDED:  # site: output
        return round_to(y, dt).to(dt)
    return y


def add_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    point: Point,
    *,
    math: MathMode = "torch",
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference residual-add RMSNorm at ``point``.

    x: activation dtype; residual: activation dtype or FP32 (an FP32 residual stream). Returns
    (output in the activation dtype, residual passed on in the activation dtype or FP32).
    """
    _check(x, weight)
    dt = act_dtype(dtype if dtype is not None else x.dtype)
    s = x.float() + residual.float()
    s_r = round_to(s, dt)
    v = s_r if point["variance_input"] == ROUNDED else s  # site: variance_input
    u = s_r if point["normalize_input"] == ROUNDED else s  # site: normalize_input
    n = _normalize(u, v, eps, point["rstd"], math)
    if point["normalized"] == ROUNDED:  # site: normalized
        n = round_to(n, dt)
    out = round_to(n * weight.float(), dt).to(dt)  # region output
    res = s_r.to(dt) if point["residual_out"] == ROUNDED else s  # site: residual_out
    return out, res
