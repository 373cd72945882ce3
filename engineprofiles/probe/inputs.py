"""Probe inputs: realistic magnitudes, outliers and rounding ties, over a sweep of shapes.

Inputs are generated on the CPU from a seeded generator (identical on every machine), then moved
to the probe device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zlib

import torch

from ..rounding import round_to


@dataclass(frozen=True)
class Case:
    region: str
    shape: dict[str, Any]

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.shape.items())


# The sweep: token counts from 1 to many, hidden sizes that are and are not powers of two, head
# dims 64 and 128 with GQA, both RoPE styles, positions beyond 32k. Engines that compile keep the
# token dimension dynamic, so the cases share compiled graphs per width: token counts vary within
# a width, and the number of distinct widths (one compile each) stays small.
SWEEP: dict[str, list[dict[str, Any]]] = {
    "rope": [
        dict(tokens=1, q_heads=14, kv_heads=2, head_dim=64, style="neox", max_pos=8),
        dict(tokens=7, q_heads=14, kv_heads=2, head_dim=64, style="neox", max_pos=40000),
        dict(tokens=64, q_heads=8, kv_heads=2, head_dim=128, style="neox", max_pos=40000),
        dict(tokens=33, q_heads=4, kv_heads=4, head_dim=128, style="interleaved", max_pos=4096),
    ],
    "swiglu": [
        dict(tokens=1, inter=4864),
        dict(tokens=64, inter=4864),
        dict(tokens=7, inter=1000),
    ],
    # Both call forms of the norm, on the same widths (the tuned case: weights that put products on
    # rounding ties).
    **{
        region: [
            dict(tokens=1, hidden=896),
            dict(tokens=64, hidden=896),
            dict(tokens=7, hidden=1000),
            dict(tokens=32, hidden=2048),
            dict(tokens=8, hidden=896, tuned=True),
        ]
        for region in ("rmsnorm", "add_rmsnorm")
    },
}

# The MoE experts (recorded beside the regions). ``one_hot``: every token is a scaled basis vector
# and each expert's down projection a 0/1 selection, so both GEMMs are exact whatever their
# summation order and the rounding sites show alone; the other cases show the GEMMs' order and
# the combine's.
# Hidden and intermediate sizes are multiples of 32 (vLLM's CPU fused-MoE kernel needs it).
SWEEP["moe"] = [
    dict(tokens=64, hidden=128, inter=64, experts=4, topk=2, one_hot=True),
    dict(tokens=1, hidden=256, inter=128, experts=4, topk=2),
    dict(tokens=33, hidden=512, inter=256, experts=8, topk=2),
    dict(tokens=16, hidden=384, inter=96, experts=6, topk=3),
    # Many tokens of a narrow model, four experts each: the order and the contraction of the FP32
    # weighted sum change its last bits, which few outputs show once rounded; many cheap ones do.
    dict(tokens=2048, hidden=32, inter=32, experts=8, topk=4),
    # Top-k weights not renormalized (Qwen2-MoE's norm_topk_prob=False): the router's other formula.
    dict(tokens=64, hidden=128, inter=64, experts=4, topk=2, one_hot=True, renormalize=False),
    dict(tokens=512, hidden=64, inter=32, experts=8, topk=4, renormalize=False),
]

# The MoE shared expert (Qwen2-MoE): its SwiGLU, its sigmoid gate and their sum with the routed
# output, seen in the residual stream after the block. Sizes: multiples of 32, as the engines' CPU
# GEMMs take them.
SWEEP["shared_expert"] = [
    dict(tokens=1, hidden=256, inter=128),
    dict(tokens=33, hidden=512, inter=256),
    dict(tokens=256, hidden=128, inter=64),
    dict(tokens=1024, hidden=64, inter=32),
]

ROPE_BASE = 1000000.0
EPS = 1e-6


def cases(region: str, quick: bool = False, sweep: list[dict[str, Any]] | None = None) -> list[Case]:
    sweep = sweep if sweep is not None else SWEEP[region]
    if quick:
        sweep = sweep[:2]
    return [Case(region, s) for s in sweep]


def _act(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return round_to(x.float(), dtype).to(dtype)


def _with_outliers(x: torch.Tensor, g: torch.Generator, frac: float, scale: float) -> torch.Tensor:
    mask = torch.rand(x.shape, generator=g) < frac
    return torch.where(mask, x * scale, x)


def _tune_weight_to_ties(n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per column, the activation-dtype weight in [1, 2) that puts n * w closest to a rounding
    midpoint of ``dtype``. A one-ULP change anywhere upstream of the weight multiply (how the
    variance, the rsqrt or the sum was formed) then flips the rounded output in many columns."""
    mant = 7 if dtype == torch.bfloat16 else 10
    grid = 1.0 + torch.arange(1 << mant, dtype=torch.float32) / (1 << mant)  # exact in dtype
    prods = n.unsqueeze(-1) * grid  # [hidden, candidates]
    low = prods.view(torch.int32) & ((1 << (23 - mant)) - 1)
    dist = (low - (1 << (22 - mant))).abs()  # distance of the dropped bits from a tie
    dist = torch.where(prods.abs() > 1e-30, dist, torch.full_like(dist, 1 << 30))
    return grid[dist.argmin(-1)]


