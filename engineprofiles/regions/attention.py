"""Attention: what exact mode consumes (not one of the three regions of the profile proper).

Per query row (one head, one token), with the keys it may see:

    qs = q * scale (FP32) or q                 # variant: scale (query | logits)
    l_j = qs . k_j, summed over the head dim   # variant: qk_dot (fma | mul_add | matmul)
    l_j = l_j * scale                          (scale: logits)
    l_j = round(l_j)?                          # site: logits
    m = max_j l_j
    p_j = exp(l_j - m)                         # variant: exp (poly5_fma | correctly_rounded | torch | vec16_fexp_u20
                                               #               | glibc_expf)
    s = sum_j p_j                              # variant: row_sum (lanes16_tree | lanes16_sequential | sequential | torch
                                               #                   | vec16_tree_tail | lanes16_halves_sequential)
    normalize: p_j = p_j / s here (before_pv), or the output is scaled at the end   # variant: normalize
    p_j = round(p_j)?                          # site: probs
    o = sum_j p_j v_j over the keys            # variant: pv_dot (fma | mul_add | matmul)
    o = o * fp32(1 / fp64(s)) (reciprocal_f64) or o / s (divide)
    out = round(o)                             (the output, converted once)   # variant: output (nearest | truncate)

``fma`` and ``mul_add`` accumulate sequentially over the reduced dimension in FP32 (key 0 first for
P·V, lane 0 first for q·k), each step one fused multiply-add or a multiply and an add;
``matmul`` is torch's FP32 matmul on the tensor's device. ``lanes16_*`` sums key j into lane
j mod 16 in key order, then adds the 16 lanes as a tree (8+8, 4+4, 2+2, 1+1) or in lane order.
``lanes16_halves_sequential`` accumulates the same 16 lanes, held as two 8-lane halves, and adds each
half in lane order from 0 (lanes 0..7, then 8..15) before adding the two halves' sums.
``poly5_fma`` is exp by a single-constant Cody-Waite reduction, a degree-5 polynomial evaluated with
fused multiply-adds and a scaling by 2^(n-1)*2; ``correctly_rounded`` is exp rounded once to FP32.
``glibc_expf`` is the C library's scalar ``expf`` called on every element (glibc 2.28 and later, x86-64
with FMA: a table of 32 powers 2^(i/32), a cubic in FP64 evaluated with fused multiply-adds, one
rounding to FP32), which is not always correctly rounded; :func:`exp_glibc_expf` computes it in FP64.
``output``: the FP32 output converted to the activation dtype rounding to nearest even (``nearest``)
or by dropping the low 16 bits of BF16's FP32 pattern (``truncate``, BF16 only).

vLLM's CPU kernel with its AVX2 build (``_C_AVX2``: the ``vec`` ISA without AVX-512) is the point
``scale=query qk_dot=mul_add exp=glibc_expf row_sum=lanes16_halves_sequential pv_dot=mul_add
normalize=reciprocal_f64 output=truncate``, both sites FP32; its AVX-512 build is the same kernel with
FMAs, the polynomial exp, a tree over the 16 lanes and a rounded output.

``vec16_*`` are torch's CPU flash attention (``scaled_dot_product_attention`` on CPU in BF16/FP16,
AVX512: 16 FP32 lanes), which SGLang's CPU engine calls (its ``torch_native`` backend). A row of L
keys (every key of the call, masked ones included) is split into its whole 16-lane vectors (keys
0 .. 16*floor(L/16) - 1) and a tail: ``vec16_fexp_u20`` is at::vec's ``fexp_u20`` (Malossi et al.'s
fast exp: a cubic correction of 2^frac written into the exponent bits, good to about 1e-5) on the
vectors and exp rounded once (libm) on the tail; ``vec16_tree_tail`` sums the vectors lane-wise, adds
the 16 lanes as a tree, then adds the tail keys in order (a row of fewer than 16 keys is a sequential
sum, unlike ``lanes16_tree``). The kernel takes keys in blocks of 512 with an online softmax; the
reference models one block, so it refuses rows of more than 512 keys at these options rather than
compute other bits.

Every FP32 step is an IEEE operation computed with torch (fused multiply-adds through
:func:`engineprofiles.portable.fma`), so the reference computes the same bits on any device.
It is written for clarity, not speed: exact mode pays for it (scripts/bench_exact.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import portable
from ..rounding import act_dtype, round_to
from .base import ROUNDED, Point, RegionSpec, site, variant

SPEC = RegionSpec(
    name="attention",
    title="Attention",
    doc="softmax(q k^T * scale) v per query row over the keys it may see, rounded once at the end",
    sites=(
        site("logits", "q.k (scaled) rounded to the activation dtype before the softmax"),
        site("probs", "the softmax weights rounded to the activation dtype before they multiply v"),
    ),
    variants=(
        variant("scale", ("query", "logits"), "where the softmax scale multiplies: q in FP32 before the dot, or the dot"),
        variant("qk_dot", ("fma", "mul_add", "matmul"),
                "q.k: sequential over the head dim with fused multiply-adds, with separate multiply and add, or "
                "torch's FP32 matmul"),
        variant("exp", ("poly5_fma", "correctly_rounded", "torch", "vec16_fexp_u20", "glibc_expf"),
                "exp: degree-5 polynomial with FMAs (vectorized kernels), exp rounded once, torch.exp in FP32, "
                "torch's CPU flash attention (fexp_u20 on whole 16-lane vectors of the row, exp rounded once on the "
                "rest), or glibc's scalar expf on every element (FP64 table and cubic with FMAs)"),
        variant("row_sum", ("lanes16_tree", "lanes16_sequential", "sequential", "torch", "vec16_tree_tail",
                            "lanes16_halves_sequential"),
                "sum of the softmax numerators: 16 lanes (key j in lane j mod 16) added as a tree or in lane "
                "order, one sequential sum, torch.sum, torch's CPU flash attention (the whole 16-lane vectors "
                "lane-wise, the lanes as a tree, then the rest in order), or the 16 lanes as two halves of 8, "
                "each added in lane order, then the two sums"),
        variant("pv_dot", ("fma", "mul_add", "matmul"),
                "p.v: sequential over the keys with fused multiply-adds, with separate multiply and add, or "
                "torch's FP32 matmul"),
        variant("normalize", ("reciprocal_f64", "divide", "before_pv"),
                "the division by the sum: output times fp32(1/fp64(sum)), output / sum, or the weights divided "
                "before they multiply v"),
        # ``output`` came after profiles were shipped (2026-12-05): a profile without it rounds to nearest.
        variant("output", ("nearest", "truncate"),
                "the FP32 output converted to the activation dtype: rounded to nearest even, or truncated "
                "(the low 16 bits of the FP32 pattern dropped; BF16 only)", default="nearest"),
    ),
)

# The constants of the poly5_fma exp, as FP32 bit patterns where the kernels write them so.
_LN_FLT_MIN = 0xC2AEAC50  # ~ -87.34
_LN_FLT_MAX = 0x42B17218  # ~ 88.72
_LOG2E = 0x3FB8AA3B
_LN2 = 0x3F317218
_POLY5 = (0.00828929059, 0.0418978221, 0.166676521, 0.499991506, 0.999999701, 1.0)  # Horner order


def _bits_f32(u: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(u - (1 << 32) if u >= 1 << 31 else u, dtype=torch.int32, device=like.device).view(torch.float32)


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def exp_poly5_fma(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0 the way vectorized CPU attention kernels compute it (FP32, FMAs)."""
    lo, hi = _bits_f32(_LN_FLT_MIN, x), _bits_f32(_LN_FLT_MAX, x)
    underflow = x < lo
    src = torch.maximum(torch.minimum(x, hi), lo)
    fx = torch.floor(portable.fma(src, _bits_f32(_LOG2E, x), _f32(0.5, x)))
    r = portable.fma(-fx, _bits_f32(_LN2, x), src)
    poly = portable.fma(r, _f32(_POLY5[0], x), _f32(_POLY5[1], x))
    for c in _POLY5[2:]:
        poly = portable.fma(r, poly, _f32(c, x))
    n = (fx - 1.0).to(torch.int32)
    scale = ((n + 127) << 23).view(torch.float32)
    scale = torch.where(underflow, torch.zeros_like(scale), scale)
    return poly * scale * _f32(2.0, x)


