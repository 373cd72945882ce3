"""The shared expert of a sparse MoE block (Qwen2-MoE): a dense SwiGLU MLP beside the routed
experts, scaled by a sigmoid gate and added to their output.

Recorded beside the regions (like ``moe``): in an engine the shared expert can run elsewhere than
the model's dense MLPs (vLLM runs it inside the MoE block's opaque op, eagerly, even where it
compiles the dense MLPs), and its sum with the routed output can stay in FP32 into the next
residual add (a compiled engine fuses them). From the block input ``x``, the routed experts' output
``routed`` (the ``moe`` entry's, in the activation dtype) and the residual stream ``residual``::

    gu = x @ w_gate_up^T                   (a library GEMM, rounded: the engines' linear layers)
    g, u = gu[:I], gu[I:]
    s = silu(g)                            # variant silu_formula; site silu
    y = round(round(s * u) @ w_down^T)     (the down GEMM's input and output, rounded)
    z = round(x @ w_gate^T)                (the gate's logit: a GEMM with one output, rounded)
    sg = sigmoid(z)                        # site gate
    t = sg * y                             # site weighted
    m = routed + t                         # site sum: the block's output, rounded or handed on in FP32
    residual' = round(m + residual)        (the next residual add, which rounds once)

``sum=fp32`` means the block's output is not rounded before the next residual add (the engine's
compiled graph keeps the sum in FP32 into the fused add + RMSNorm that follows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rounding import act_dtype, round_to
from .base import ROUNDED, MathMode, Point, RegionSpec, site, variant
from .swiglu import silu_fp32

SPEC = RegionSpec(
    name="shared_expert",
    title="MoE shared expert",
    doc="routed + sigmoid(x @ w_gate^T) * down(silu(gate) * up), then the next residual add",
    sites=(
        site("silu", "the shared expert's silu(gate) rounded to the activation dtype before it multiplies up"),
        site("gate", "the shared expert's gate sigmoid(x @ w_gate^T) rounded before it scales the expert's output"),
        site("weighted", "the gated shared-expert output rounded before it is added to the routed output"),
        site("sum", "the block output (routed + shared) rounded before the next residual add"),
    ),
    variants=(
        variant("silu_formula", ("fused", "x_sigmoid", "x_div_1p_exp"),
                "how the shared expert's silu is computed: torch's fused silu, gate*sigmoid(gate), or "
                "gate/(1+exp(-gate))"),
    ),
)


def check_shared_inputs(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor,
                        routed: torch.Tensor) -> None:
    if x.dim() != 2 or w_gate_up.dim() != 2 or w_down.dim() != 2 or w_gate.dim() != 2:
        raise ValueError(f"shared expert: x must be (tokens, hidden), w_gate_up (2*inter, hidden), w_down (hidden, "
                         f"inter), w_gate (1, hidden); got {tuple(x.shape)}, {tuple(w_gate_up.shape)}, "
                         f"{tuple(w_down.shape)}, {tuple(w_gate.shape)}")
    t, h = x.shape
    two_i = w_gate_up.shape[0]
    if two_i % 2 or w_gate_up.shape[1] != h or w_down.shape != (h, two_i // 2) or w_gate.shape != (1, h):
        raise ValueError(f"shared expert: shapes do not fit: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, "
                         f"w_down {tuple(w_down.shape)}, w_gate {tuple(w_gate.shape)}")
    if routed.shape != x.shape:
        raise ValueError(f"shared expert: the routed output must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(routed.shape)}")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype == w_gate.dtype == routed.dtype):
        raise ValueError(f"shared expert: x, the weights and the routed output must share the activation dtype; got "
                         f"{x.dtype}, {w_gate_up.dtype}, {w_down.dtype}, {w_gate.dtype}, {routed.dtype}")


def shared_term(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor, point: Point,
                *, math: MathMode = "torch") -> torch.Tensor:
    """FP32 values of the gated shared-expert output ``t`` (rounded where ``weighted`` says)."""
    dt = act_dtype(x.dtype)
    inter = w_gate_up.shape[0] // 2
    gu = F.linear(x, w_gate_up).float()
    s = silu_fp32(gu[:, :inter], point["silu_formula"], math)
    if point["silu"] == ROUNDED:
        s = round_to(s, dt)
    y = F.linear(round_to(s * gu[:, inter:], dt).to(dt), w_down).float()
    sg = torch.sigmoid(F.linear(x, w_gate).float())
    if point["gate"] == ROUNDED:
        sg = round_to(sg, dt)
    t = sg * y
    return round_to(t, dt) if point["weighted"] == ROUNDED else t


def shared_block_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor,
                     routed: torch.Tensor, point: Point, *, math: MathMode = "torch") -> torch.Tensor:
    """The block's output ``m`` at ``point``: FP32 values, rounded to the activation dtype where
    ``sum`` says (FP32 dtype either way; the next residual add takes it as it is)."""
    check_shared_inputs(x, w_gate_up, w_down, w_gate, routed)
    m = routed.float() + shared_term(x, w_gate_up, w_down, w_gate, point, math=math)
    return round_to(m, act_dtype(x.dtype)) if point["sum"] == ROUNDED else m


def shared_expert_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor,
                      routed: torch.Tensor, residual: torch.Tensor, point: Point, *,
                      math: MathMode = "torch") -> torch.Tensor:
    """The residual stream after the block at ``point``: round(m + residual), in the activation
    dtype (``m``: :func:`shared_block_ref`). What the probe compares: the ``sum`` site shows only
    there."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"shared expert: the residual must be {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    dt = act_dtype(x.dtype)
    m = shared_block_ref(x, w_gate_up, w_down, w_gate, routed, point, math=math)
    return round_to(m + residual.float(), dt).to(dt)
