"""SwiGLU: the gated activation between the MLP's up/gate projections and its down projection.

    g = silu(gate)                     # site: silu
    out = round(g * up)                (the region output, always rounded)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import portable
from ..rounding import act_dtype, round_to
from .base import ROUNDED, MathMode, Point, RegionSpec, site, variant

SPEC = RegionSpec(
    name="swiglu",
    title="SwiGLU",
    doc="silu(gate) * up, rounded once at the end.",
    sites=(site("silu", "silu(gate) rounded to the activation dtype before it multiplies up"),),
    variants=(
        variant(
            "silu_formula",
            ("fused", "x_sigmoid", "x_div_1p_exp"),
            "how silu is computed: the device library's fused silu, gate*sigmoid(gate), or gate/(1+exp(-gate))",
        ),
    ),
)


def silu_fp32(g: torch.Tensor, formula: str, math: MathMode = "torch") -> torch.Tensor:
    if math == "portable":
        if formula == "x_sigmoid":
            return g * portable.sigmoid(g)
        return g / (1.0 + portable.exp(-g))  # fused and x_div_1p_exp
    if formula == "fused":
        return F.silu(g)
    if formula == "x_sigmoid":
        return g * torch.sigmoid(g)
    return g / (1.0 + torch.exp(-g))


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, point: Point, *, math: MathMode = "torch") -> torch.Tensor:
    """Reference SwiGLU at ``point``; gate and up in the activation dtype, same shape."""
    dt = act_dtype(gate.dtype)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    g = silu_fp32(gate.float(), point["silu_formula"], math)
    if point["silu"] == ROUNDED:  # site: silu
        g = round_to(g, dt)
    return round_to(g * up.float(), dt).to(dt)  # region output
