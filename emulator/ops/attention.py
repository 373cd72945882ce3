"""Exact-mode attention: the forward at a profile's attention point, the backward of FP32 attention.

No Triton kernel: the forward is the bit-portable torch reference
(:func:`engineprofiles.regions.attention_ref`), which reproduces the probed engine's attention
kernel bit for bit on any device (it is written with IEEE FP32 operations and exact fused
multiply-adds), one sequence at a time. The backward is the gradient of softmax(q k^T * scale) v
computed in FP32 with the output rounding treated as identity (straight-through), like the
regions' backwards. Both are also the custom op ``emulator::attention`` (for torch.compile); its
backward runs eager autograd inside the op (``_utils.autograd_in_op``).

Masks: HF hands attention a 4D mask ([B, 1, Tq, Tk], boolean "may attend" or additive) or None
(causal, the queries being the last Tq positions). The engine runs each sequence alone, so the
keys of a batch row that are padding are dropped before the reference runs: the keys the last
query row may see (all of them if it sees none, e.g. a right-padded row), in order. That keeps
every real key at the index the engine gives it (its lane in the lane-wise sums). Query rows that
see no key get zeros, and so does a batch row that is padding only (HF accepts one).

Packed rows (several sequences in one batch row, ``position_ids`` restarting at each, no attention
mask: verl's remove-padding, TRL's padding-free; HF then hands a block-diagonal causal mask when no KV
cache is used): each sequence is computed alone, as the engine computed it. Any other mask in which a
query sees a key the row's last query does not (a sliding window, say) is refused
(:class:`~emulator.errors.InputError`), never computed over the wrong keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import torch

from engineprofiles.regions import Point, attention_fp32, attention_ref
from engineprofiles.regions.attention import KVSplit, SampledBatch, causal_mask

from ..errors import InputError
from ._utils import autograd_in_op, owned, point_from_key


def allowed_from_mask(mask: torch.Tensor | None, b: int, tq: int, tk: int, device: torch.device) -> torch.Tensor | None:
    """The [Tq, Tk] "may attend" matrix of batch row ``b`` (None: plain causal)."""
    if mask is None:
        return None
    m = mask
    if m.dim() == 4:
        if m.shape[1] != 1:
            raise InputError(f"exact attention takes masks shared by the heads ([B, 1, Tq, Tk]); got {tuple(m.shape)}")
        m = m[b if m.shape[0] > 1 else 0, 0]
    elif m.dim() == 2 and m.shape == (tq, tk):
        pass
    else:
        raise InputError(f"exact attention takes a [B, 1, Tq, Tk] or [Tq, Tk] mask; got {tuple(m.shape)}")
    if m.dtype != torch.bool:
        m = m == 0  # additive: 0 where attending, a large negative number elsewhere
    return m[-tq:, -tk:].to(device).expand(tq, tk)


_SAMPLED: contextvars.ContextVar[tuple[tuple[int, ...], SampledBatch | None] | None] = contextvars.ContextVar(
    "emulator_sampled", default=None)


def _lengths(name: str, value) -> tuple[int, ...]:
    lengths = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths):
        per = "one per batch row, or one for all" if name == "prompt lengths" else "one per batch row"
        raise InputError(f"as_sampled: {name} are positive integers ({per}); got {value!r}")
    return lengths


@contextlib.contextmanager
def as_sampled(prompt_lengths: int | list[int] | tuple[int, ...],
               completion_lengths: list[int] | tuple[int, ...] | None = None,
               rows: list[int] | tuple[int, ...] | None = None) -> Iterator[None]:
    """Within it, exact mode with ``kv_split`` computes each sequence's attention as the engine computed
    it while sampling: the first ``prompt_lengths[b]`` tokens of batch row ``b`` (not counting padding)
    in one prefill, each later position as a decode step, so that one forward over prompt and
    completion gives the rows the engine's decode gave (its split-KV decode is not its prefill).
    An int is every row's prompt length.

    Without ``completion_lengths`` each row was a request alone in the engine. With them, the lengths
    describe one engine batch, its requests in the order they were given to the engine (one prompt and
    one completion length each: the tokens the engine sampled for it), sampled together: prefilled in
    one forward, decoded together, each leaving after its last token
    (:class:`engineprofiles.regions.attention.SampledBatch`); the split of a decode step then depends on
    the whole batch. Each row must then be its request's prompt and completion, nothing more or less
    (``prompt_lengths[i] + completion_lengths[i]`` tokens, not counting padding; else
    :class:`~emulator.errors.InputError`, before any work). ``rows``: which of those requests this
    forward's batch rows are (a trainer's micro-batch of the rollout batch); default: all of them, in
    order. Without ``kv_split`` attention does not depend on either (the engine's decode and prefill
    attention agree); the lengths are checked all the same. Not thread-local beyond Python's
    contextvars."""
    lengths = _lengths("prompt lengths", prompt_lengths)
    if completion_lengths is None:
        if rows is not None:
            raise InputError("as_sampled: rows picks requests of a batch sampled together; give completion_lengths too")
        state: tuple[tuple[int, ...], SampledBatch | None] = (lengths, None)
    else:
        completions = _lengths("completion lengths", completion_lengths)
        if not isinstance(prompt_lengths, (list, tuple)) or len(completions) != len(lengths):
            raise InputError(f"as_sampled: completion lengths need one prompt length per request, as many as the "
                             f"completions; got {prompt_lengths!r} and {completion_lengths!r}")
        requests = tuple(range(len(lengths))) if rows is None else (
            tuple(rows) if isinstance(rows, (list, tuple)) else ())
        if not requests or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(lengths)
                               for i in requests):
            raise InputError(f"as_sampled: rows are indices of the {len(lengths)} requests of the batch; got {rows!r}")
        state = (requests, SampledBatch(lengths, completions))
    token = _SAMPLED.set(state)
    try:
        yield
    finally:
        _SAMPLED.reset(token)


def _prompt_len(b: int, batch: int) -> tuple[int | None, tuple[SampledBatch, int] | None]:
    """Batch row ``b``'s prompt length under :func:`as_sampled`, and its (engine batch, index) where
    the rows were sampled together."""
    got = _SAMPLED.get()
    if got is None:
        return None, None
    lengths, together = got
    if together is not None:  # lengths: the engine batch's requests that this forward's rows are
        if len(lengths) != batch:
            raise InputError(f"as_sampled: {len(lengths)} requests of the engine batch for a forward of {batch} rows "
                             "(give rows= for a micro-batch)")
        return together.prompt_lengths[lengths[b]], (together, lengths[b])
    if len(lengths) == 1:
        return lengths[0], None
    if len(lengths) != batch:
        raise InputError(f"as_sampled: {len(lengths)} prompt lengths for a batch of {batch} rows")
    return lengths[b], None


def _check_sampled_row(n: int, prompt_len: int | None, together: tuple[SampledBatch, int] | None) -> None:
    """A row of ``n`` real tokens fits what :func:`as_sampled` says of it (checked before any cost: the
    split plan of a batch sampled together grows with the completion lengths it is told)."""
    if prompt_len is not None and prompt_len > n:
        raise InputError(f"as_sampled: a prompt of {prompt_len} tokens in a row of {n} tokens")
    if together is not None:
        batch, i = together
        p, c = batch.prompt_lengths[i], batch.completion_lengths[i]
        if p + c != n:
            raise InputError(f"as_sampled: request {i} has prompt + completion = {p} + {c} = {p + c} tokens, but its "
                             f"row has {n} (not counting padding); prompt + completion must equal the row's length: "
                             "the row is the request's prompt and the tokens the engine sampled for it")


# -- exact mode through the engine's own attention kernel (apply_profile(..., kernels="engine")) ---------
# engine name -> its kernel, one engine call over several requests (engineprofiles.engines: the record's
# exact_attention), loaded by apply_profile when the engine is importable in this process and picks the
# kernel the profile recorded
ENGINE_KERNELS: dict[str, object] = {}


def _call(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, split_kv: bool) -> torch.Tensor:
    """One request alone in an engine call."""
    return fn([(q, k, v)], scale=scale, split_kv=split_kv)[0]


def _causal_rows(qe: torch.Tensor, sub: torch.Tensor | None, tk: int) -> torch.Tensor | None:
    """The query rows that see a key (bool [Tq]) where ``sub`` (the row's [Tq, Tk] mask over its real keys) is
    causal over the keys for them, as an engine call is; None where it is not (or no row sees a key)."""
    real = torch.ones(qe.shape[0], dtype=torch.bool) if sub is None else sub.any(-1).cpu()
    n = int(real.sum())
    if sub is not None and (n == 0 or not torch.equal(sub[real].cpu(), causal_mask(n, tk))):
        return None
    return real


def _engine_row(fn, qe: torch.Tensor, ke: torch.Tensor, ve: torch.Tensor, scale: float, sub: torch.Tensor | None,
                kv_split: KVSplit | None, prompt_len: int | None) -> torch.Tensor | None:
    """One batch row (engine layout [T, H, D], padding keys dropped; ``sub``: the row's [Tq, Tk] mask over
    them) through the engine's kernel, as the engine computed it: one call, or with ``kv_split`` and
    ``prompt_len`` the prompt in one call and each later query as a decode step over the keys before it,
    split as the engine's scheduler splits with ``kv_split.threads`` threads. None where the row's mask is
    not causal over its keys for the queries that see any (the portable reference takes those)."""
    tk = ke.shape[0]
    real = _causal_rows(qe, sub, tk)
    if real is None:
        return None
    n = int(real.sum())
    q_real = qe[real]
    threads = torch.get_num_threads()
    if kv_split is not None:
        torch.set_num_threads(kv_split.threads)  # the engine's: its scheduler splits by the thread count
    try:
        split = kv_split is not None
        if prompt_len is None or not split:
            o = _call(fn, q_real, ke, ve, scale, split)
        else:
            first = tk - n  # the position of the first real query
            parts = []
            if first < prompt_len:  # queries of the prompt: the engine's prefill of it
                parts.append(_call(fn, q_real[:prompt_len - first], ke[:prompt_len], ve[:prompt_len], scale, True))
            for j in range(max(first, prompt_len), tk):  # decode steps, one query over the keys before it
                parts.append(_call(fn, q_real[j - first:j - first + 1], ke[:j + 1], ve[:j + 1], scale, True))
            o = torch.cat(parts)
    finally:
        torch.set_num_threads(threads)
    out = qe.new_zeros(qe.shape)
    out[real] = o.to(out.device)
    return out


def _engine_together(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                     kv_split: KVSplit) -> dict[int, torch.Tensor]:
    """The rows of a forward sampled together (:func:`as_sampled` with completion lengths) through the engine's
    kernel, as the engine computed them: every engine call of the batch (its prompts' prefill, then each decode
    step of the requests still running: :meth:`SampledBatch.steps`), split as the engine's scheduler splits the
    whole call. A request this forward does not hold (a micro-batch: ``rows=``) goes in with zeros: a request's
    outputs depend on the others' lengths (the plan), not on their values. The position the engine never ran as
    a query (the last sampled token) is computed unsplit. {batch row: [Hq, Tq, D]}; a row whose mask is not
    causal over its real tokens, or not that of its request's tokens, is left out (the portable reference)."""
    got = _SAMPLED.get()
    if got is None or got[1] is None or len(got[0]) != q.shape[0]:
        return {}
    requests, batch = got
    held = {}  # request -> (batch row, its real queries' rows, q, k, v of its real tokens, engine layout)
    for b, r in enumerate(requests):
        allowed = allowed_from_mask(mask, b, q.shape[2], k.shape[2], q.device)
        qe, ke, ve = q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1)
        sub = None
        if allowed is not None:
            idx = allowed.any(0).nonzero()[:, 0]
            ke, ve, sub = ke[idx], ve[idx], allowed[:, idx]
        real = _causal_rows(qe, sub, ke.shape[0])
        n = batch.prompt_lengths[r] + batch.completion_lengths[r]
        if real is None or int(real.sum()) != n or ke.shape[0] != n or r in held:
            continue
        held[r] = (b, real, qe[real], ke, ve)
    if not held:
        return {}
    outs = {r: x[2].new_zeros(x[2].shape) for r, x in held.items()}
    hq, d = q.shape[1], q.shape[3]
    hk = k.shape[1]
    threads = torch.get_num_threads()
    torch.set_num_threads(kv_split.threads)  # the engine's: its scheduler splits by the thread count
    try:
        for step in batch.steps():
            call = []
            for r, nq, tk in step:
                if r in held:
                    _, _, qr, kr, vr = held[r]
                    call.append((qr[tk - nq:tk], kr[:tk], vr[:tk]))
                else:
                    call.append((q.new_zeros(nq, hq, d), k.new_zeros(tk, hk, d), v.new_zeros(tk, hk, d)))
            for (r, nq, tk), o in zip(step, fn(call, scale=scale, split_kv=True)):
                if r in held:
                    outs[r][tk - nq:tk] = o.to(outs[r].device)
        for r, (_, _, qr, kr, vr) in held.items():  # the last sampled token: never a query in the engine
            outs[r][-1:] = _call(fn, qr[-1:], kr, vr, scale, False).to(outs[r].device)
    finally:
        torch.set_num_threads(threads)
    result = {}
    for r, (b, real, *_) in held.items():
        out = q.new_zeros(q.shape[2], q.shape[1], q.shape[3])
        out[real.to(out.device)] = outs[r]
        result[b] = out.transpose(0, 1)
    return result