def make_inputs(case: Case, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """The tensors for one case (CPU), by the region's maker (:data:`MAKERS`). Magnitudes suit both
    BF16 and FP16 (no FP16 overflow)."""
    maker = MAKERS.get(case.region)
    if maker is None:
        from ..errors import EngineProfilesError

        raise EngineProfilesError(f"no probe inputs for region {case.region!r}; made for: {', '.join(MAKERS)}")
    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(f"{case.region}:{case.label}".encode()) % 100003)
    return maker(case.shape, dtype, g, case.region)


def _rope_inputs(s: dict[str, Any], dtype: torch.dtype, g: torch.Generator, region: str) -> dict[str, Any]:
    t = s["tokens"]
    pos = torch.randint(0, s["max_pos"], (t,), generator=g)
    pos[0] = s["max_pos"] - 1
    q = _with_outliers(torch.randn(t, s["q_heads"], s["head_dim"], generator=g) * 2, g, 0.01, 20)
    k = _with_outliers(torch.randn(t, s["kv_heads"], s["head_dim"], generator=g) * 4, g, 0.01, 20)
    base = s.get("base", ROPE_BASE)
    return dict(positions=pos, q=_act(q, dtype), k=_act(k, dtype), base=base, style=s["style"])


def _swiglu_inputs(s: dict[str, Any], dtype: torch.dtype, g: torch.Generator, region: str) -> dict[str, Any]:
    shape = (s["tokens"], s["inter"])
    gate = _with_outliers(torch.randn(shape, generator=g) * 3, g, 0.01, 6)
    up = _with_outliers(torch.randn(shape, generator=g) * 2, g, 0.01, 10)
    return dict(gate=_act(gate, dtype), up=_act(up, dtype))


