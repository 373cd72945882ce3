"""The emulator's public API: the three regions at the rounding sites of a profile, with autograd;
also a sparse MoE block's experts (:func:`moe`, the profile's ``moe`` entry), its shared expert
(:func:`shared_expert`, the ``shared_expert`` entry) and exact mode's attention.

Each function takes ``profile``: a :class:`~engineprofiles.schema.Profile`, the path of a profile
YAML, the name of a shipped profile, or (for tests and experiments) a lattice
:class:`~engineprofiles.regions.Point` of the right region. The forward computes the region
exactly at the profile's point; the backward is the gradient of the FP32 function with every
rounding treated as identity (straight-through), computed in FP32.

Backends (which implementation runs):

``auto`` (default)
    CUDA tensors use the Triton kernels; tensors on other devices use ``reference``.
``triton``
    The Triton kernels. On CPU they run only through the Triton interpreter: set
    ``TRITON_INTERPRET=1`` before ``emulator`` is first imported (slow; for tests).
``reference``
    The torch references of :mod:`engineprofiles.regions` with ``math="torch"``: exp, sigmoid,
    silu, rsqrt and the mean are torch's own ops on the tensor's device. On CPU this is what HF
    transformers and torch-based engines compute, so it is the CPU default.
``reference-inductor``
    ``reference`` with the residual RMSNorm's forward compiled by torch.compile (Inductor), so its
    FP32 reduction runs in Inductor's order: what an engine that compiles the model with Inductor
    (vLLM's CPU build) computes. Exact mode uses it for such profiles on CPU. The other regions
    have no reduction and run as ``reference``.
``reference-portable``
    The references with ``math="portable"`` (see :mod:`engineprofiles.portable`): a fixed
    sequence of correctly rounded FP32 operations. The Triton kernels implement exactly this, so
    this backend and ``triton`` agree bit for bit, forward and backward, on any device.

What separates ``reference`` from the kernels on CPU is only the residual between torch's
transcendentals and reductions and the portable ones (a few FP32 ulps before the final
rounding; ``tests/emulator/test_functional.py`` measures and prints it). RoPE has no
transcendentals, so all backends agree on it bit for bit.

Choose the backend with the ``EMULATOR_BACKEND`` environment variable (read at each call) or
with the :func:`use_backend` context manager, which wins over the variable.

Under ``torch.compile`` each function calls its region as a ``torch.library`` custom op
(``torch.ops.emulator.<region>``, forward and backward), which Inductor calls as one opaque
operation, so compiled code computes the eager bits (the same implementation runs). The backend
is the one requested when the code is traced; the op checks at run time that it still is
(:class:`~emulator.errors.BackendError` otherwise: ``torch.compiler.reset()`` recompiles). Pass a
:class:`~engineprofiles.regions.Point` (``profile.point(region)``) in compiled code: resolving a
Profile reads its schema, which torch.compile runs outside the graph (a graph break).
"""

from __future__ import annotations

import contextlib
import math as _math
import os
from pathlib import Path
from typing import Union

import torch

from engineprofiles.regions import STYLES, Point
from engineprofiles.regions.attention import KVSplit
from engineprofiles.regions.moe import check_moe_inputs
from engineprofiles.regions.shared_expert import check_shared_inputs
from engineprofiles.rounding import ACT_DTYPES
from engineprofiles.schema import Profile, load_profile
from engineprofiles.store import resolve

from .errors import InputError, ProfileMismatch, RegionUnavailable
from .ops._backend import BACKENDS, ENV_VAR, backend_for, current_backend, traced_backend_for, use_backend
from .ops._utils import point_key
from .ops.attention import ENGINE_KERNELS, ExactAttentionFunction, attention_op, kv_split_key
from .ops.moe import MoEFunction
from .ops.shared_expert import SharedExpertFunction
from .ops.rmsnorm import AddRMSNormFunction, RMSNormFunction, add_rmsnorm_op, rmsnorm_op
from .ops.rope import RoPEFunction, rope_op
from .ops.swiglu import SwiGLUFunction, swiglu_op

ProfileLike = Union[Profile, str, os.PathLike, Point]

__all__ = ["rope", "swiglu", "rmsnorm", "add_rmsnorm", "moe", "shared_expert", "attention", "use_backend", "current_backend", "BACKENDS", "ENV_VAR"]