# at::vec's fexp_u20 (aten/src/ATen/cpu/vec): the cubic's coefficients as the kernel writes them
# (FP32 of these decimals), 2^23 and 2^23 * 127.
_FEXP_C = (0.00010703434948458272, 0.30354260500649682, -0.22433836478672356, -0.079204240219773236)
_FEXP_A, _FEXP_B = 8388608.0, 1065353216.0
VEC16_MAX_KEYS = 512  # torch's CPU flash attention takes keys in blocks of 512 (kvSplitSize)


def exp_fexp_u20(x: torch.Tensor) -> torch.Tensor:
    """exp(x) as at::vec's ``fexp_u20`` computes it (FP32, FMAs): 2^(x log2 e) with the fraction's
    2^f approximated by 1 + f - K(f), K a cubic, written straight into the exponent and mantissa bits
    (truncated to an integer); below ln(FLT_MIN) 0, above ln(FLT_MAX) +inf."""
    lo, hi = _bits_f32(_LN_FLT_MIN, x), _bits_f32(_LN_FLT_MAX, x)
    under, over = x < lo, x > hi
    src = x * _bits_f32(_LOG2E, x)
    frac = src - torch.floor(src)
    k = portable.fma(frac, _f32(_FEXP_C[3], x), _f32(_FEXP_C[2], x))
    k = portable.fma(frac, k, _f32(_FEXP_C[1], x))
    k = portable.fma(frac, k, _f32(_FEXP_C[0], x))
    # finite inputs only reach the integer conversion (inf and nan are masked below or never occur:
    # x = logit - max <= 0)
    t = portable.fma(_f32(_FEXP_A, x), torch.nan_to_num(src - k, nan=0.0, posinf=0.0, neginf=0.0), _f32(_FEXP_B, x))
    i = torch.clamp(t, min=0.0).to(torch.int32)  # truncation toward zero (cvtt)
    i = torch.where(under, torch.zeros_like(i), i)
    i = torch.where(over, torch.full_like(i, 0x7F800000), i)
    return i.view(torch.float32)


# glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, glibc >= 2.28): N = 2^EXP2F_TABLE_BITS = 32 table
# entries, 1/ln2 * N, the shift that rounds to an integer, and the cubic's coefficients for 2^(r/N) - 1
# (the unscaled ones, as published; the scaling by powers of N is exact).
_EXPF_N = 32
_EXPF_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _EXPF_N
_EXPF_SHIFT = float.fromhex("0x1.8p+52")
_EXPF_POLY = (float.fromhex("0x1.c6af84b912394p-5") / _EXPF_N ** 3,
              float.fromhex("0x1.ebfce50fac4f3p-3") / _EXPF_N ** 2,
              float.fromhex("0x1.62e42ff0c52d6p-1") / _EXPF_N)
_EXPF_UNDERFLOW = float.fromhex("-0x1.9fe368p6")  # below: 0 (glibc's underflow)
_EXPF_OVERFLOW = float.fromhex("0x1.62e42ep6")  # above: +inf


def _expf_table() -> list[int]:
    """The FP64 bit patterns of 2^(i/N), i < N, rounded to nearest, minus i << (52 - 5): glibc's
    ``__exp2f_data.tab``, computed here (decimal arithmetic, 60 digits) instead of written down."""
    import decimal
    import struct

    ctx = decimal.Context(prec=60)
    out = []
    for i in range(_EXPF_N):
        v = float(ctx.power(decimal.Decimal(2), ctx.divide(decimal.Decimal(i), decimal.Decimal(_EXPF_N))))
        out.append(struct.unpack("<q", struct.pack("<d", v))[0] - (i << (52 - 5)))
    return out