def _packed_segments(allowed: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The sequences packed in one batch row: (query positions, key positions) of each, where the row's
    mask over its real queries and keys (those that see / are seen by any) is block-diagonal causal with
    two or more blocks; None for any other mask."""
    if allowed is None or allowed.shape[0] != allowed.shape[1]:
        return None
    qi, ki = allowed.any(-1).nonzero()[:, 0], allowed.any(0).nonzero()[:, 0]
    if len(qi) != len(ki) or len(qi) < 2:
        return None
    a = allowed[qi][:, ki].cpu()
    first = a.to(torch.uint8).argmax(-1)  # each real query's first key
    starts = ((first[1:] != first[:-1]).nonzero()[:, 0] + 1).tolist()
    if not starts:
        return None
    bounds = [0, *starts, len(qi)]
    if not torch.equal(a, torch.block_diag(*(causal_mask(e - b, e - b) for b, e in zip(bounds, bounds[1:])))):
        return None
    return [(qi[b:e], ki[b:e]) for b, e in zip(bounds, bounds[1:])]


def _one_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, point: Point, scale: float,
             allowed: torch.Tensor | None, kv_split: KVSplit | None = None,
             prompt_len: int | None = None, together: tuple[SampledBatch, int] | None = None,
             kernels: str = "") -> torch.Tensor:
    """q [Hq, Tq, D], k/v [Hk, Tk, D] of one batch row -> [Hq, Tq, D]. ``kernels``: the engine whose kernel
    computes it (:data:`ENGINE_KERNELS`; rows sampled together in a batch: :func:`_engine_together`, those it
    leaves take the portable reference)."""
    qe, ke, ve = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # engine layout [T, H, D]
    if allowed is not None and not bool(allowed.any()):  # a row of padding only: no key to attend, zeros
        return q.new_zeros(q.shape)
    segments = _packed_segments(allowed)
    if segments is not None:  # packed sequences: each alone, as the engine ran it
        if prompt_len is not None or together is not None:
            raise InputError(f"as_sampled describes one sequence per batch row; this row packs {len(segments)} "
                             "(position_ids restarting, a block-diagonal mask): score packed rows without as_sampled, "
                             "or one sequence per row")
        out = q.new_zeros(q.shape)
        for qi, ki in segments:
            qi, ki = qi.to(q.device), ki.to(q.device)
            out[:, qi] = _one_row(q[:, qi], k[:, ki], v[:, ki], point, scale, None, kv_split, kernels=kernels)
        return out
    idx = None
    if allowed is not None:
        keep = allowed[-1] if bool(allowed[-1].any()) else allowed.any(0)
        if bool((allowed & ~keep).any()):
            raise InputError("exact attention: a query of this row sees a key its last query does not (a mask that is "
                             "neither causal over the row's real tokens, nor padded, nor packed sequences with "
                             "position_ids restarting); the engine runs each sequence alone and causal: pass such "
                             "rows one sequence per row")
        idx = keep.nonzero()[:, 0]
    _check_sampled_row(k.shape[1] if idx is None else len(idx), prompt_len, together)
    if kv_split is None:
        prompt_len, together = None, None
    if kernels and together is None:
        sub = None if allowed is None else (allowed if idx is None else allowed[:, idx])
        kx, vx = (ke, ve) if idx is None else (ke[idx], ve[idx])
        out = _engine_row(ENGINE_KERNELS[kernels], qe, kx, vx, scale, sub, kv_split, prompt_len)
        if out is not None:
            return out.transpose(0, 1)
    if idx is None:
        return attention_ref(qe, ke, ve, point, scale=scale, kv_split=kv_split, prompt_len=prompt_len,
                             sampled_batch=together).transpose(0, 1)
    out = attention_ref(qe, ke[idx], ve[idx], point, scale=scale, mask=allowed[:, idx], kv_split=kv_split,
                        prompt_len=prompt_len, sampled_batch=together)
    return out.transpose(0, 1)


_GRADIENT_PASS: contextvars.ContextVar[bool] = contextvars.ContextVar("emulator_gradient_pass", default=False)


@contextlib.contextmanager
def gradient_pass() -> Iterator[None]:
    """Within it, exact attention's forward is FP32 attention rounded once, not the engine's arithmetic:
    for a forward run only for its gradient, whose outputs' bits another run gives
    (``patching.forwards.compiled_stack`` with gradients on). The backward is the same either way (the
    gradient of FP32 attention at the saved q, k, v)."""
    token = _GRADIENT_PASS.set(True)
    try:
        yield
    finally:
        _GRADIENT_PASS.reset(token)


def exact_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, point: Point, scale: float,
                  mask: torch.Tensor | None, kv_split: KVSplit | None = None, kernels: str = "") -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hk, Tk, D] -> [B, Hq, Tq, D] in the activation dtype. ``kv_split``:
    each batch row is one request alone in the engine, its rows split as :class:`KVSplit` plans.
    ``kernels``: the engine whose own kernel computes the rows (""; the portable reference)."""
    if q.numel() == 0:  # no batch row, head, query or lane: an empty output, nothing to compute
        return q.new_zeros(q.shape)
    if _GRADIENT_PASS.get():
        return _sdpa_fp32(q.float(), k.float(), v.float(), scale, mask).to(q.dtype)
    done = _engine_together(ENGINE_KERNELS[kernels], q, k, v, scale, mask, kv_split) if (
        kernels and kv_split is not None) else {}
    outs = []
    for b in range(q.shape[0]):
        if b in done:
            outs.append(done[b])
            continue
        allowed = allowed_from_mask(mask, b, q.shape[2], k.shape[2], q.device)
        outs.append(_one_row(q[b], k[b], v[b], point, scale, allowed, kv_split, *_prompt_len(b, q.shape[0]),
                             kernels=kernels))
    return torch.stack(outs)


def kv_split_key(kv_split: KVSplit | None) -> str:
    """A string for the custom op ("" for none); :func:`kv_split_from_key` gives it back."""
    if kv_split is None:
        return ""
    return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(kv_split).items())


