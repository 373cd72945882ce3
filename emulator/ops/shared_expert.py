"""The MoE shared expert: the forward at a profile's ``shared_expert`` point, the backward of the
FP32 function.

No Triton kernel. The forward *is* :func:`engineprofiles.regions.shared_block_ref` (the semantics of
the ``shared_expert`` entry: the shared expert's GEMMs as torch's ``F.linear`` in the activation
dtype, silu, the gate's sigmoid, the rounding sites and the sum with the routed output), run on the
tensors' device; ``math`` is ``"portable"`` for the ``reference-portable`` backend and ``"torch"``
otherwise. Its output ``m`` is FP32 where the point keeps ``sum`` FP32 (the next residual add takes
it unrounded), else in the activation dtype.

Backward: the gradient of the FP32 function with every rounding treated as identity
(straight-through), computed in FP32 with plain matmuls (deterministic: no atomics)::

    gu = x @ w_gate_up^T;  g, u = gu[:, :I], gu[:, I:];  s = silu(g);  h = s * u;  y = h @ w_down^T
    z = x @ w_gate^T;  sg = sigmoid(z);  m = routed + sg * y

    d routed = d m
    d sg = sum_j d m[:, j] y[:, j]        d z = d sg * sg * (1 - sg)
    d w_gate = d z^T x                    d x  = d z @ w_gate
    d y = sg * d m                        d w_down = d y^T h        d h = d y @ w_down
    d u = d h * s                         d g = d h * u * sig * (1 + g * (1 - sig))   (sig = sigmoid(g))
    d w_gate_up = [d g, d u]^T x          d x += [d g, d u] @ w_gate_up

The intermediates are recomputed in FP32 in the backward (the forward saves only its inputs).
"""

from __future__ import annotations

import torch

from engineprofiles.regions import ROUNDED, Point
from engineprofiles.regions.shared_expert import shared_block_ref

from ._utils import cast_like


def shared_expert_forward(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor,
                          routed: torch.Tensor, point: Point, math: str = "torch") -> torch.Tensor:
    """The block output ``m``: :func:`shared_block_ref` at ``point``, bit for bit; FP32 where ``sum``
    is FP32, else in the activation dtype (the values are the same)."""
    m = shared_block_ref(x, w_gate_up, w_down, w_gate, routed, point, math=math)  # type: ignore[arg-type]
    return m.to(x.dtype) if point["sum"] == ROUNDED else m


def shared_expert_backward(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor,
                           dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """FP32 gradients (d x, d w_gate_up, d w_down, d w_gate, d routed) of the FP32 function (module
    docstring)."""
    xf, wguf, wdf, wgf, d = x.float(), w_gate_up.float(), w_down.float(), w_gate.float(), dm.float()
    inter = w_gate_up.shape[0] // 2
    gu = xf @ wguf.T
    g, u = gu[:, :inter], gu[:, inter:]
    sig = torch.sigmoid(g)
    s = g * sig
    h = s * u
    y = h @ wdf.T
    sg = torch.sigmoid(xf @ wgf.T)  # (tokens, 1)
    dz = (d * y).sum(-1, keepdim=True) * (sg * (1.0 - sg))
    dy = sg * d
    dh = dy @ wdf
    dgu = torch.cat((dh * u * (sig * (1.0 + g * (1.0 - sig))), dh * s), dim=1)
    dx = dgu @ wguf + dz @ wgf
    return dx, dgu.T @ xf, dy.T @ h, dz.T @ xf, d


class SharedExpertFunction(torch.autograd.Function):
    """m = routed + sigmoid(x @ w_gate^T) * down(silu(gate) * up) at ``point``; x [T, H],
    w_gate_up [2I, H] (gate rows, then up), w_down [H, I], w_gate [1, H], routed [T, H]."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, w_gate, routed, point: Point, math: str):  # noqa: ANN001
        m = shared_expert_forward(x, w_gate_up, w_down, w_gate, routed, point, math)
        ctx.save_for_backward(x, w_gate_up, w_down, w_gate)
        ctx.routed_dtype = routed.dtype
        return m

    @staticmethod
    def backward(ctx, dm):  # noqa: ANN001
        x, w_gate_up, w_down, w_gate = ctx.saved_tensors
        dx, dwgu, dwd, dwg, dr = shared_expert_backward(x, w_gate_up, w_down, w_gate, dm)
        need = ctx.needs_input_grad
        return (cast_like(dx, x.dtype) if need[0] else None, cast_like(dwgu, w_gate_up.dtype) if need[1] else None,
                cast_like(dwd, w_down.dtype) if need[2] else None, cast_like(dwg, w_gate.dtype) if need[3] else None,
                cast_like(dr, ctx.routed_dtype) if need[4] else None, None, None)
