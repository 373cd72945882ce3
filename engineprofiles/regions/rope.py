"""RoPE: rotary position embedding of q or k.

    x1, x2 = the two halves of x (neox style) or its even/odd lanes (interleaved style)
    c, s   = cos, sin of position * inv_freq, computed in FP32       # site: cos_sin
    a = x1*c,  b = x2*s,  a' = x2*c,  b' = x1*s                      # site: products
    o1 = a - b,  o2 = a' + b'            (optionally one product kept exact in an FMA)
    out = round(o1, o2)                  (the region output, always rounded)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


# The rope_type values whose FP32 cos/sin RopeFrequencies reproduces as the engines compute them.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# How an engine builds "dynamic" (NTK) RoPE's fixed base (RopeFrequencies.from_parameters(dynamic=...)):
# vLLM: theta * (factor * max_position / max_trained_positions - (factor - 1)) ** (d / (d - 2)), with
# max_trained_positions defaulting to max_position (so the base is theta unless the parameters name it);
# SGLang: the same over max_position * factor positions (always a scaled base); HF ("transformers"):
# theta while every position lies within the original context (it rescales with the sequence length
# beyond it, which no fixed base reproduces: cos_sin refuses such positions).
DYNAMIC_CONVENTIONS = ("vllm", "sglang", "transformers")
_NOT_SUPPORTED = {
    "longrope": "LongRoPE switches between two sets of frequencies and folds an attention scaling into cos/sin",
}


class RopeParametersError(ValueError):
    """A rope_parameters dict whose cos/sin :class:`RopeFrequencies` does not reproduce."""


@dataclass(frozen=True)
class RopeFrequencies:
    """How the engines compute RoPE's FP32 cos/sin for a model's ``rope_parameters`` (rope_type):

    - ``default``: inv_freq = 1 / theta^(2i/d); angle = position * inv_freq;
    - ``llama3``: inv_freq smoothly divided by ``factor`` by wavelength (Llama 3.1's scaling; engines and
      HF compute the same FP32 operations);
    - ``linear``: angle = (position / factor) * inv_freq, the position scaled (``linear_scales``
      "position": vLLM and SGLang build their cos/sin cache so), or position * (inv_freq / factor), the
      frequency scaled ("frequency": HF transformers), which rounds otherwise unless ``factor`` is a
      power of two;
    - ``yarn``: inv_freq blends 1/pos_freq and 1/(factor*pos_freq) by a linear ramp over the dims
      between the correction range of ``beta_fast`` and ``beta_slow`` rotations in the original
      context; cos and sin are multiplied by ``mscale`` (the attention factor) in FP32 (vLLM, SGLang
      and HF compute the same FP32 operations);
    - ``dynamic``: HF's convention, its base while positions stay within the original context (the
      engines' conventions are ``default`` with their fixed base: :meth:`from_parameters`).

    cos and sin of the FP32 angle, in FP32 (the cos_sin site then decides whether they are rounded)."""

    rotary_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    linear_scales: str = "position"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.linear_scales not in ("position", "frequency"):
            raise ValueError(f"linear_scales must be 'position' or 'frequency', got {self.linear_scales!r}")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"rotary_dim must be even and positive, got {self.rotary_dim}")
        if self.rope_type not in ROPE_TYPES:
            why = _NOT_SUPPORTED.get(self.rope_type, "the RoPE region does not model its frequencies")
            raise RopeParametersError(
                f"rope_type {self.rope_type!r} is not supported ({why}); supported: {', '.join(ROPE_TYPES)}")

    @classmethod
    def from_parameters(cls, rotary_dim: int, params: dict, theta: float | None = None,
                        linear_scales: str = "position", attention_factor: bool = True, dynamic: str | None = None,
                        max_position_embeddings: int | None = None) -> "RopeFrequencies":
        """From a transformers ``config.rope_parameters`` dict (``rope_type``, ``rope_theta``, and the
        scaling fields of that type); ``theta`` when the dict has no ``rope_theta``. ``attention_factor``:
        YaRN's ``attention_factor`` parameter is honoured (vLLM, HF) or ignored, the attention factor then
        computed from ``factor`` (SGLang 0.5.23, measured on its rotary cache). ``dynamic``: the engine
        whose convention a ``dynamic`` rope_type follows (:data:`DYNAMIC_CONVENTIONS`; None: refused, as
        each computes its own base), over ``max_position_embeddings`` (the model config's): vLLM's and
        SGLang's a ``default`` RoPE with their fixed base, HF's its base within the original context."""
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        base = params.get("rope_theta", theta)
        if base is None:
            raise RopeParametersError("the RoPE parameters have no rope_theta")
        kw: dict = {}
        if rope_type == "dynamic":
            return cls._dynamic(rotary_dim, float(base), params, dynamic, max_position_embeddings)
        try:
            if rope_type in ("linear", "llama3", "yarn"):
                kw["factor"] = float(params["factor"])
            if rope_type == "llama3":
                kw.update(low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position_embeddings=int(params["original_max_position_embeddings"]))
            if rope_type == "yarn":
                kw.update(original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                          beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                          truncate=bool(params.get("truncate", True)),
                          mscale=yarn_attention_factor(kw["factor"], params if attention_factor else
                                                       {k: v for k, v in params.items() if k != "attention_factor"}))
        except KeyError as e:
            raise RopeParametersError(f"rope_type {rope_type!r} needs rope_parameters[{e.args[0]!r}]") from None
        return cls(rotary_dim, float(base), rope_type, **kw, linear_scales=linear_scales)

    @classmethod
    def _dynamic(cls, rotary_dim: int, theta: float, params: dict, dynamic: str | None,
                 max_position: int | None) -> "RopeFrequencies":
        if dynamic not in DYNAMIC_CONVENTIONS:
            raise RopeParametersError(
                f"rope_type 'dynamic' needs the engine whose convention it follows ({', '.join(DYNAMIC_CONVENTIONS)}): "
                "each computes its own base")
        if params.get("factor") is None or max_position is None:
            raise RopeParametersError("rope_type 'dynamic' needs rope_parameters['factor'] and the model's "
                                      "max_position_embeddings")
        factor, d = float(params["factor"]), rotary_dim
        if dynamic == "transformers":
            original = int(params.get("original_max_position_embeddings") or max_position)
            return cls(rotary_dim, theta, "dynamic", factor, original_max_position_embeddings=original)
        if dynamic == "vllm":
            trained = params.get("max_trained_positions", max_position)
            base = theta * ((factor * max_position / trained) - (factor - 1)) ** (d / (d - 2))
        else:
            max_len = max_position * factor
            base = theta * ((factor * max_len / max_position) - (factor - 1)) ** (d / (d - 2))
        return cls(rotary_dim, base)

    def default_inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        d = self.rotary_dim
        return 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The FP32 frequencies the angle multiplies (for ``linear`` scaling the position, the unscaled ones)."""
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(device)
        inv = self.default_inv_freq(device)
        if self.rope_type == "linear" and self.linear_scales == "frequency":
            return inv / self.factor
        if self.rope_type != "llama3":
            return inv
        # Llama 3.1: wavelengths shorter than original/high_freq_factor keep their frequency, longer than
        # original/low_freq_factor are divided by factor, and in between blend the two linearly in
        # original/wavelength. FP32 tensor arithmetic with Python-float scalars, in this order.
        orig, low, high, factor = (self.original_max_position_embeddings, self.low_freq_factor,
                                   self.high_freq_factor, self.factor)
        wavelen = 2 * math.pi / inv
        if low != high:
            smooth = (orig / wavelen - low) / (high - low)
        else:  # no band in between (where() never picks it)
            smooth = torch.zeros_like(inv)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wavelen < orig / high, inv, torch.where(wavelen > orig / low, inv / factor, blended))

    def _yarn_inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        # FP32 tensor arithmetic with Python-float scalars, in the engines' order; the correction range
        # in Python floats (double).
        d = self.rotary_dim
        pos_freqs = self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)

        def dim_of(rotations: float) -> float:
            return (d * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
        mask = 1 - ramp
        return interpolation * (1 - mask) + extrapolation * mask

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 cos and sin of shape [*positions.shape, rotary_dim // 2]."""
        t = positions.float()
        if self.rope_type == "linear" and self.linear_scales == "position":
            t = t / self.factor
        if self.rope_type == "dynamic" and positions.numel() and int(positions.max()) >= \
                self.original_max_position_embeddings:
            raise RopeParametersError(
                f"HF's dynamic RoPE rescales its frequencies once a position reaches the original context "
                f"({self.original_max_position_embeddings}); position {int(positions.max())} is beyond what the "
                "emulator reproduces (HF's base within the original context)")
        freqs = t.unsqueeze(-1) * self.inv_freq(positions.device)
        if self.rope_type == "yarn":  # the attention factor, multiplied in FP32
            return freqs.cos() * self.mscale, freqs.sin() * self.mscale
        return freqs.cos(), freqs.sin()

    def args(self) -> tuple:
        """The fields as plain values (for a custom op's arguments), in declaration order."""
        return (self.rotary_dim, self.theta, self.rope_type, self.factor, self.low_freq_factor, self.high_freq_factor,
                self.original_max_position_embeddings, self.linear_scales, self.beta_fast, self.beta_slow,
                self.mscale, self.truncate)


def yarn_attention_factor(factor: float, params: dict) -> float:
    """YaRN's attention factor (mscale) for ``rope_parameters``: ``attention_factor`` when given, else
    0.1 * m * ln(factor) + 1 (1 for factor <= 1), as a ratio of two such terms when ``mscale`` and
    ``mscale_all_dim`` are both given (the engines' and HF's formula, in Python floats)."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(get(factor, float(m)) / get(factor, float(m_all)))
    return float(get(factor))


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0,
                 frequencies: RopeFrequencies | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos and sin of shape [*positions.shape, rotary_dim // 2], as HF and vLLM compute them:
    default RoPE with ``base`` (theta), or the scaled RoPE ``frequencies`` describe."""
    if frequencies is None:
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        frequencies = RopeFrequencies(rotary_dim, float(base))
    return frequencies.cos_sin(positions)


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
