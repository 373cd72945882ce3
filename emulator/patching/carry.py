"""The residual stream between patched decoder layers.

Engines fuse each residual add into the next norm, so a patched layer needs the previous layer's
(MLP output, residual) pair, not their sum; HF's decoder loop passes one tensor. Each patched layer
returns ``h = m + residual`` and puts ``(m, residual)`` in a per-model :class:`Stash` keyed by
where ``h`` lives; the next layer looks it up, and :class:`Carry` hands the pair on as values
while the gradient flows through ``h``.

A cast of ``h`` between the layers (FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)``
casting an FP32 residual stream to the parameters' dtype) is recognized: the next layer's input
is then a new tensor whose values are exactly ``h`` cast, and :class:`CarryCast` hands on the
stashed pair (the stream's full precision) while the gradient reaches ``h`` itself, in full
precision.

The stash is per model and lives on the decoder's modules (``_emulator_stash``); a deepcopy of a
patched model gets a new, empty one (:meth:`Stash.__deepcopy__`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


def _storage_ref(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


class Stash:
    """(MLP output, residual) of each patched layer's output ``h``, found again by where ``h``
    lives. An entry is valid while ``h``'s storage is alive (so it cannot match a tensor that
    reuses the memory later), and is dropped once that storage is freed.

    Under torch.compile, where a tensor has no storage to look at, the pair travels in ``last``
    instead and is found by identity (the tensor object the previous layer returned): tracing
    sees that the next layer gets exactly the previous layer's output. A layer whose input comes
    from outside the compiled code (a layer compiled alone) looks it up where it lives, outside the
    compiled graph (a graph break)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor, Any]] = {}
        self.last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __deepcopy__(self, memo: dict) -> "Stash":
        # A copy of the model carries its own residual stream: the entries belong to the tensors
        # of the original's forwards.
        return Stash()

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())

    def put(self, h: torch.Tensor, m: torch.Tensor, residual: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            self.last = (h, m, residual)
            return
        self.purge()
        self._entries[self._key(h)] = (_storage_ref(h), m, residual, weakref.ref(h))

    def get(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``(m, residual, source)`` of the stream ``t``: ``source`` is None when ``t`` is the
        previous layer's output itself, or that output (``h``) when ``t`` is a cast of it."""
        last = self.last
        if last is not None and last[0] is t:
            return last[1], last[2], None
        if torch.compiler.is_compiling():
            return _lookup_outside_compile(self, t)
        return self._lookup(t)

    def _lookup(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        e = self._entries.get(self._key(t))
        if e is not None and not e[0].expired() and e[0] == _storage_ref(t):
            return e[1], e[2], None
        return self._cast_of(t)

    def _cast_of(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The newest live entry whose ``h``, cast to ``t``'s dtype, is ``t`` bit for bit (FSDP2's
        cast_forward_inputs cast the stream): a value check, not a guess."""
        for ref, m, r, href in reversed(list(self._entries.values())):
            h = href()
            if h is None or ref.expired() or h.dtype == t.dtype or h.shape != t.shape or h.device != t.device:
                continue
            if _same_bits(h.detach().to(t.dtype), t.detach()):
                return m, r, h
        return None

    def purge(self) -> None:
        self.last = None
        if torch.compiler.is_compiling():
            return
        for k in [k for k, e in self._entries.items() if e[0].expired()]:
            del self._entries[k]

    def clear(self) -> None:
        self._entries.clear()
        self.last = None

    def __len__(self) -> int:
        return len(self._entries)


@torch.compiler.disable
def _lookup_outside_compile(stash: Stash, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
    """The pair of ``t``, looked up where it lives (run outside the compiled graph: a graph break).
    ``t`` may be the previous layer's output re-wrapped by a hook that torch.compile does not trace
    (FSDP2's), so ``last`` is matched like the stash's entries, by where the tensor lives."""
    last = stash.last
    if last is not None and Stash._key(last[0]) == Stash._key(t) and _storage_ref(last[0]) == _storage_ref(t):
        return last[1], last[2], None
    return stash._lookup(t)


_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype not in _INT:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(_INT[a.dtype]), b.contiguous().view(_INT[b.dtype]))


def carry(t: torch.Tensor, carried: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]):
    """The (m, residual) pair handed on to the next region for the stream ``t`` (see :meth:`Stash.get`)."""
    m, r, source = carried
    if source is None:
        return Carry.apply(t, (m, r))
    return CarryCast.apply(t, source, (m, r))


class Carry(torch.autograd.Function):
    """Hand the stashed (m, residual) on as values while the gradient flows through ``h``.

    ``h = m + residual`` is what the previous layer returned; the next region is
    ``add_rmsnorm(m, residual)``, whose backward gives both inputs the gradient of their FP32 sum
    s (straight-through). So the gradient of h is that of the residual input (in h's dtype,
    which is the residual's), and autograd carries it from h back to m and the residual."""

    @staticmethod
    def forward(ctx, h, pair):  # type: ignore[override]
        m, residual = pair
        return m.detach(), residual.detach()

    @staticmethod
    def backward(ctx, dm, dresidual):  # type: ignore[override]
        return dresidual, None


class CarryCast(torch.autograd.Function):
    """:class:`Carry` for a stream ``t`` that is a cast of the previous layer's output ``h``: the
    gradient goes to ``h`` in its own (full) precision, not through the cast; ``t`` gets a
    gradient of -0.0 (the additive identity, so what reaches ``h`` through the cast changes no
    bit), which keeps the hooks on ``t``'s path (FSDP2's post-backward) firing as they would."""

    @staticmethod
    def forward(ctx, t, h, pair):  # type: ignore[override]
        m, residual = pair
        ctx.t_meta = (t.shape, t.dtype, t.device)
        return m.detach(), residual.detach()

    @staticmethod
    def backward(ctx, dm, dresidual):  # type: ignore[override]
        shape, dtype, device = ctx.t_meta
        return torch.full(shape, -0.0, dtype=dtype, device=device), dresidual, None
