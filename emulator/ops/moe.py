"""MoE experts: the forward at a profile's ``moe`` point, the backward of the FP32 function.

No Triton kernel. The forward *is* :func:`engineprofiles.regions.moe_ref` (the semantics of the
``moe`` entry: the expert GEMMs in the point's ``gemm_order``, silu, the rounding sites and the
weighted combine), run on the tensors' device; ``math`` is ``"portable"`` for the
``reference-portable`` backend and ``"torch"`` otherwise (torch's silu, as the probed engines and
HF run it). No GEMM memo here (the probe's is opt-in): every call computes its GEMMs afresh.

Backward: the gradient of the FP32 function with every rounding treated as identity
(straight-through), computed in FP32 with plain matmuls per expert (no autograd through the
reference's loops). Per token t and top-k slot j with expert e = ids[t, j], weight w = w[t, j]::

    gu = x[t] @ w13[e]^T;  g, u = gu[:I], gu[I:];  s = silu(g);  h = s * u;  y = h @ w2[e]^T
    out[t] = sum_j w[t, j] * y[t, j]

    d w[t, j] = <d out[t], y[t, j]>          dy = w * d out[t]
    dh = dy @ w2[e]        d w2[e] += dy^T h
    du = dh * s            dg = dh * u * sig * (1 + g * (1 - sig))     (sig = sigmoid(g))
    d w13[e] += [dg, du]^T x[t]              d x[t] += [dg, du] @ w13[e]

The per-slot input gradients are summed over the top-k slots in slot order (no scatter-add, so no
atomics: deterministic on every device). The intermediates are recomputed in the backward (the
forward saves only its inputs).
"""

from __future__ import annotations

import torch

from engineprofiles.regions import Point
from engineprofiles.regions.moe import moe_ref

from ._utils import cast_like


def moe_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, point: Point, math: str = "torch") -> torch.Tensor:
    """(tokens, hidden) in the activation dtype: :func:`moe_ref` at ``point``, bit for bit."""
    return moe_ref(x, w13, w2, topk_weights, topk_ids, point, math=math)  # type: ignore[arg-type]


def moe_backward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, dout: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP32 gradients (d x, d w13, d w2, d topk_weights) of the FP32 function (module docstring)."""
    xf, w13f, w2f = x.float(), w13.float(), w2.float()
    wf, d = topk_weights.float(), dout.float()
    tokens, k = topk_ids.shape
    inter = w13.shape[1] // 2
    dxk = xf.new_zeros(tokens, k, x.shape[1])
    dw13, dw2 = torch.zeros_like(w13f), torch.zeros_like(w2f)
    dw = wf.new_zeros(tokens, k)
    for e in torch.unique(topk_ids).tolist():
        t_idx, slot = torch.where(topk_ids == e)
        xe, de = xf[t_idx], d[t_idx]
        gu = xe @ w13f[e].T
        g, u = gu[:, :inter], gu[:, inter:]
        sig = torch.sigmoid(g)
        s = g * sig
        h = s * u
        y = h @ w2f[e].T
        dw[t_idx, slot] = (de * y).sum(-1)
        dy = wf[t_idx, slot, None] * de
        dh = dy @ w2f[e]
        dw2[e] = dy.T @ h
        dgu = torch.cat((dh * u * (sig * (1.0 + g * (1.0 - sig))), dh * s), dim=1)
        dw13[e] = dgu.T @ xe
        dxk[t_idx, slot] = dgu @ w13f[e]
    return dxk.sum(1), dw13, dw2, dw


class MoEFunction(torch.autograd.Function):
    """out = moe(x, w13, w2, topk_weights, topk_ids) at ``point``; x [T, H], w13 [E, 2I, H],
    w2 [E, H, I], topk_weights [T, K] (FP32 or the activation dtype), topk_ids [T, K]."""

    @staticmethod
    def forward(ctx, x, w13, w2, topk_weights, topk_ids, point: Point, math: str):  # noqa: ANN001
        out = moe_forward(x, w13, w2, topk_weights, topk_ids, point, math)
        ctx.save_for_backward(x, w13, w2, topk_weights, topk_ids)
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001
        x, w13, w2, topk_weights, topk_ids = ctx.saved_tensors
        dx, dw13, dw2, dw = moe_backward(x, w13, w2, topk_weights, topk_ids, dout)
        need = ctx.needs_input_grad
        return (cast_like(dx, x.dtype) if need[0] else None, cast_like(dw13, w13.dtype) if need[1] else None,
                cast_like(dw2, w2.dtype) if need[2] else None,
                cast_like(dw, topk_weights.dtype) if need[3] else None, None, None, None)
