"""MoE experts: the SwiGLU expert MLPs of a sparse MoE block and the weighted sum of their outputs.

Recorded beside the regions (like attention): the dense SwiGLU region starts from gate/up already
rounded by a BF16 GEMM, but a fused-MoE kernel can hand silu its FP32 GEMM accumulators, so the
expert MLP is probed as one program, GEMMs included, from the router's logits on. The router
(:func:`route`; the logits are the gate GEMM's output, in the activation dtype) picks each token's
top-k experts and their FP32 weights (variant ``router``):

    softmax_all:  p = softmax(fp32(logits)) over every expert; w = the top k of p, / their sum
    softmax_topk: w = softmax(fp32(the top k logits))          (mathematically the same weights)
    softmax_topk_act: softmax_topk computed by torch's ops on the logits in the activation dtype
                  (each op's result rounded: vLLM's CPU router run eagerly on BF16 logits)

(all for a model that renormalizes the top-k weights, as Qwen3-MoE does; without it, as Qwen2-MoE:
p's top k; exp(top-k logit - round(logsumexp(logits))) in FP32 (vLLM's compiled router: the
logsumexp is a reduction its graph stores in the logits' dtype, measured); and the same with the
difference and exp also rounded to the activation dtype.) ``softmax_all`` lists a token's experts in
descending order (torch.topk sorted, as HF and SGLang call it), ``softmax_topk*`` in the order
torch.topk(logits, sorted=False) gives them (as vLLM calls it): the order the weighted outputs are
added in (``combine_order=topk``). Then, per token, for each of its experts e with weight w:

    gu = x @ w13[e]^T                      # variant gemm_order; site gate_up: rounded or FP32 accumulators
    g, u = gu[:I], gu[I:]
    s = silu(g)                            # variant silu_formula; site silu
    h = round(s * u)                       (the down GEMM's input, always rounded)
    y = h @ w2[e]^T                        # variant gemm_order; site expert_out
    w = round(w)?                          # site routing_weight
    t = w * y, round(t)?                   # site weighted (with weighted=fp32, variant combine_fma:
                                           #   t is added by one fused multiply-add or not)
    acc = acc + t, round(acc)?             # site combine (a BF16 index_add rounds every partial sum)
    out = round(acc)                       (the block output, always rounded once)

The terms are added in top-k order or in ascending expert id (variant combine_order; HF's loop over
experts). ``gemm_order``: ``sequential`` sums the products in FP32 in ascending order of the
reduced index, one add per product (products of two activation-dtype values are exact in FP32, so
this is also the FMA order); ``library`` is torch's ``F.linear`` on the tensor's device, called per
expert on the rows routed to it (in the activation dtype when the output is rounded, in FP32 when
it is kept FP32), as HF's eager experts call it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import portable
from ..rounding import act_dtype, round_to
from .base import ROUNDED, MathMode, Point, RegionSpec, site, variant
from .swiglu import silu_fp32


def _canonical(d: dict[str, str]) -> dict[str, str]:
    if d["router"] == "softmax_topk_act":  # its weights are already in the activation dtype
        d["routing_weight"] = ROUNDED
    if d["weighted"] == ROUNDED:  # the product is rounded before the add: no FMA to contract
        d["combine_fma"] = "none"
    return d


SPEC = RegionSpec(
    name="moe",
    title="MoE experts",
    doc="sum over a token's top-k experts of w * down(round(silu(gate) * up)), rounded once at the end",
    sites=(
        site("gate_up", "the expert's gate/up GEMM outputs rounded to the activation dtype before silu"),
        site("silu", "silu(gate) rounded to the activation dtype before it multiplies up"),
        site("expert_out", "each expert's down-projection output rounded before it is weighted"),
        site("routing_weight", "the router's FP32 top-k weights rounded to the activation dtype"),
        site("weighted", "each weighted expert output w * y rounded before it is summed"),
        site("combine", "each partial sum over a token's experts rounded (a BF16 index_add)"),
    ),
    variants=(
        variant("router", ("softmax_all", "softmax_topk", "softmax_topk_act"),
                "the top-k weights: softmax over every expert's logit in FP32 then the top k (renormalized or not: "
                "HF, SGLang), softmax over the top-k logits in FP32 (vLLM's CPU router compiled), or the same by "
                "torch's ops in the activation dtype (vLLM's CPU router eager)"),
        variant("silu_formula", ("fused", "x_sigmoid", "x_div_1p_exp"),
                "how silu is computed: torch's fused silu, gate*sigmoid(gate), or gate/(1+exp(-gate))"),
        variant("gemm_order", ("sequential", "library"),
                "the GEMMs' FP32 accumulation: sequential over the reduced index, or torch's F.linear per expert"),
        variant("combine_order", ("topk", "expert"),
                "the order of a token's terms: top-k order, or ascending expert id"),
        variant("combine_fma", ("fma", "none"),
                "an FP32 combine step as one fused multiply-add, or a rounded multiply then an add"),
    ),
    canonical_rules=_canonical,
)


def sequential_linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w^T`` in FP32, each output summed in ascending order of the reduced index, one rounding
    per add. ``a``: (M, K) and ``w``: (N, K), activation dtype (their products are exact in FP32)."""
    af, wf = a.float(), w.float()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    for k in range(a.shape[1]):
        acc = acc + af[:, k, None] * wf[None, :, k]
    return acc