def kv_split_from_key(key: str) -> KVSplit | None:
    if not key:
        return None
    kw = dict(kv.split("=", 1) for kv in key.split(","))
    return KVSplit(**{k: int(v) if v.isdigit() else v for k, v in kw.items()})  # the counts, and merge


def fp32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """softmax(q k^T * scale) v in ``dtype`` with the same masks, [B, Hq, Tq, D]: the function
    whose gradient the backward is (and, in FP64, the tests' independent reference)."""
    outs = []
    for b in range(q.shape[0]):
        allowed = allowed_from_mask(mask, b, q.shape[2], k.shape[2], q.device)
        o = attention_fp32(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), scale=scale,
                           mask=allowed, dtype=dtype)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs)


def _sdpa_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """:func:`fp32_attention` through torch's fused FP32 attention (its backward about 3x faster on CPU than
    autograd through the materialized softmax; the same function, to FP32 accuracy): a query row that may attend
    to no key gives zeros, as there, and passes no gradient."""
    tq, tk = q.shape[2], k.shape[2]
    if mask is None:
        allowed = causal_mask(tq, tk, q.device)[None, None]
    else:
        allowed = torch.stack([allowed_from_mask(mask, b, tq, tk, q.device) for b in range(q.shape[0])])[:, None]
    seen = allowed.any(-1, keepdim=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~seen, scale=scale,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    return out.masked_fill(~seen, 0.0)


def exact_backward(q, k, v, grad, scale: float, mask, need: tuple[bool, bool, bool]):
    """(dq, dk, dv), None where ``need`` says no: the gradient of FP32 attention."""
    if q.numel() == 0:  # an empty output depends on nothing
        return tuple(torch.zeros_like(t) if n else None for t, n in zip((q, k, v), need))
    with autograd_in_op():
        qf, kf, vf = (t.detach().float().requires_grad_(n) for t, n in zip((q, k, v), need))
        out = _sdpa_fp32(qf, kf, vf, scale, mask)
        wrt = [t for t in (qf, kf, vf) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wrt, grad.float())) if wrt else iter(())
    return tuple(next(grads).to(t.dtype) if n else None for t, n in zip((q, k, v), need))


class ExactAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, point, scale, mask, kv_split=None, kernels=""):  # type: ignore[override]
        ctx.save_for_backward(q, k, v)
        ctx.point, ctx.scale, ctx.mask = point, scale, mask
        return exact_forward(q, k, v, point, scale, mask, kv_split, kernels)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        dq, dk, dv = exact_backward(q, k, v, grad, ctx.scale, ctx.mask, tuple(ctx.needs_input_grad[:3]))
        return dq, dk, dv, None, None, None, None, None


# -- torch.compile: the same forward and backward as opaque custom ops (see _utils.point_key) ---


@torch.library.custom_op("emulator::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, point: str, scale: float,
                 mask: torch.Tensor | None, kv_split: str = "", kernels: str = "") -> torch.Tensor:
    return owned(exact_forward(q, k, v, point_from_key(point), scale, mask, kv_split_from_key(kv_split), kernels),
                 q, k, v, mask)


@attention_op.register_fake
def _attention_fake(q, k, v, point, scale, mask, kv_split="", kernels=""):
    return q.new_empty(q.shape)


@torch.library.custom_op("emulator::attention_bwd", mutates_args=())
def attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, scale: float,
                     mask: torch.Tensor | None, need: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv); an empty tensor where ``need`` says no gradient."""
    grads = exact_backward(q, k, v, grad, scale, mask, tuple(need))
    return tuple(owned(g, q, k, v, grad, mask) if g is not None else t.new_empty(0)  # type: ignore[return-value]
                 for g, t in zip(grads, (q, k, v)))


@attention_bwd_op.register_fake
def _attention_bwd_fake(q, k, v, grad, scale, mask, need):
    return tuple(t.new_empty(t.shape) if n else t.new_empty(0) for t, n in zip((q, k, v), need))


def _attention_setup(ctx, inputs, output):
    q, k, v, _, scale, mask, *_ = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.scale = scale


def _attention_op_backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    need = [bool(n) for n in ctx.needs_input_grad[:3]]
    dq, dk, dv = attention_bwd_op(q, k, v, grad, ctx.scale, mask, need)
    return (*(g if n else None for g, n in zip((dq, dk, dv), need)), None, None, None, None, None)


attention_op.register_autograd(_attention_op_backward, setup_context=_attention_setup)