# -- backend choice -------------------------------------------------------------------------------


def _backend_for(device: torch.device, override: str | None = None) -> str:
    """The backend of a call on ``device`` (``override``: the call's own, exact mode's norms); under
    torch.compile the one requested when it traces (each op checks at run time that it is still the
    one requested: ops/_backend.py)."""
    if override is not None:
        return backend_for(device, override)
    if torch.compiler.is_compiling():
        return traced_backend_for(device.type)
    return backend_for(device)


# -- profiles -------------------------------------------------------------------------------------

_loaded: dict[tuple[str, int], Profile] = {}


def _profile(profile: Profile | str | os.PathLike) -> Profile:
    if isinstance(profile, Profile):
        return profile
    path = resolve(profile)
    key = (str(Path(path).resolve()), path.stat().st_mtime_ns)
    if key not in _loaded:
        _loaded[key] = load_profile(path)
    return _loaded[key]


def _point_and_dtype(
    profile: ProfileLike, region: str, op: str, t: torch.Tensor, dtype: torch.dtype | None
) -> tuple[Point, torch.dtype]:
    """The lattice point for ``region`` and the activation dtype the call rounds to."""
    act_dtypes = tuple(ACT_DTYPES.values())
    if dtype is not None and dtype not in act_dtypes:
        raise InputError(f"{op}: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if isinstance(profile, Point):
        if profile.region != region:
            raise ProfileMismatch(f"{op} needs a point of region {region!r}, got a point of region {profile.region!r}")
        act = dtype if dtype is not None else t.dtype
        if act not in act_dtypes:
            raise InputError(
                f"{op}: input dtype {t.dtype} is not an activation dtype; pass dtype=torch.bfloat16 or "
                "torch.float16 to say which dtype the sites round to"
            )
        if t.dtype in act_dtypes and t.dtype != act:
            raise ProfileMismatch(f"{op}: the input is {t.dtype}, but dtype={dtype} was given; the sites round to one "
                                  "activation dtype: run the model in it")
        return profile, act
    if not isinstance(profile, (Profile, str, os.PathLike)):
        raise ProfileMismatch(
            f"{op}: profile must be a Profile, a path, a shipped name or a lattice Point of region {region!r}; "
            f"got {type(profile).__name__}"
        )
    prof = _profile(profile)
    name = prof.canonical_name
    if not prof.available(region):
        reason = prof.entry(region).evidence.reason
        raise RegionUnavailable(
            f"profile {name} records region {region} as unavailable ({reason}), so it does not say how to round "
            f"in {op}; use a profile in which {region} was measured, or leave this region unpatched"
        )
    act = ACT_DTYPES[prof.dtype]
    if dtype is not None and dtype != act:
        raise ProfileMismatch(f"{op}: dtype={dtype} was given, but profile {name} was measured in {prof.dtype}")
    if t.dtype in act_dtypes and t.dtype != act:
        raise ProfileMismatch(
            f"{op}: the input is {t.dtype}, but profile {name} was measured in {prof.dtype}; "
            "run the model in the profile's dtype or probe the engine in this one"
        )
    return prof.point(region), act


def _fp32_math(device: torch.device):
    """The regions compute in FP32 with explicit rounding: a caller's torch.autocast (mixed
    precision) must not cast their FP32 arithmetic (e.g. exact attention's FP32 matmul) down."""
    if device.type != "meta" and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# -- input checks ---------------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_float(op: str, **tensors: torch.Tensor) -> None:
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{op}: {k} must be a tensor, got {type(t).__name__}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise InputError(f"{op}: all tensors must be on one device, got {', '.join(f'{k} on {t.device}' for k, t in tensors.items())}")
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{op}: {k} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise InputError(f"{op}: {k} must be float32, bfloat16 or float16, got {t.dtype}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[*lead, N] -> [M, N] with unit column stride (a view when possible)."""
    n = x.shape[-1]
    x2 = x.reshape(_math.prod(x.shape[:-1]), n)
    return x2 if x2.stride(-1) == 1 or n <= 1 else x2.contiguous()


# -- the regions ----------------------------------------------------------------------------------


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    profile: ProfileLike,
    *,
    style: str = "neox",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotary embedding of q or k at the profile's RoPE point.

    x: [*lead, heads, head_dim] in the activation dtype (or FP32, handed on by an FP32 q/k norm;
    then the profile or ``dtype`` names the activation dtype). cos/sin: FP32 [*lead, rot/2], lead
    dims broadcasting from the right (e.g. [seq, rot/2] for x [batch, seq, heads, head_dim]), or
    with a heads axis, [*lead, 1 or heads, rot/2]; lanes past ``rot`` pass through.
    ``style``: "neox" (rotate halves) or "interleaved" (rotate even/odd pairs). Returns the
    activation dtype, shaped like x. Gradients flow to x only.
    """
    op = "rope"
    if style not in STYLES:
        raise InputError(f"rope: style must be one of {', '.join(STYLES)}, got {style!r}")
    _check_float(op, x=x, cos=cos, sin=sin)
    if x.dim() < 2:
        raise InputError(f"rope: x must be [*lead, heads, head_dim], got shape {tuple(x.shape)}")
    if cos.shape != sin.shape:
        raise InputError(f"rope: cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    *lead, heads, head_dim = x.shape
    half = cos.shape[-1]
    if 2 * half > head_dim or half == 0:
        raise InputError(f"rope: cos/sin cover {2 * half} lanes, but head_dim is {head_dim}")
    point, act = _point_and_dtype(profile, "rope", op, x, dtype)
    if cos.dim() < x.dim():  # [*lead, rot/2], lead dims broadcast from the right: add the heads axis
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        ones = (1,) * (x.dim() - cos.dim())
        cos, sin = cos.reshape(*ones, *cos.shape), sin.reshape(*ones, *sin.shape)
    if cos.dim() != x.dim() or cos.shape[-2] not in (1, heads):
        raise InputError(
            f"rope: cos/sin must be [*lead, rot/2] or [*lead, 1 or heads, rot/2] for x of shape {tuple(x.shape)}, "
            f"got {tuple(cos.shape)}"
        )
    hc = cos.shape[-2]
    try:
        cos = cos.expand(*lead, hc, half)
        sin = sin.expand(*lead, hc, half)
    except RuntimeError:
        raise InputError(f"rope: cos/sin of shape {tuple(cos.shape)} do not broadcast to x's lead dims {tuple(lead)}") from None
    t = _math.prod(lead)
    x3 = x.reshape(t, heads, head_dim)
    cs3 = _rows_last(cos.float().reshape(t, hc, half))
    sn3 = _rows_last(sin.float().reshape(t, hc, half))
    backend = _backend_for(x.device)
    with _fp32_math(x3.device):
        if torch.compiler.is_compiling():
            y = rope_op(x3, cs3, sn3, point_key(point), style, act, backend)
        else:
            y = RoPEFunction.apply(x3, cs3, sn3, point, style, act, backend)
    return y.reshape(x.shape)


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def swiglu(gate: torch.Tensor, up: torch.Tensor, profile: ProfileLike, *,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * up at the profile's SwiGLU point; gate and up in the activation dtype, same
    shape (any leading shape, any strides, e.g. the two halves of a fused gate_up output).
    ``dtype``: the activation dtype, if given (gate must be in it). Gradients flow to gate and up."""
    op = "swiglu"
    _check_float(op, gate=gate, up=up)
    if gate.shape != up.shape:
        raise InputError(f"swiglu: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype or gate.dtype not in ACT_DTYPES.values():
        raise InputError(f"swiglu: gate and up must both be bfloat16 or both float16, got {gate.dtype} and {up.dtype}")
    if gate.dim() == 0:
        raise InputError("swiglu: gate and up must have at least one dim")
    point, act = _point_and_dtype(profile, "swiglu", op, gate, dtype)
    n = gate.shape[-1]
    m = _math.prod(gate.shape[:-1])
    g2, u2, backend = gate.reshape(m, n), up.reshape(m, n), _backend_for(gate.device)
    with _fp32_math(g2.device):
        if torch.compiler.is_compiling():
            y = swiglu_op(g2, u2, point_key(point), act, backend)
        else:
            y = SwiGLUFunction.apply(g2, u2, point, act, backend)
    return y.reshape(gate.shape)


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if x.dim() == 0:
        raise InputError(f"{op}: x must be [*lead, hidden], got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise InputError(f"{op}: weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise InputError(f"{op}: eps must be a non-negative float, got {eps!r}")


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, profile: ProfileLike, *, dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm without a residual add at the profile's ``rmsnorm`` point.

    x: [*lead, hidden] in the activation dtype (or FP32 with ``dtype``); weight: [hidden], any
    float dtype. Returns the activation dtype, or FP32 when the profile's ``output`` site is fp32
    (the value is handed on unrounded to a fused next region, e.g. a q/k norm into RoPE).
    Gradients flow to x and weight. ``backend``: this call's backend (default: :func:`current_backend`).
    """
    op = "rmsnorm"
    _check_float(op, x=x, weight=weight)
    _check_norm(op, x, weight, eps)
    point, act = _point_and_dtype(profile, "rmsnorm", op, x, dtype)
    x2, w, backend = _rows(x), weight.contiguous(), _backend_for(x.device, backend)
    with _fp32_math(x2.device):
        if torch.compiler.is_compiling() and backend != "reference-inductor":
            y = rmsnorm_op(x2, w, float(eps), point_key(point), act, backend)
        else:
            y = RMSNormFunction.apply(x2, w, float(eps), point, act, backend)
    return y.reshape(x.shape)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    profile: ProfileLike,
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused into RMSNorm at the profile's ``add_rmsnorm`` point.

    s = x + residual (FP32); returns (output, residual passed on). x: [*lead, hidden] in the
    activation dtype; residual: same shape, activation dtype or FP32 (an FP32 residual stream);
    weight: [hidden]. The output is in the activation dtype; the residual passed on is in the
    activation dtype or FP32, as the profile's ``residual_out`` site says. Gradients flow to x,
    residual and weight (d x = d residual = the gradient of s). ``backend``: this call's backend
    (default: :func:`current_backend`).
    """
    op = "add_rmsnorm"
    _check_float(op, x=x, residual=residual, weight=weight)
    _check_norm(op, x, weight, eps)
    if residual.shape != x.shape:
        raise InputError(f"add_rmsnorm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    point, act = _point_and_dtype(profile, "add_rmsnorm", op, x, dtype)
    x2, r2, w, backend = _rows(x), _rows(residual), weight.contiguous(), _backend_for(x.device, backend)
    with _fp32_math(x2.device):
        if torch.compiler.is_compiling() and backend != "reference-inductor":
            out, res = add_rmsnorm_op(x2, r2, w, float(eps), point_key(point), act, backend)
        else:
            out, res = AddRMSNormFunction.apply(x2, r2, w, float(eps), point, act, backend)
    return out.reshape(x.shape), res.reshape(x.shape)


# -- MoE experts ----------------------------------------------------------------------------------


def moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    profile: ProfileLike,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A sparse MoE block's experts at the profile's ``moe`` point: for each token, the sum over its
    top-k experts e of ``w * down_e(silu(gate_e(x)) * up_e(x))``, rounded where the point says
    (:func:`engineprofiles.regions.moe_ref`, bit for bit).

    x: [tokens, hidden] in the activation dtype; w13: [experts, 2 * inter, hidden] (gate rows, then
    up: HF's ``gate_up_proj``); w2: [experts, hidden, inter] (HF's ``down_proj``); topk_weights:
    [tokens, k], the router's FP32 weights (or already in the activation dtype); topk_ids: [tokens, k]
    expert ids. Returns [tokens, hidden] in the activation dtype. Gradients flow to x, w13, w2 and
    topk_weights: the gradient of the FP32 function with rounding treated as identity, in FP32
    (:mod:`emulator.ops.moe`). No Triton kernel: every backend runs the torch reference on the
    tensors' device (``reference-portable`` with portable math). Under torch.compile it runs
    eagerly (a graph break), so compiled code computes the eager bits.
    """
    op = "moe"
    _check_float(op, x=x, w13=w13, w2=w2, topk_weights=topk_weights)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.is_floating_point() or topk_ids.is_complex() \
            or topk_ids.dtype == torch.bool:
        raise InputError(f"moe: topk_ids must be a tensor of integer expert ids, got "
                         f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)}")
    if topk_ids.device != x.device:
        raise InputError(f"moe: topk_ids is on {topk_ids.device}, x on {x.device}; all tensors must be on one device")
    act_dtypes = tuple(ACT_DTYPES.values())
    if x.dtype not in act_dtypes or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise InputError(f"moe: x, w13 and w2 must share an activation dtype (bfloat16 or float16); got {x.dtype}, "
                         f"{w13.dtype}, {w2.dtype}")
    if topk_weights.dtype not in (torch.float32, x.dtype):
        raise InputError(f"moe: topk_weights must be float32 (the router's weights) or {x.dtype}, got "
                         f"{topk_weights.dtype}")
    try:
        check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    except ValueError as e:
        raise InputError(str(e)) from None
    point, _ = _point_and_dtype(profile, "moe", op, x, dtype)
    math = "portable" if _backend_for(x.device) == "reference-portable" else "torch"
    with _fp32_math(x.device):
        if torch.compiler.is_compiling():
            return _moe_eager(x, w13, w2, topk_weights, topk_ids, point, math)
        return MoEFunction.apply(x, w13, w2, topk_weights, topk_ids, point, math)


def _moe_eager(x, w13, w2, topk_weights, topk_ids, point, math):  # noqa: ANN001, ANN202
    return MoEFunction.apply(x, w13, w2, topk_weights, topk_ids, point, math)


_moe_eager = torch.compiler.disable(_moe_eager)


def shared_expert(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: torch.Tensor,
    routed: torch.Tensor,
    profile: ProfileLike,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A sparse MoE block's output with its shared expert, at the profile's ``shared_expert`` point:
    ``m = routed + sigmoid(x @ w_gate^T) * down(silu(gate) * up)``, rounded where the point says
    (:func:`engineprofiles.regions.shared_block_ref`, bit for bit).

    x: [tokens, hidden] in the activation dtype; w_gate_up: [2 * inter, hidden] (the shared expert's
    gate_proj rows, then up_proj's); w_down: [hidden, inter]; w_gate: [1, hidden] (the shared expert's
    gate); routed: [tokens, hidden], the routed experts' output (:func:`moe`). Returns m [tokens,
    hidden]: FP32 where the point keeps ``sum`` FP32 (hand it to :func:`add_rmsnorm` as it is: the
    next residual add rounds once), else in the activation dtype. Gradients flow to x, the three
    weights and routed: the gradient of the FP32 function with rounding treated as identity, in FP32
    (:mod:`emulator.ops.shared_expert`). No Triton kernel: every backend runs the torch reference on
    the tensors' device (``reference-portable`` with portable math). Under torch.compile it runs
    eagerly (a graph break).
    """
    op = "shared_expert"
    _check_float(op, x=x, w_gate_up=w_gate_up, w_down=w_down, w_gate=w_gate, routed=routed)
    act_dtypes = tuple(ACT_DTYPES.values())
    if x.dtype not in act_dtypes:
        raise InputError(f"shared_expert: x must be in an activation dtype (bfloat16 or float16), got {x.dtype}")
    try:
        check_shared_inputs(x, w_gate_up, w_down, w_gate, routed)
    except ValueError as e:
        raise InputError(str(e)) from None
    point, _ = _point_and_dtype(profile, "shared_expert", op, x, dtype)
    math = "portable" if _backend_for(x.device) == "reference-portable" else "torch"
    with _fp32_math(x.device):
        if torch.compiler.is_compiling():
            return _shared_expert_eager(x, w_gate_up, w_down, w_gate, routed, point, math)
        return SharedExpertFunction.apply(x, w_gate_up, w_down, w_gate, routed, point, math)


def _shared_expert_eager(x, w_gate_up, w_down, w_gate, routed, point, math):  # noqa: ANN001, ANN202
    return SharedExpertFunction.apply(x, w_gate_up, w_down, w_gate, routed, point, math)


_shared_expert_eager = torch.compiler.disable(_shared_expert_eager)


# -- exact mode: attention ------------------------------------------------------------------------


def attention_point(profile: ProfileLike, op: str = "attention") -> Point:
    """The profile's attention point (exact mode), with a clear error when it was not measured."""
    if isinstance(profile, Point):
        if profile.region != "attention":
            raise ProfileMismatch(f"{op} needs a point of the attention lattice, got a point of region {profile.region!r}")
        return profile
    prof = _profile(profile)
    if not prof.available("attention"):
        raise RegionUnavailable(
            f"profile {prof.canonical_name} has no measured attention ({prof.attention.evidence.reason}); exact mode "
            "needs the engine's attention: re-probe the engine with this version of engineprofiles (schema version 2, "
            "e.g. `probe-engine vllm` in situ), or use a shipped profile whose attention was measured"
        )
    return prof.point("attention")


def _check_mask(mask: object, q: torch.Tensor, k: torch.Tensor) -> None:
    """HF's 4D mask [B or 1, 1, >= Tq or 1, >= Tk or 1] (its last Tq rows and Tk columns are used) or [Tq, Tk]."""
    if not isinstance(mask, torch.Tensor):
        raise InputError(f"attention: attention_mask must be a tensor or None, got {type(mask).__name__}")
    b, tq, tk, m = q.shape[0], q.shape[2], k.shape[2], tuple(mask.shape)
    if mask.dim() == 2:
        ok = m == (tq, tk)
    else:
        ok = mask.dim() == 4 and m[1] == 1 and m[0] in (1, b) and (m[2] >= tq or m[2] == 1) and (m[3] >= tk or m[3] == 1)
    if not ok:
        raise InputError(f"attention: attention_mask must be [B or 1, 1, Tq, Tk] (shared by the heads) or [Tq, Tk] for "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}; got {m}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, profile: ProfileLike, *, scale: float | None = None,
              attention_mask: torch.Tensor | None = None, kv_split: KVSplit | None = None,
              kernels: str = "") -> torch.Tensor:
    """Attention exactly as the profile's engine computes it (exact mode).

    q: [B, Hq, Tq, D], k and v: [B, Hk, Tk, D] in the activation dtype (Hk divides Hq);
    ``attention_mask``: None (causal, the queries being the last Tq positions) or HF's 4D mask
    ([B, 1, Tq, Tk], boolean or additive). ``scale`` defaults to D**-0.5. Returns [B, Hq, Tq, D].
    The backward is the gradient of FP32 softmax attention (the output rounding straight-through).
    Every backend runs the bit-portable torch reference (no kernel). ``kv_split``
    (:class:`engineprofiles.regions.attention.KVSplit`): the engine splits long rows' keys across
    threads (vLLM's CPU attention with ``VLLM_CPU_ATTN_SPLIT_KV=1``); each batch row is computed as
    that engine computes one request alone, queries and keys as given (a decode step: one query).
    ``kernels``: an engine whose own attention kernel computes the rows (loaded into
    ``ops.attention.ENGINE_KERNELS`` by ``apply_profile(..., kernels=)``); "" the portable reference."""
    if kv_split is not None and not isinstance(kv_split, KVSplit):
        raise InputError(f"attention: kv_split must be a KVSplit or None, got {type(kv_split).__name__}")
    if kernels and kernels not in ENGINE_KERNELS:
        raise InputError(f"attention: no engine kernel {kernels!r} is loaded (apply_profile(..., exact=True, "
                         f"kernels='engine') loads the profile's engine's); loaded: {', '.join(ENGINE_KERNELS) or 'none'}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"attention: {name} must be a tensor, got {type(t).__name__}")
    _check_float("attention", q=q, k=k, v=v)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] \
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise InputError(f"attention: q must be [B, Hq, Tq, D] and k, v [B, Hk, Tk, D] with Hk dividing Hq; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[2] == 0 and q.numel():
        raise InputError(f"attention: k and v hold no position (Tk = 0) for {q.shape[2]} queries; every query attends "
                         "to at least one key")
    if attention_mask is not None:
        _check_mask(attention_mask, q, k)
    point = attention_point(profile)
    if not isinstance(profile, Point):
        prof = _profile(profile)
        act = ACT_DTYPES[prof.dtype]
        if q.dtype != act:
            raise ProfileMismatch(f"attention: q is {q.dtype}, but profile {prof.canonical_name} was measured in {prof.dtype}")
    if len({q.dtype, k.dtype, v.dtype}) > 1 or q.dtype not in tuple(ACT_DTYPES.values()):
        raise InputError(f"attention: q, k and v must share an activation dtype (bfloat16 or float16); got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    try:
        s = float(scale) if scale is not None else (q.shape[-1] ** -0.5 if q.shape[-1] else 1.0)
    except (TypeError, ValueError):
        raise InputError(f"attention: scale must be a number (or None for D**-0.5), got {type(scale).__name__}") from None
    with _fp32_math(q.device):
        if torch.compiler.is_compiling():
            return attention_op(q, k, v, point_key(point), s, attention_mask, kv_split_key(kv_split), kernels)
        return ExactAttentionFunction.apply(q, k, v, point, s, attention_mask, kv_split, kernels)