_EXPF_TAB = _expf_table()


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _two_prod(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a*b = p + e exactly (FP64, Dekker's product; finite values far from overflow)."""
    p = a * b
    ca, cb = a * 134217729.0, b * 134217729.0  # 2^27 + 1
    ah, bh = ca - (ca - a), cb - (cb - b)
    al, bl = a - ah, b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def fma_f64(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded FP64 fused multiply-add ``a*b + c`` from FP64 operations (finite operands whose
    product is far from overflow and underflow, as in :func:`exp_glibc_expf`): the exact product
    p + e, then p + c split exactly (TwoSum) into th + tl, and th + (tl + e) with the inner sum
    rounded to odd, which makes the outer rounding the one rounding of the exact sum (Boldo and
    Melquiond's correctly rounded sum of three numbers)."""
    a, b, c = torch.broadcast_tensors(*(torch.as_tensor(t, dtype=torch.float64, device=a.device) for t in (a, b, c)))
    ph, pl = _two_prod(a, b)
    th, tl = _two_sum(c, ph)
    s, e = _two_sum(tl, pl)
    sb = s.view(torch.int64)
    odd = (e != 0) & ((sb & 1) == 0)  # inexact and even: move one ulp toward the error
    away = (e > 0) == (s > 0)
    s = torch.where(odd, (sb + torch.where(away, 1, -1)).view(torch.float64), s)
    return th + s


def exp_glibc_expf(x: torch.Tensor) -> torch.Tensor:
    """glibc's scalar ``expf`` (x86-64 with FMA, glibc 2.28 and later), computed in FP64 with torch:
    k = round(x * N/ln2) (the product fused with the rounding shift), r = x * N/ln2 - k (fused, one
    rounding), 2^(k/N) from the table with k // N added to the exponent, the cubic by fused
    multiply-adds, the product rounded to FP64, then once to FP32. Checked bit for bit against the C
    library's expf on every FP32 value in [-87, 0] (tests/engineprofiles/test_attention.py samples it)."""
    xd = x.double()
    under = xd < _EXPF_UNDERFLOW
    over = xd > _EXPF_OVERFLOW
    bad = ~torch.isfinite(xd) | under | over
    xs = torch.where(bad, torch.zeros_like(xd), xd)
    kd = fma_f64(xs, _EXPF_INVLN2N, _EXPF_SHIFT)  # round to an integer (ties to even) in the low bits
    ki = kd.view(torch.int64)
    kd = kd - _EXPF_SHIFT
    r = fma_f64(xs, _EXPF_INVLN2N, -kd)
    tab = torch.tensor(_EXPF_TAB, dtype=torch.int64, device=x.device)
    s = (tab[ki % _EXPF_N] + (ki << (52 - 5))).view(torch.float64)
    z = fma_f64(r, _EXPF_POLY[0], _EXPF_POLY[1])
    r2 = r * r
    y = fma_f64(r, _EXPF_POLY[2], 1.0)
    y = fma_f64(z, r2, y)
    out = (y * s).float()
    out = torch.where(under, torch.zeros_like(out), out)
    out = torch.where(over, torch.full_like(out, float("inf")), out)
    return torch.where(torch.isnan(x) | torch.isinf(x), torch.exp(x), out)  # exp(-inf) = 0, inf, nan


def _vec16_split(n: int) -> int:
    """The keys in whole 16-lane vectors of a row of n keys."""
    return 16 * (n // 16)


def _exp(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "poly5_fma":
        return exp_poly5_fma(x)
    if how == "correctly_rounded":
        return torch.exp(x.double()).float()
    if how == "vec16_fexp_u20":
        nv = _vec16_split(x.shape[-1])
        return torch.cat((exp_fexp_u20(x[..., :nv]), torch.exp(x[..., nv:].double()).float()), -1)
    if how == "glibc_expf":
        return exp_glibc_expf(x)
    return torch.exp(x)


def _row_sum(p: torch.Tensor, how: str) -> torch.Tensor:
    if how == "torch":
        return p.sum(-1)
    if how == "vec16_tree_tail":
        nv = _vec16_split(p.shape[-1])
        acc = _row_sum(p[..., :nv], "lanes16_tree") if nv else torch.zeros_like(p[..., 0])
        for j in range(nv, p.shape[-1]):
            acc = acc + p[..., j]
        return acc
    if how == "sequential":
        acc = torch.zeros_like(p[..., 0])
        for j in range(p.shape[-1]):
            acc = acc + p[..., j]
        return acc
    n = p.shape[-1]
    pad = (-n) % 16
    pp = torch.nn.functional.pad(p, (0, pad)) if pad else p
    chunks = pp.reshape(*p.shape[:-1], (n + pad) // 16, 16)
    lanes = torch.zeros_like(chunks[..., 0, :])
    for c in range(chunks.shape[-2]):
        lanes = lanes + chunks[..., c, :]
    if how == "lanes16_halves_sequential":
        lo, hi = lanes[..., 0], lanes[..., 8]
        for i in range(1, 8):
            lo = lo + lanes[..., i]
            hi = hi + lanes[..., 8 + i]
        return lo + hi
    if how == "lanes16_sequential":
        acc = lanes[..., 0]
        for i in range(1, 16):
            acc = acc + lanes[..., i]
        return acc
    while lanes.shape[-1] > 1:  # lanes16_tree: i + i+8, then i + i+4, ...
        h = lanes.shape[-1] // 2
        lanes = lanes[..., :h] + lanes[..., h:]
    return lanes[..., 0]


def _dot_seq(a: torch.Tensor, b: torch.Tensor, fused: bool) -> torch.Tensor:
    """sum_k a[..., i, k] * b[..., k, j], sequential over k from 0, in FP32."""
    if fused:
        return portable.dot_fma(a, b)
    acc = torch.zeros(*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1],
                      dtype=torch.float32, device=a.device)
    for k in range(a.shape[-1]):
        acc = acc + a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return acc


def _dot(a: torch.Tensor, b: torch.Tensor, how: str) -> torch.Tensor:
    if how == "matmul":
        return torch.matmul(a, b)
    return _dot_seq(a, b, how == "fma")


def split_merge(point: Point) -> str:
    """How the engine whose attention is at ``point`` merges split-KV chunks (:attr:`KVSplit.merge`): vLLM's
    AVX2 build with separate multiplies and adds (its kernel has no FMA contraction: the point's ``qk_dot``
    is ``mul_add``), its AVX-512 build with FMAs."""
    return "mul_add" if point["qk_dot"] == "mul_add" else "fma"


def causal_mask(tq: int, tk: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[tq, tk] bool: query i (at position tk - tq + i) sees keys 0 .. tk - tq + i."""
    i = torch.arange(tq, device=device)[:, None] + (tk - tq)
    return torch.arange(tk, device=device)[None, :] <= i


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, point: Point, *, scale: float,
                  mask: torch.Tensor | None = None, kv_split: "KVSplit | None" = None,
                  prompt_len: int | None = None, sampled_batch: "tuple[SampledBatch, int] | None" = None,
                  ) -> torch.Tensor:
    """Reference attention of one sequence at ``point``.

    q: [Tq, Hq, D], k and v: [Tk, Hk, D] in the activation dtype (Hq a multiple of Hk: grouped
    queries share a key/value head); ``mask``: [Tq, Tk] bool, True where a query sees a key
    (default: causal, the queries being the last Tq positions). Key j is the j-th key of the
    sequence, which fixes its lane in the lanes16 sums. Rows that see no key give zeros.
    ``kv_split``: the engine splits some rows' keys into chunks computed apart and merged
    (:class:`KVSplit`, vLLM's CPU attention with ``VLLM_CPU_ATTN_SPLIT_KV=1``); None: no row is split.
    The split rows are those of this call as one engine call (``prompt_len`` None), or of the sequence
    as the engine sampled it (its first ``prompt_len`` keys a prefill, each later row a decode step:
    :meth:`KVSplit.sampled_rows`); ``sampled_batch`` (batch, index): the sequence is request ``index`` of
    an engine batch sampled together (:class:`SampledBatch`), its prompt length the batch's.
    Returns [Tq, Hq, D] in the activation dtype."""
    dt = act_dtype(q.dtype)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention_ref wants q [Tq, Hq, D] and k, v [Tk, Hk, D] with Hk dividing Hq; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    tq, hq, _ = q.shape
    tk, hk, _ = k.shape
    if mask is None:
        mask = causal_mask(tq, tk, q.device)
    if tk > VEC16_MAX_KEYS and (point["exp"] == "vec16_fexp_u20" or point["row_sum"] == "vec16_tree_tail"):
        raise ValueError(f"attention_ref: {tk} keys; the vec16 options model torch's CPU flash attention for up to "
                         f"{VEC16_MAX_KEYS} keys (one block of its online softmax), not longer rows")
    g = hq // hk
    qh = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kh = k.float().repeat_interleave(g, 1).permute(1, 2, 0)  # [Hq, D, Tk]
    vh = v.float().repeat_interleave(g, 1).transpose(0, 1)  # [Hq, Tk, D]
    s = _f32(scale, qh)
    if point["scale"] == "query":
        qh = qh * s
    logits = _dot(qh, kh, point["qk_dot"])  # [Hq, Tq, Tk]
    if point["scale"] == "logits":
        logits = logits * s
    if point["logits"] == ROUNDED:  # site: logits
        logits = round_to(logits, dt)
    logits = logits.masked_fill(~mask, float("-inf"))
    seen = mask.any(-1)  # [Tq]
    m = logits.amax(-1, keepdim=True)
    m = torch.where(seen[None, :, None], m, torch.zeros_like(m))
    p = _exp(logits - m, point["exp"])
    p = torch.where(mask, p, torch.zeros_like(p))
    total = _row_sum(p, point["row_sum"])  # [Hq, Tq]
    if point["normalize"] == "before_pv":
        p = p / total[..., None]
    if point["probs"] == ROUNDED:  # site: probs
        p = round_to(p, dt)
    out = _dot(p, vh, point["pv_dot"])  # [Hq, Tq, D]
    if kv_split is None:
        plan = []
    elif sampled_batch is not None:  # each row's position: the keys it sees, less one (causal)
        batch, index = sampled_batch
        plan = kv_split.sampled_rows(batch.prompt_lengths[index], (mask.sum(-1) - 1).tolist(), hq, hk,
                                     batch=batch, index=index)
    elif prompt_len is None:
        plan = kv_split.plan(tq, tk, hq, hk)
    else:
        plan = kv_split.sampled_rows(prompt_len, (mask.sum(-1) - 1).tolist(), hq, hk)
    if plan and (point["normalize"] == "before_pv" or point["probs"] == ROUNDED):
        raise ValueError("attention_ref: a split-KV plan is defined for points that normalize at the end with FP32 "
                         f"weights (vLLM's CPU kernel), not normalize={point['normalize']} probs={point['probs']}")
    for row, ranges in plan:
        o_r, s_r = _split_row(logits[:, row], mask[row], vh, ranges, point, kv_split.merge)
        out[:, row], total[:, row] = o_r, s_r
    if point["normalize"] == "reciprocal_f64":
        out = (1.0 / total.double()).float()[..., None] * out
    elif point["normalize"] == "divide":
        out = out / total[..., None]
    out = torch.where(seen[None, :, None], out, torch.zeros_like(out))
    if point["output"] == "truncate":
        return truncate_to(out.contiguous(), dt).to(dt).transpose(0, 1)  # region output
    return round_to(out.contiguous(), dt).to(dt).transpose(0, 1)  # region output


@dataclass(frozen=True)
class KVSplit:
    """vLLM's CPU attention splitting a query row's keys across threads (``VLLM_CPU_ATTN_SPLIT_KV=1``,
    vLLM's default): :meth:`plan` for one request alone in the batch (as the engine samples in
    `probe-engine mismatch`), :meth:`plan_batch` for one call over several requests.

    vLLM's scheduler (``torch.ops._C.get_scheduler_metadata``) gives each thread a share of the
    keys: ``share = align(sum of the query tiles' keys // threads)``, ``align`` rounding up to
    ``kv_block_alignment``, a query tile being ``max_q_heads_per_iter // group`` tokens (one token
    where the group of query heads per KV head does not divide ``max_q_heads_per_iter``) that reads
    the keys up to its last query, aligned.
    Only a last query tile of one token (every decode step) may be split: its keys go in chunks of
    ``max(share left, min_split)`` keys (``min_split = align(4 * max_q_heads_per_iter)``), one per
    thread, until what is left fits the share plus ``min_split`` or the last thread takes it.

    Each chunk is attention over its keys alone at the profile's point (its own max, exp, lane sum
    and P.V, the lanes counted from the chunk's first key, a multiple of 16), unnormalized. The
    chunks then merge in key order: with the running (M, S, O) and a chunk's (m, s, o),
    r = expf(min(M, m) - max(M, m)) (the C library's scalar expf), the smaller side scaled by r:
    ``S = S + r*s, O = O + o*r`` when M > m, else ``S = r*S + s, O = o + O*r``, each product and sum
    fused into one multiply-add where ``merge`` is ``fma``, two roundings where it is ``mul_add``;
    M = max(M, m). The output is O * fp32(1 / fp64(S)), converted once, as unsplit rows.

    ``threads`` is the engine's OpenMP thread count (a capture records it as ``attention.torch_threads``).
    The defaults are vLLM 0.32.0's ``vec`` ISA (its AVX-512 and AVX2 builds: 8 query heads per
    iteration, keys aligned to 32), measured against the scheduler op (scripts/check_split_kv_attention.py);
    other ISAs (AMX) were not measured.
    """

    threads: int
    max_q_heads_per_iter: int = 8
    kv_block_alignment: int = 32
    merge: str = "fma"

    def __post_init__(self):
        for name in ("threads", "max_q_heads_per_iter", "kv_block_alignment"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"KVSplit.{name} must be a positive integer, got {v!r}")
        if self.kv_block_alignment % 16:
            raise ValueError(f"KVSplit.kv_block_alignment must be a multiple of 16 (the kernel's lanes), "
                             f"got {self.kv_block_alignment}")
        if self.merge not in ("fma", "mul_add"):
            raise ValueError(f"KVSplit.merge must be 'fma' or 'mul_add', got {self.merge!r}")

    def plan(self, tq: int, tk: int, hq: int, hk: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """The split rows of a causal call of ``tq`` queries (the last ``tq`` positions) over ``tk``
        keys, one request alone: (query row, [(first key, end key), ...]) for each row the engine
        splits; [] for none."""
        return [(row, ranges) for _, row, ranges in self.plan_batch([(tq, tk)], hq, hk)]

    def plan_batch(self, requests: list[tuple[int, int]] | tuple[tuple[int, int], ...], hq: int,
                   hk: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """The split rows of one engine call over several requests, in the batch's order, each
        ``(tq, tk)`` a causal request of ``tq`` queries over ``tk`` keys: (request, query row,
        [(first key, end key), ...]) for each row the engine splits. The scheduler walks the requests'
        query tiles in order with one share for the whole call (the sum of every request's tiles),
        a thread's keys carrying over from one request to the next: what a request's decode step
        splits depends on the whole batch."""
        a, mq, threads = self.kv_block_alignment, self.max_q_heads_per_iter, self.threads
        group = hq // hk
        # a tile's queries: the tokens whose heads of one group fill an iteration; one token where the
        # group does not divide it (measured: groups of 6 and 7)
        q_tile = mq // group if mq % group == 0 else 1
        up = lambda n: -(-n // a) * a  # noqa: E731 - round up to the alignment
        min_split = up(4 * mq)
        tiles = []  # (request, first query row, queries, keys the tile reads)
        for r, (tq, tk) in enumerate(requests):
            if tq < 1 or tk < 1:
                continue
            for t0 in range(0, tq, q_tile):
                n = min(q_tile, tq - t0)
                # a query tile reads the keys up to its last query (causal), aligned
                tiles.append((r, t0, n, up(min(tk, tk - tq + t0 + n)), tq, tk))
        if not tiles:
            return []
        share = up(sum(t[3] for t in tiles) // threads)
        thread, left, owned, items = 0, share, 0, 0  # owned: keys of the open work item; items: this thread's
        out = []
        for r, t0, n, kv_len, tq, tk in tiles:
            cur, start, ranges = kv_len, 0, []
            while cur > 0:
                if cur <= left + min_split or thread == threads - 1:
                    left -= cur
                    if left < 0:
                        left -= min_split
                    if ranges:  # the last chunk of a split row
                        ranges.append((start, tk))
                        owned = 0
                        items += 1
                    else:
                        owned += cur
                    cur = 0
                    break
                if left < min_split and (owned > 0 or items > 0):
                    thread, left, owned, items = thread + 1, share, 0, 0
                    continue
                if t0 + q_tile < tq or n > 1:  # only a last tile of one token is split
                    # (the scheduler also moves a work item to the next thread when its query tokens
                    # reach the L2-sized default tile; not modelled: hundreds of tokens in one item)
                    owned += cur
                    left -= cur
                    cur = 0
                    break
                size = min(max(left, min_split), cur)
                ranges.append((start, start + size))
                start += size
                cur -= size
                thread, left, owned, items = thread + 1, share, 0, 0
            if ranges:
                if len(ranges) == 1:  # never happens: a split has a chunk before the last
                    raise AssertionError("split plan with one chunk")
                out.append((r, t0, ranges))
        return out

    def sampled_rows(self, prompt_len: int, positions: list[int], hq: int, hk: int,
                     batch: "SampledBatch | None" = None, index: int = 0) -> list[tuple[int, list[tuple[int, int]]]]:
        """The split rows of a sequence as the engine sampled it: its first ``prompt_len`` positions
        in one prefill (whose last query may be split), every later position in a decode step of its
        own (one query over the keys up to it). ``positions``: each query row's position (-1: a row
        that sees no key, e.g. padding); returns (query row, chunks) for each split row.
        ``batch``: the sequence was request ``index`` of that batch, sampled together (its prefill and
        each decode step one engine call with the others: :meth:`SampledBatch.steps`); positions the
        engine never ran as a query (the last sampled token) are not split."""
        if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 1:
            raise ValueError(f"a prompt length is a positive integer, got {prompt_len!r}")
        if batch is not None:
            if not 0 <= index < len(batch.prompt_lengths) or batch.prompt_lengths[index] != prompt_len:
                raise ValueError(f"request {index} of {batch}: not a request with a prompt of {prompt_len} tokens")
            table = self._batch_plan(batch, hq, hk)
            return [(row, table[(index, pos)]) for row, pos in enumerate(positions) if (index, pos) in table]
        prefill = dict(self.plan(prompt_len, prompt_len, hq, hk))
        out = []
        for row, pos in enumerate(positions):
            if pos < 0:
                continue
            if pos < prompt_len:
                if pos in prefill:
                    out.append((row, prefill[pos]))
            else:
                out += [(row, ranges) for _, ranges in self._decode_plan(pos + 1, hq, hk)]
        return out

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a frozen, hashable dataclass
    def _batch_plan(self, batch: "SampledBatch", hq: int, hk: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """(request, position) -> chunks, for every split query of the batch's engine calls."""
        table = {}
        for requests in batch.steps():
            calls = [(tq, tk) for _, tq, tk in requests]
            for slot, row, ranges in self.plan_batch(calls, hq, hk):
                r, tq, tk = requests[slot]
                table[(r, tk - tq + row)] = ranges
        return table

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - a frozen, hashable dataclass; plans are small
    def _decode_plan(self, tk: int, hq: int, hk: int) -> list[tuple[int, list[tuple[int, int]]]]:
        return self.plan(1, tk, hq, hk)


def _split_row(logits: torch.Tensor, seen: torch.Tensor, vh: torch.Tensor, ranges: list[tuple[int, int]],
               point: Point, merge: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row's unnormalized output [Hq, D] and sum [Hq] from its key chunks, merged as
    :class:`KVSplit` says; ``logits`` [Hq, Tk] (scaled, masked with -inf), ``seen`` [Tk]."""
    fused = merge == "fma"
    big_m = big_s = big_o = None
    for s, e in ranges:
        lg = logits[:, s:e]
        m = lg.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = _exp(lg - m, point["exp"])
        p = torch.where(seen[s:e], p, torch.zeros_like(p))
        tot = _row_sum(p, point["row_sum"])  # [Hq]
        o = _dot(p[:, None, :], vh[:, s:e], point["pv_dot"])[:, 0]  # [Hq, D]
        m = m[:, 0]
        if big_m is None:
            big_m, big_s, big_o = m, tot, o
            continue
        keep = big_m > m  # the running side is larger: the chunk is scaled
        r = exp_glibc_expf(torch.where(keep, m - big_m, big_m - m))
        small_s, large_s = torch.where(keep, tot, big_s), torch.where(keep, big_s, tot)
        small_o, large_o = torch.where(keep[:, None], o, big_o), torch.where(keep[:, None], big_o, o)
        if fused:
            big_s = portable.fma(r, small_s, large_s)
            big_o = portable.fma(small_o, r[:, None].expand_as(small_o), large_o)
        else:
            big_s = large_s + r * small_s
            big_o = large_o + small_o * r[:, None]
        big_m = torch.maximum(big_m, m)
    return big_o, big_s


def truncate_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 to BF16 by dropping the low 16 bits of the FP32 pattern (rounding toward zero; a NaN whose
    payload sits in the low bits becomes an infinity, as in a kernel that shifts the bits); stays FP32."""
    if act_dtype(dtype) != torch.bfloat16:
        raise ValueError(f"attention output=truncate is defined for bfloat16 only, not {dtype}")
    return (x.view(torch.int32) & -65536).view(torch.float32)


def attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   mask: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """softmax(q k^T * scale) v in ``dtype`` (FP32 or FP64), differentiable, same layouts as
    :func:`attention_ref`; the function whose gradient exact mode's backward is."""
    tq, hq, _ = q.shape
    tk, hk, _ = k.shape
    if mask is None:
        mask = causal_mask(tq, tk, q.device)
    g = hq // hk
    qh = q.to(dtype).transpose(0, 1)
    kh = k.to(dtype).repeat_interleave(g, 1).transpose(0, 1)
    vh = v.to(dtype).repeat_interleave(g, 1).transpose(0, 1)
    logits = (qh @ kh.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    seen = mask.any(-1)
    w = torch.softmax(torch.where(seen[:, None], logits, torch.zeros_like(logits)), -1)
    w = torch.where(mask & seen[:, None], w, torch.zeros_like(w))
    return (w @ vh).transpose(0, 1)


@dataclass(frozen=True)
class SampledBatch:
    """Requests vLLM sampled together, in the order they were given to it: every prompt prefilled in
    one forward, then decoded together, a request leaving the batch after its last sampled token
    (``completion_lengths[i]`` tokens, the last never run as a query). When requests leave, vLLM's
    input batch moves its last request into the lowest free slot (``InputBatch.condense``), which
    reorders the rest: the order the scheduler, and so the split-KV plan, sees. vLLM 0.32.0's CPU
    platform turns async scheduling off, so a request that stops (its length, EOS or a stop token)
    has left before the next step is scheduled. Holds where the engine had room for the whole batch
    at once (``max_num_seqs`` and ``max_num_batched_tokens``: one prefill forward) and no request
    joined later, as ``LLM.generate`` with a list of prompts runs (checked against vLLM's batched
    decode, lockstep and staggered lengths: tests/engines/test_exact_mode.py)."""

    prompt_lengths: tuple[int, ...]
    completion_lengths: tuple[int, ...]

    def __post_init__(self):
        for name in ("prompt_lengths", "completion_lengths"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not v or any(
                    not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in v):
                raise ValueError(f"SampledBatch.{name} is a non-empty tuple of positive integers, got {v!r}")
        if len(self.prompt_lengths) != len(self.completion_lengths):
            raise ValueError(f"SampledBatch: {len(self.prompt_lengths)} prompt lengths and "
                             f"{len(self.completion_lengths)} completion lengths")

    def steps(self) -> list[list[tuple[int, int, int]]]:
        """The engine calls in order, each a list of (request, queries, keys) in the batch's slot
        order: the prefill of every prompt, then each decode step of the requests still running."""
        p, c = self.prompt_lengths, self.completion_lengths
        out = [[(r, p[r], p[r]) for r in range(len(p))]]
        slots: list[int | None] = list(range(len(p)))
        for s in range(max(c) - 1):
            # requests whose last token was sampled by the previous call leave: decode step s runs
            # request r's token s (position p[r] + s) while it has tokens left to sample
            removed = [i for i, r in enumerate(slots) if r is not None and c[r] - 2 < s]
            for i in removed:
                slots[i] = None
            while removed:  # vLLM's condense: the last request into the lowest free slot
                last = max(i for i, r in enumerate(slots) if r is not None) if any(
                    r is not None for r in slots) else -1
                low = min(removed)
                if low >= last:
                    break
                removed.remove(low)
                slots[low], slots[last] = slots[last], None
            while slots and slots[-1] is None:
                slots.pop()
            out.append([(r, 1, p[r] + s + 1) for r in slots if r is not None])
        return out