def _linear(a: torch.Tensor, w: torch.Tensor, order: str, rounded: bool) -> torch.Tensor:
    """FP32 result of a GEMM whose output is rounded (``rounded``) or kept in FP32."""
    dt = a.dtype
    if order == "sequential":
        y = sequential_linear(a, w)
        return round_to(y, dt) if rounded else y
    if rounded:
        return F.linear(a, w).float()
    return F.linear(a.float(), w.float())


class GemmMemo:
    """The GEMMs (and routes) of a few sets of inputs, for a caller that evaluates the reference at
    many lattice points on the same tensors (the probe: once per point). Opt-in (``moe_ref(...,
    memo=...)``): keyed on the tensors' identity and their version counters, so an in-place change
    of an input (an optimizer step) is never answered from the memo; it holds the tensors it keys on
    (the last ``keep`` sets)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.entries: list[tuple[tuple, dict]] = []

    def get(self, inputs: tuple, what: tuple, compute):  # noqa: ANN001
        key = tuple((t, t._version) for t in inputs)
        for k, values in self.entries:
            if len(k) == len(key) and all(a is b and va == vb for (a, va), (b, vb) in zip(k, key)):
                break
        else:
            values = {}
            self.entries = [*self.entries[-(self.keep - 1):], (key, values)]
        if what not in values:
            values[what] = compute()
        return values[what]


class _NoMemo:
    @staticmethod
    def get(inputs: tuple, what: tuple, compute):  # noqa: ANN001, ARG004
        return compute()


def check_moe_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"moe: x must be (tokens, hidden), w13 (experts, 2*inter, hidden), w2 (experts, hidden, inter); "
                         f"got {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if two_i % 2 or h != x.shape[1] or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"moe: shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe: topk weights and ids must both be (tokens, k); got {tuple(topk_weights.shape)} and "
                         f"{tuple(topk_ids.shape)} for {x.shape[0]} tokens")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e):
        raise ValueError(f"moe: expert ids must lie in [0, {e}); got {int(topk_ids.min())}..{int(topk_ids.max())}")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"moe: x, w13 and w2 must share the activation dtype; got {x.dtype}, {w13.dtype}, {w2.dtype}")


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, point: Point,
                   *, math: MathMode = "torch", memo: GemmMemo | None = None) -> torch.Tensor:
    """Y[t, j]: the FP32 values of expert ``topk_ids[t, j]``'s output for token t (rounded to the
    activation dtype where ``expert_out`` says so), computed expert by expert on the rows routed to it."""
    cache = memo if memo is not None else _NoMemo
    key = ("y", point["gemm_order"], point["gate_up"], point["silu"], point["silu_formula"], math, point["expert_out"])
    return cache.get((x, w13, w2, topk_ids), key, lambda: _expert_outputs(x, w13, w2, topk_ids, point, math, cache))


def _expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, point: Point,
                    math: MathMode, cache: GemmMemo | type[_NoMemo]) -> torch.Tensor:
    dt = act_dtype(x.dtype)
    tokens, k = topk_ids.shape
    inter = w13.shape[1] // 2
    order = point["gemm_order"]
    inputs = (x, w13, w2, topk_ids)
    y = torch.zeros(tokens, k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        t_idx, slot = torch.where(topk_ids == e)
        gu = cache.get(inputs, ("gate_up", e, order, point["gate_up"]),
                       lambda: _linear(x[t_idx], w13[e], order, point["gate_up"] == ROUNDED))
        s = silu_fp32(gu[:, :inter], point["silu_formula"], math)
        if point["silu"] == ROUNDED:
            s = round_to(s, dt)
        h = round_to(s * gu[:, inter:], dt).to(dt)
        y[t_idx, slot] = _linear(h, w2[e], order, point["expert_out"] == ROUNDED)
    return y


def combine(y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, point: Point,
            dt: torch.dtype) -> torch.Tensor:
    """The FP32 sum over each token's experts at ``point`` (before the final rounding)."""
    w = topk_weights.float()
    if point["routing_weight"] == ROUNDED:
        w = round_to(w, dt)
    if point["combine_order"] == "expert":
        idx = torch.argsort(topk_ids, dim=1, stable=True)
        w = w.gather(1, idx)
        y = y.gather(1, idx[..., None].expand_as(y))
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for j in range(y.shape[1]):
        wj = w[:, j, None].expand_as(acc)
        if point["weighted"] == ROUNDED:
            acc = acc + round_to(wj * y[:, j], dt)
        elif point["combine_fma"] == "fma":
            acc = portable.fma(wj.contiguous(), y[:, j].contiguous(), acc)
        else:
            acc = acc + wj * y[:, j]
        if point["combine"] == ROUNDED:
            acc = round_to(acc, dt)
    return acc


def moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            point: Point, *, math: MathMode = "torch", memo: GemmMemo | None = None) -> torch.Tensor:
    """Reference MoE experts at ``point``: (tokens, hidden) in the activation dtype.

    ``x``: (tokens, hidden); ``w13``: (experts, 2*inter, hidden), gate rows first, then up;
    ``w2``: (experts, hidden, inter); ``topk_weights``: (tokens, k), the router's FP32 weights;
    ``topk_ids``: (tokens, k) expert ids. ``memo``: a :class:`GemmMemo` shared by calls on the same
    inputs at other points (the GEMMs are computed once per input and choice that changes them)."""
    dt = act_dtype(x.dtype)
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    y = expert_outputs(x, w13, w2, topk_ids, point, math=math, memo=memo)
    return round_to(combine(y, topk_weights, topk_ids, point, dt), dt).to(dt)


def route(logits: torch.Tensor, k: int, point: Point, *, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The router at ``point``: (FP32 top-k weights before the ``routing_weight`` site, expert ids),
    (tokens, k) each, in the order the variant lists them (module docstring). ``logits``: (tokens,
    experts), in the activation dtype."""
    lf = logits.float()
    if point["router"] == "softmax_all":
        p = torch.softmax(lf, dim=-1)
        w, ids = torch.topk(p, k, dim=-1)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, ids
    v, ids = torch.topk(logits, k, dim=-1, sorted=False)
    if point["router"] == "softmax_topk_act":  # each op in the logits' dtype, as torch runs it
        if renormalize:
            return torch.softmax(v, dim=-1).float(), ids
        return (v - torch.logsumexp(logits, dim=-1, keepdim=True)).exp().float(), ids
    if renormalize:
        return torch.softmax(v.float(), dim=-1), ids
    # logsumexp in FP32, rounded to the logits' dtype (a reduction whose result the compiled router
    # stores in that dtype), then the difference and exp in FP32 (fused)
    lse = round_to(torch.logsumexp(lf, dim=-1, keepdim=True), logits.dtype)
    return torch.exp(v.float() - lse), ids


def moe_block_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, k: int, point: Point,
                  *, renormalize: bool = True, math: MathMode = "torch", memo: GemmMemo | None = None) -> torch.Tensor:
    """The router (:func:`route`) then the experts (:func:`moe_ref`) at ``point``: a sparse MoE block
    from its router logits (tokens, experts) on, (tokens, hidden) in the activation dtype."""
    if logits.dim() != 2 or logits.shape[0] != x.shape[0] or logits.shape[1] != w13.shape[0]:
        raise ValueError(f"moe: router logits must be (tokens, experts) = ({x.shape[0]}, {w13.shape[0]}); got "
                         f"{tuple(logits.shape)}")
    if not 0 < k <= w13.shape[0]:
        raise ValueError(f"moe: top-k must lie in [1, {w13.shape[0]}]; got {k}")
    if memo is not None:  # one route per router variant: the same ids object for the experts' memo
        w, ids = memo.get((logits,), ("route", k, point["router"], renormalize),
                          lambda: route(logits, k, point, renormalize=renormalize))
    else:
        w, ids = route(logits, k, point, renormalize=renormalize)
    return moe_ref(x, w13, w2, w.contiguous(), ids.contiguous(), point, math=math, memo=memo)