def _norm_inputs(s: dict[str, Any], dtype: torch.dtype, g: torch.Generator, region: str) -> dict[str, Any]:
    """rmsnorm and add_rmsnorm (``region``): rows with outliers, a couple of unusual weights; ``tuned``
    cases stress the normalization, others (add_rmsnorm) plant exact ties in the residual sum."""
    shape = (s["tokens"], s["hidden"])
    eps = s.get("eps", EPS)
    x = _with_outliers(torch.randn(shape, generator=g), g, 0.01, 30)
    w = _act(1 + 0.1 * torch.randn(s["hidden"], generator=g), dtype)
    w[:2] = torch.tensor([4.0, 0.03125])  # a couple of unusual weights, as real checkpoints have
    if s.get("tuned"):
        return _tuned_norm_inputs(x, shape, eps, dtype, g, region)
    if region == "rmsnorm":
        return dict(x=_act(x, dtype), weight=w, eps=eps)
    res = _with_outliers(torch.randn(shape, generator=g) * 8, g, 0.01, 40)
    res, x = _act(res, dtype), _act(x, dtype)
    # Plant exact ties: x = half an ULP of the residual, so x + residual is a midpoint of the
    # activation dtype; rounding it (or not) is then visible in the residual passed on.
    n_ties = max(1, x.numel() // 50)
    idx = torch.randperm(x.numel(), generator=g)[:n_ties]
    r = res.flatten()[idx].float()
    ulp = torch.where(r == 0, torch.ones_like(r), r.abs())
    mant = 7 if dtype == torch.bfloat16 else 10
    half_ulp = torch.exp2(torch.floor(torch.log2(ulp)) - mant - 1)
    xf = x.flatten().clone()
    xf[idx] = _act(half_ulp * torch.sign(torch.randn(n_ties, generator=g)), dtype)
    return dict(x=xf.view(shape), residual=res, weight=w, eps=eps)


def _tuned_norm_inputs(x: torch.Tensor, shape: tuple[int, int], eps: float, dtype: torch.dtype,
                       g: torch.Generator, region: str) -> dict[str, Any]:
    """Rows that stress the normalization, and weights tuned to rounding ties for row 0."""
    x = _act(x, dtype)
    if region == "add_rmsnorm":
        res = _act(_with_outliers(torch.randn(shape, generator=g) * 8, g, 0.01, 40), dtype)
        base = x.float() + res.float()
    else:
        res, base = None, x.float()
    # Row 0 is redrawn until the usual ways of forming 1/sqrt(var) disagree in FP32 on this
    # device, so that formula variants of the normalization become visible.
    for _ in range(256):
        v = base[0].pow(2).mean() + eps
        if bool(torch.rsqrt(v) != 1.0 / torch.sqrt(v)):
            break
        row = _act(torch.randn(shape[-1], generator=g), dtype)
        x[0] = row
        base = x.float() + res.float() if res is not None else x.float()
    n0 = base[0] * torch.rsqrt(base[0].pow(2).mean() + eps)
    w = _tune_weight_to_ties(n0, dtype).to(dtype)
    if res is None:
        return dict(x=x, weight=w, eps=eps)
    return dict(x=x, residual=res, weight=w, eps=eps)


def _moe_inputs(s: dict[str, Any], dtype: torch.dtype, g: torch.Generator, region: str = "moe") -> dict[str, Any]:
    t, h, i, e, k = s["tokens"], s["hidden"], s["inter"], s["experts"], s["topk"]
    if s.get("one_hot"):
        x = torch.zeros(t, h)
        x[torch.arange(t), torch.randint(0, h, (t,), generator=g)] = torch.randn(t, generator=g) * 3
        w13 = torch.randn(e, 2 * i, h, generator=g) * 0.7
        w2 = torch.zeros(e, h, i)
        for j in range(e):
            w2[j, torch.arange(h), torch.randperm(h, generator=g) % i] = 1.0
    else:
        x = _with_outliers(torch.randn(t, h, generator=g), g, 0.01, 10)
        w13 = torch.randn(e, 2 * i, h, generator=g) * (1.5 / h ** 0.5)
        w2 = torch.randn(e, h, i, generator=g) * (1.0 / i ** 0.5)
    # The router's logits (the gate GEMM's output, activation dtype): per token the experts' levels
    # 0.25 apart in a random order, jittered by less than a third of that, so no two tie (a tie
    # would leave the choice of experts to each engine's top-k).
    levels = (torch.arange(e, dtype=torch.float32) - (e - 1) / 2) * 0.25
    order = torch.argsort(torch.rand(t, e, generator=g), dim=-1)
    logits = levels[order] + (torch.rand(t, e, generator=g) - 0.5) * 0.16
    return dict(x=_act(x, dtype), w13=_act(w13, dtype), w2=_act(w2, dtype), router_logits=_act(logits, dtype), topk=k,
                renormalize=s.get("renormalize", True))


def _shared_inputs(s: dict[str, Any], dtype: torch.dtype, g: torch.Generator,
                   region: str = "shared_expert") -> dict[str, Any]:
    t, h, i = s["tokens"], s["hidden"], s["inter"]
    x = _with_outliers(torch.randn(t, h, generator=g), g, 0.01, 10)
    w_gate_up = torch.randn(2 * i, h, generator=g) * (1.5 / h ** 0.5)
    w_down = torch.randn(h, i, generator=g) * (1.0 / i ** 0.5)
    w_gate = torch.randn(1, h, generator=g) * (1.0 / h ** 0.5)
    # The routed output and the residual at the shared term's scale, so that rounding the gate,
    # the product or the sum shows in the stream after the add.
    routed = torch.randn(t, h, generator=g) * 0.3
    residual = torch.randn(t, h, generator=g) * 0.5
    return dict(x=_act(x, dtype), w_gate_up=_act(w_gate_up, dtype), w_down=_act(w_down, dtype),
                w_gate=_act(w_gate, dtype), routed=_act(routed, dtype), residual=_act(residual, dtype))


# The input maker of each probed region and entry beside them (``maker(shape, dtype, generator,
# region)``); a case of any other region is refused by name, never given another region's inputs.
MAKERS = {"rope": _rope_inputs, "swiglu": _swiglu_inputs, "add_rmsnorm": _norm_inputs, "rmsnorm": _norm_inputs,
          "moe": _moe_inputs, "shared_expert": _shared_inputs}
