"""RoPE: rotary position embedding of q or k.

    x1, x2 = the two halves of x (neox style) or its even/odd lanes (interleaved style)
    c, s   = cos, sin of position * inv_freq, computed in FP32       # site: cos_sin
    a = x1*c,  b = x2*s,  a' = x2*c,  b' = x1*s                      # site: products
    o1 = a - b,  o2 = a' + b'            (optionally one product kept exact in an FMA)
    out = round(o1, o2)                  (the region output, always rounded)
"""

from __future__ import annotations

import torch

from ..rounding import act_dtype, round_to
from .base import ROUNDED, Point, RegionSpec, site, variant

STYLES = ("neox", "interleaved")


def _canonical(d: dict[str, str]) -> dict[str, str]:
    # An FMA keeps a product exact instead of rounding it to FP32. When the products are rounded
    # to the activation dtype before the add there is nothing to contract, and when cos/sin are
    # in the activation dtype the products of two activation-dtype values are already exact in
    # FP32 (8x8 or 11x11 significant bits), so contraction cannot change any bit.
    if d["products"] == ROUNDED or d["cos_sin"] == ROUNDED:
        d["fma"] = "none"
    return d


SPEC = RegionSpec(
    name="rope",
    title="RoPE",
    doc="Rotary embedding of q and k: out = x*cos + rotate(x)*sin, rounded once at the end.",
    sites=(
        site("cos_sin", "precision of the cos/sin values the rotation multiplies by"),
        site("products", "x*cos and x_rot*sin each rounded to the activation dtype before the add/sub"),
    ),
    variants=(
        variant(
            "fma",
            ("none", "cos", "sin"),
            "multiply-add contraction: none; the x*cos product kept exact inside an FMA; or the x_rot*sin one",
        ),
    ),
    canonical_rules=_canonical,
)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos and sin of shape [*positions.shape, rotary_dim // 2], as HF and vLLM compute them."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    dev = positions.device
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=dev).float() / rotary_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a*b + c with a single rounding to FP32, for FP32 tensors.

    The product is exact in FP64; the sum is rounded to FP64 by round-to-odd (via the TwoSum
    error term), after which one rounding to FP32 is correctly rounded.
    """
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    bits = s.view(torch.int64)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    nxt = torch.nextafter(s, toward)
    odd = torch.where((bits & 1) == 1, s, nxt)
    s = torch.where((err != 0) & torch.isfinite(s), odd, s)
    return s.float()


def _split(x: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    if style == "neox":
        h = x.shape[-1] // 2
        return x[..., :h], x[..., h:]
    return x[..., 0::2], x[..., 1::2]


def _merge(o1: torch.Tensor, o2: torch.Tensor, style: str) -> torch.Tensor:
    if style == "neox":
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def rope_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    point: Point,
    *,
    style: str = "neox",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference RoPE at ``point``.

    x: [*lead, heads, head_dim] in the activation dtype (or FP32 when the previous region hands on
    an FP32 value; then ``dtype`` names the activation dtype). cos/sin: FP32 [*lead, rot/2] (a
    heads axis is added) or already broadcastable to [*lead, heads, rot/2]. Lanes past the rotary
    dim pass through unchanged. Returns the activation dtype.
    """
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    dt = act_dtype(dtype if dtype is not None else x.dtype)
    half = cos.shape[-1]
    rot = 2 * half
    if rot > x.shape[-1]:
        raise ValueError(f"cos/sin cover {rot} lanes but head_dim is {x.shape[-1]}")
    if cos.dim() == x.dim() - 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float()
    xr, xpass = xf[..., :rot], xf[..., rot:]
    c, s = cos.float(), sin.float()
    if point["cos_sin"] == ROUNDED:  # site: cos_sin
        c, s = round_to(c, dt), round_to(s, dt)
    x1, x2 = _split(xr, style)
    fused = point["fma"]
    if point["products"] == ROUNDED:  # site: products
        o1 = round_to(x1 * c, dt) - round_to(x2 * s, dt)
        o2 = round_to(x2 * c, dt) + round_to(x1 * s, dt)
    elif fused == "cos":
        o1 = fma(x1, c, -(x2 * s))
        o2 = fma(x2, c, x1 * s)
    elif fused == "sin":
        o1 = fma(-x2, s, x1 * c)
        o2 = fma(x1, s, x2 * c)
    else:
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
    out = _merge(o1, o2, style)
    if xpass.shape[-1]:
        out = torch.cat((out, xpass), dim=-1)
    return round_to(out, dt).to(dt)  # region output
